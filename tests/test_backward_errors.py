"""An exception raised by Python code that autograd's engine runs (an op, a hook, a saved-tensor
unpack, a KeyboardInterrupt) reaches the caller of `backward()` or `autograd.grad()` as that
exception, and the process stays usable: memory comes back and the next step is right.

Each case runs in its own process, so a regression (an abort) is a failed test, not a lost run.
"""
import gc
import json

import pytest
import torch
from conftest import CHIP, device_mode_only, run_python, runs_once

import flagos

pytestmark = device_mode_only

# Training steps on flagos that fail inside backward, each followed by a clean step whose
# gradients are compared with the same step on plain CPU, all in one process.
PRELUDE = """
import gc, torch, flagos
flagos.activate("{chip}")
d = flagos.device()
torch.manual_seed(0)
ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
model.load_state_dict(ref.state_dict())
model = model.to(d)
x = torch.randn(8, 16)
loss_of = lambda out: (out * out).sum(dim=(0, 1))   # ops every chip runs natively
ref_loss = loss_of(ref(x))
ref_loss.backward()
"""

CASE = """
print("CASE {name}")
{setup}
loss = loss_of(model(x.to(d)))
{arm}
try:
    loss.backward(torch.ones((), device=d))
    print("NO ERROR")
except Exception as e:
    print("RAISED", type(e).__module__ + "." + type(e).__name__, "|", str(e).splitlines()[0])
{disarm}
del loss
gc.collect()
model.zero_grad(set_to_none=True)
loss_of(model(x.to(d))).backward(torch.ones((), device=d))
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1.3e-6, atol=1e-5)
print("NEXT STEP OK")
"""

CASES = {
    # an op routed to 'error' that only the backward pass uses (ReLU's backward)
    "error_route": dict(
        arm='flagos.set_route("aten::threshold_backward", "error")',
        disarm='flagos.set_route("aten::threshold_backward", "auto")',
        expect="flagos.errors.FallbackError | aten::threshold_backward is routed to 'error'"),
    # the strict mode meeting a fallback inside backward (the policy is read at activation
    # from FLAGOS_FALLBACK; the clean step allows fallbacks again: sim has no ReLU backward)
    "strict_fallback": dict(
        arm=('flagos._C.set_fallback_policy(2)\n'
             'flagos.set_route("aten::threshold_backward", "fallback")'),
        disarm=('flagos._C.set_fallback_policy(0)\n'
                'flagos.set_route("aten::threshold_backward", "auto")'),
        # (on sim the first backward fallback may be another op, e.g. the engine's add_)
        expect="flagos.errors.FallbackError | aten::", also="would fall back to the CPU"),
    # an override kernel that raises its own exception type
    "override_raises": dict(
        setup=("def bad(*a, **k):\n    raise KeyError('override failed')\n"
               "flagos.register_kernel('aten::threshold_backward', bad, chip='{chip}')"),
        disarm="flagos.unregister_kernel('aten::threshold_backward', chip='{chip}')",
        expect="builtins.KeyError | 'override failed'"),
    # a chip failure in flagos's vocabulary, from mm (armed after the forward pass uses it)
    "device_error": dict(
        arm=("def bad(*a, **k):\n    raise flagos.DeviceError('kernel crashed', chip='{chip}', code=7)\n"
             "flagos.register_kernel('aten::mm', bad, chip='{chip}')"),
        disarm="flagos.unregister_kernel('aten::mm', chip='{chip}')",
        expect="flagos.errors.DeviceError | kernel crashed"),
}


@runs_once
@pytest.mark.parametrize("chip", ["cpu", "sim"])
def test_errors_inside_backward_reach_the_caller(chip):
    code = PRELUDE.format(chip=chip) + "".join(
        CASE.format(name=name, **{k: case.get(k, "").format(chip=chip)
                                  for k in ("setup", "arm", "disarm")})
        for name, case in CASES.items())
    proc = run_python(code, env={"FLAGOS_FALLBACK": "allow"}, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"
    for name, case in CASES.items():
        block = out.split(f"CASE {name}\n", 1)[1].split("CASE ", 1)[0]
        assert block.startswith(f"RAISED {case['expect']}"), (name, block)
        assert case.get("also", "") in block.splitlines()[0], (name, block)
        assert "NEXT STEP OK" in block, (name, block)


@runs_once
def test_out_of_memory_inside_backward_on_sim():
    """Forward fits in the pool; a filler leaves too little for the gradients. backward()
    raises torch.OutOfMemoryError, every byte comes back, and the next step runs."""
    proc = run_python("""
        import gc, torch, flagos
        flagos.activate("sim")
        m = torch.flagos
        x = torch.randn(256 * 1024)                         # 1 MiB
        w = torch.randn(256 * 1024).to("flagos").requires_grad_()
        base = m.memory_allocated()
        loss = (w * x.to("flagos")).sum()
        free, _ = m.mem_get_info()
        filler = torch.empty(free // 4 - 1024, device="flagos")   # leaves 4 KiB free
        try:
            loss.backward()
            print("NO ERROR")
        except torch.OutOfMemoryError as e:
            print("RAISED OOM |", str(e).splitlines()[0])
        del filler, loss
        w.grad = None
        gc.collect(); gc.collect()   # the engine frees its graph task's references in a cycle
        print("LEAK", m.memory_allocated() - base)
        (w * x.to("flagos")).sum().backward()
        torch.testing.assert_close(w.grad.cpu(), x)
        print("NEXT STEP OK")
    """, env={"FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_MEMORY": "4M"}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "RAISED OOM | sim device 0 out of memory." in proc.stdout, proc.stdout
    assert "LEAK 0" in proc.stdout and "NEXT STEP OK" in proc.stdout


def test_outside_backward_errors_raise_at_the_op(dev):
    """The deferral is for autograd's engine only: a failing forward op raises right there."""
    import torch

    import flagos
    flagos.set_route("aten::mul.Tensor", "error")
    with pytest.raises(flagos.FallbackError, match="routed to 'error'"):
        torch.ones(2, device=dev) * 2


@runs_once
def test_fault_injection_over_a_training_loop_on_sim():
    """An allocation fails somewhere inside a six-step training loop on sim (forward or
    backward, wherever allocation #N falls). The loop catches it and skips that step; the
    final weights equal a CPU run that skipped the same step."""
    proc = run_python("""
        import torch, flagos
        flagos.activate("sim")
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        model.load_state_dict(ref.state_dict())
        model = model.to("flagos")
        data = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(6)]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        failed = []
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            try:
                loss = ((model(x.to("flagos")) - y.to("flagos")) ** 2).mean()
                loss.backward()
                opt.step()
            except torch.OutOfMemoryError as e:
                failed.append(step)
                print("STEP", step, "FAILED |", str(e).splitlines()[0][:80])
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step, (x, y) in enumerate(data):
            if step in failed:
                continue
            ref_opt.zero_grad(set_to_none=True)
            ((ref(x) - y) ** 2).mean().backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
        print("FAILED STEPS", failed, "WEIGHTS MATCH")
    """, env={"FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_FAIL_ALLOC_AT": "60"}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "FAILED | sim device 0 out of memory." in proc.stdout
    assert "WEIGHTS MATCH" in proc.stdout and "FAILED STEPS [" in proc.stdout
    assert "FAILED STEPS []" not in proc.stdout


@runs_once
def test_error_paths_do_not_leak():
    """Failing calls, repeated, hold on to no device memory and no Python objects."""
    proc = run_python("""
        import gc, torch, flagos
        flagos.activate("sim")
        m = torch.flagos
        x = torch.ones(256, device="flagos", requires_grad=True)
        def failures():
            for make in (lambda: torch.empty(2**40, device="flagos"),          # out of memory
                         lambda: x + torch.ones(256),                           # mixed devices
                         lambda: torch.empty(-1, device="flagos")):             # bad size
                try:
                    make()
                except (RuntimeError, torch.OutOfMemoryError):
                    pass
            loss = (x * 2).sum()
            flagos.set_route("aten::mul.Tensor", "error")
            try:
                loss.backward()                                                 # fails inside backward
            except flagos.FallbackError:
                pass
            flagos.set_route("aten::mul.Tensor", "auto")
            y = x * 3
            y.register_hook(hook_fails)
            try:
                y.sum().backward()                                              # a hook fails
            except ValueError:
                pass
            x.grad = None
        def hook_fails(grad):
            raise ValueError("hook failed")
        failures()
        gc.collect(); gc.collect()
        mem, objs = m.memory_allocated(), len(gc.get_objects())
        for _ in range(30):
            failures()
        gc.collect(); gc.collect()
        print("MEM", m.memory_allocated() - mem, "OBJS", len(gc.get_objects()) - objs)
    """, env={"FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_MEMORY": "16M"})
    mem, objs = proc.stdout.split()[1], int(proc.stdout.split()[3])
    assert mem == "0", proc.stdout
    assert objs < 30, proc.stdout  # nothing grows per failing round


# ---- every Python callable the engine runs, on the chip under test -----------------------------
#
# Each path runs one training step with a failing callable armed, on plain CPU and on flagos, in
# the same process, through backward() and through autograd.grad(); the caller must get the same
# exception on both, and the clean step that follows must give CPU's gradients.

HOOK_HEADER = """
import os, signal, time, torch, traceback, flagos
# Python's own SIGINT handler even where the test runner was started with SIGINT ignored (a
# background job of a non-interactive shell), which Python would otherwise keep
signal.signal(signal.SIGINT, signal.default_int_handler)
flagos.activate("{chip}")
torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
X = torch.randn(8, 16)

def fail(*args):
    raise ValueError("raised by the callable")

def interrupt(*args):
    raise KeyboardInterrupt

def sigint(*args):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)  # the signal lands while backward is still running
"""

# One path: a step with the callable armed, then a clean step; its lines start with the path.
HOOK_STEP = """
def step_{name}(dev, entry):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model.load_state_dict(MODEL.state_dict())
    model = model.to(dev)
    x = X.to(dev)
    handles = []
{before}
    out = model(x)
{after}
    loss = (out * out).sum()
    try:
        if entry == "backward":
            loss.backward()
        else:
            torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        got = "no error"
    except BaseException as e:  # KeyboardInterrupt included
        got = type(e).__name__ + ": " + str(e)
        # the traceback keeps the frame that raised, as on CPU
        frames = {{f.name for f in traceback.extract_tb(e.__traceback__)}}
        got += "".join(f" [raised in {{name}}]" for name in ("fail", "interrupt") if name in frames)
    for h in handles:
        h.remove()
    del out, loss
    model.zero_grad(set_to_none=True)
    (model(x) ** 2).sum().backward()
    return got, [p.grad.cpu() for p in model.parameters()]

for entry in ("backward", "grad"):
    want, want_grads = step_{name}("cpu", entry)
    got, grads = step_{name}(flagos.device(), entry)
    print("{name}", entry, "CPU |", want)
    print("{name}", entry, "FLAGOS |", got)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1.3e-6, atol=1e-5)
    print("{name}", entry, "NEXT STEP OK")
print("{name} ALIVE")
"""

FAILED = "ValueError: raised by the callable"
POISONED = "RuntimeError: Trying to execute AccumulateGrad node that was poisoned by swap_tensors"

# before: armed before the forward pass; after: between forward and backward. expect: what the
# caller gets, through backward() and through grad() (grad() accumulates nothing, so it never
# runs an AccumulateGrad node or its hooks: "no error" there, as on CPU).
HOOK_PATHS = {
    "tensor_hook": dict(after="out.register_hook(fail)", expect=(FAILED, FAILED)),
    "module_full_backward_hook": dict(
        before="handles.append(model[1].register_full_backward_hook(fail))",
        expect=(FAILED, FAILED)),
    "module_full_backward_pre_hook": dict(
        before="handles.append(model[1].register_full_backward_pre_hook(fail))",
        expect=(FAILED, FAILED)),
    "post_accumulate_grad_hook": dict(
        before="handles.append(model[0].weight.register_post_accumulate_grad_hook(fail))",
        expect=(FAILED, "no error")),
    "saved_tensors_unpack": dict(
        before=("hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, fail)\n"
                "hooks.__enter__()"),
        after="hooks.__exit__(None, None, None)",
        expect=(FAILED, FAILED)),
    "keyboard_interrupt_from_hook": dict(
        after="out.register_hook(interrupt)",
        expect=("KeyboardInterrupt: ", "KeyboardInterrupt: ")),
    # A real SIGINT: Python runs signal handlers in the main thread only, so on flagos it is
    # raised there once the engine hands back (on CPU, inside the hook): backward() raises it.
    "sigint_during_backward": dict(
        after="out.register_hook(sigint)",
        expect=("KeyboardInterrupt: ", "KeyboardInterrupt: ")),
    # torch.compiler patches the engine's entry while it traces and then puts back what it
    # found: flagos's check must be what it finds.
    "after_torch_compiler_patched_the_engine": dict(
        before=("import contextlib\n"
                "patch = getattr(torch.compiler, '_patch_engine_backward', contextlib.nullcontext)\n"
                "with patch():\n"
                "    pass"),
        after="out.register_hook(fail)", expect=(FAILED, FAILED)),
    "swap_tensors_poisoned_accumulate_grad": dict(
        after=("w = model[0].weight\n"
               "torch.utils.swap_tensors(w, torch.nn.Parameter(w.detach().clone()))"),
        expect=(POISONED, "no error"),
        # flagos answers swap_tensors for flagos tensors the way `.data =` works on CPU (what
        # Module._apply means by it; docs/design.md §13), so nothing is poisoned there.
        on_flagos=("no error", "no error")),
}


def _indent(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


@pytest.fixture(scope="module")
def hook_paths_run():
    """Every path, one after the other, in one process on the chip under test: each must leave
    the process as it found it for the next (and the process starts once, not once a path)."""
    code = HOOK_HEADER.format(chip=CHIP) + "".join(
        HOOK_STEP.format(name=name, before=_indent(case.get("before", "")),
                         after=_indent(case.get("after", "")))
        for name, case in HOOK_PATHS.items())
    proc = run_python(code, env={"FLAGOS_FALLBACK": "allow"}, check=False)
    return proc


@pytest.mark.parametrize("path", HOOK_PATHS)
def test_python_errors_inside_backward_reach_the_caller(path, hook_paths_run):
    case = HOOK_PATHS[path]
    proc = hook_paths_run
    out = proc.stdout
    assert f"{path} ALIVE" in out, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"
    on_flagos = case.get("on_flagos", (None, None))
    for entry, expect, flagos_outcome in zip(("backward", "grad"), case["expect"], on_flagos):
        want = out.split(f"{path} {entry} CPU | ", 1)[1].split("\n", 1)[0]
        got = out.split(f"{path} {entry} FLAGOS | ", 1)[1].split("\n", 1)[0]
        assert want.startswith(expect), (entry, want)   # the case fails on CPU as intended
        assert got == (flagos_outcome or want), (entry, got, want)
        assert f"{path} {entry} NEXT STEP OK" in out, out
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"


def test_each_error_reaches_its_own_backward_pass():
    """Two threads train at once and a hook runs a backward pass of its own: each caller gets
    the error of its own pass, and an error caught inside a hook leaves the outer pass alone."""
    proc = run_python(f"""
        import threading, torch, flagos
        flagos.activate("{CHIP}")
        d = flagos.device()

        def fail_with(message):
            def hook(grad):
                raise ValueError(message)
            return hook

        def train(name, results):
            for i in range(20):
                w = torch.ones(64, device=d, requires_grad=True)
                y = w * 2
                y.register_hook(fail_with(f"{{name}} {{i}}"))
                try:
                    y.sum().backward()
                    results.append("no error")
                except ValueError as e:
                    results.append(str(e) == f"{{name}} {{i}}")

        results = {{"a": [], "b": []}}
        threads = [threading.Thread(target=train, args=(n, results[n])) for n in results]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("THREADS", all(r is True for rs in results.values() for r in rs),
              [len(rs) for rs in results.values()])

        x = torch.ones(3, device=d, requires_grad=True)
        def outer(grad):
            z = torch.ones(3, device=d, requires_grad=True)
            with torch.enable_grad():
                inner = z * 3
                inner.register_hook(fail_with("inner"))
                try:
                    torch.autograd.grad(inner.sum(), z)
                except ValueError as e:
                    print("INNER CAUGHT", e)
            return grad
        y = x * 2
        y.register_hook(outer)
        y.sum().backward()
        print("OUTER GRAD", x.grad.cpu().tolist())

        # an op of the outer pass fails after a hook's own pass ended (an error the device
        # guard keeps for the pass): the outer caller gets it as it was raised
        def broken_cos(*args, **kwargs):
            raise KeyError("cos, after the inner pass")
        y = torch.sin(x)
        y.register_hook(outer)
        flagos.register_kernel("aten::cos", broken_cos, chip="{CHIP}")
        try:
            y.sum().backward()
        except KeyError as e:
            print("OUTER ERROR", e)
        flagos.unregister_kernel("aten::cos", chip="{CHIP}")
    """, env={"FLAGOS_FALLBACK": "allow"}, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"
    assert "THREADS True [20, 20]" in out, out
    assert "INNER CAUGHT inner" in out and "OUTER GRAD [2.0, 2.0, 2.0]" in out, out
    assert "OUTER ERROR 'cos, after the inner pass'" in out, out


# The engine entered without backward() or autograd.grad(), a hook failing inside: `{setup}`
# runs after activation.
ENGINE_WITHOUT_A_PASS = """
import torch, flagos
from flagos.runtime import _guard_errors
flagos.activate("{chip}")
{setup}
d = flagos.device()
x = torch.ones(3, device=d, requires_grad=True)
y = x * 2
def fail(grad):
    raise ValueError("raised by the hook")
y.register_hook(fail)
engine = torch.autograd.Variable._execution_engine
try:
    engine.run_backward((y.sum(),), (torch.ones((), device=d),), False, False, (), True, True)
except SystemError as e:
    print("SYSTEM ERROR |", e)
x.grad = None
(x * 2).sum().backward()
print("NEXT", x.grad.cpu().tolist())
"""


def run_engine_without_a_pass(setup=""):
    proc = run_python(ENGINE_WITHOUT_A_PASS.format(chip=CHIP, setup=setup), env={"FLAGOS_FALLBACK": "allow"},
                      check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "SYSTEM ERROR |" in proc.stdout and "NEXT [2.0, 2.0, 2.0]" in proc.stdout, proc.stdout
    return proc


def test_pending_error_outside_backward_is_reported():
    """No pass to file the error with: the caller gets PyTorch's SystemError, the error itself
    is logged, nothing aborts."""
    proc = run_engine_without_a_pass()
    assert "ValueError: raised by the hook" in proc.stderr, proc.stderr


def test_an_error_inside_the_error_keeper_is_printed_and_nothing_aborts():
    """The guard's `keep` itself failing (here its logger raises) happens inside a call PyTorch
    declares noexcept: the failure is printed as unraisable, the caller gets the SystemError of
    the case above and the next backward() works."""
    proc = run_engine_without_a_pass(setup=(
        "class BrokenLog:\n"
        "    def error(self, *args, **kwargs):\n"
        "        raise RuntimeError('the log is broken')\n"
        "_guard_errors.log = BrokenLog()"))
    assert "Exception ignored in: <function keep" in proc.stderr, proc.stderr
    assert "RuntimeError: the log is broken" in proc.stderr, proc.stderr


def test_the_guards_answer_shows_the_cyclic_collector_what_it_holds():
    """The C guard object holds its device type and the error keeper; the collector must see
    both (a keeper closing over the guard would otherwise be a cycle nothing frees)."""
    device_type = torch._C._autograd.DeviceType.PrivateUse1

    def keeper(exc):
        pass

    answer = flagos._C.GuardDeviceType(device_type, keeper)
    referents = gc.get_referents(answer)
    assert len(referents) == 2 and referents[0] is device_type and referents[1] is keeper
    assert answer() is device_type
    for args, kwargs in (((1,), {}), ((), {"device": 0}), ((1,), {"device": 0})):
        with pytest.raises(TypeError, match=r"type_\(\) takes no arguments"):
            answer(*args, **kwargs)


def test_a_pass_still_running_on_the_engine_thread_at_exit_ends_cleanly(tmp_path):
    """A pass that fails on the CPU side while flagos's engine thread still runs a slow hook:
    backward() raises at once (as on CPU) and the program ends while the engine thread holds the
    pass. The process exits with the program's status, not an abort in the engine thread, and
    the report written at exit is the program's: the drain's own ops are not in it."""
    report = tmp_path / "report.json"
    proc = run_python(f"""
        import json, os, time, torch, flagos
        flagos.activate("{CHIP}")
        d = flagos.device()

        class FailsLater(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                time.sleep(0.2)          # the flagos branch is in its hook by now
                raise ValueError("the CPU branch failed")

        def slow(g):
            time.sleep(1.0)
            return g

        a = torch.ones(2, requires_grad=True)
        b = torch.ones(2, device=d, requires_grad=True)
        yb = b * 2
        yb.register_hook(slow)
        loss = FailsLater.apply(a).sum() + yb.sum().cpu()
        try:
            loss.backward()
        except ValueError as e:
            print("RAISED", e, flush=True)
        with open(os.environ["FLAGOS_REPORT"] + ".at-end", "w") as f:
            json.dump(flagos.fallback_report().to_dict()["ops"], f)
    """, env={"FLAGOS_FALLBACK": "allow", "FLAGOS_REPORT": str(report)}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "RAISED the CPU branch failed" in proc.stdout
    at_exit = json.loads(report.read_text())["ops"]
    at_end = json.loads((tmp_path / "report.json.at-end").read_text())
    assert at_exit == at_end


def test_the_exit_wait_reads_pytorchs_limit(monkeypatch):
    from flagos.integrations import _engine_exit

    for raw, limit in (("", 10.0), ("2.5", 2.5), ("0", 0.0), ("-3", 0.0), ("soon", 10.0)):
        monkeypatch.setenv(_engine_exit.WAIT_LIMIT_VARIABLE, raw)
        assert _engine_exit.wait_limit() == limit


def test_the_exit_drain_goes_through_the_engine_thread_and_needs_no_kernel():
    """The drain's node runs on autograd's engine thread for flagos:0 (not a Python thread),
    and with every kernel it could have needed routed to 'error' it still runs: nothing is
    logged at exit. A chip broken by the time the program ends: the drain's pass fails inside
    its thread; that is logged for debugging, and the exit goes on without a traceback."""
    proc = run_python(f"""
        import logging, sys, threading, torch, flagos
        from flagos.integrations import _engine_exit
        flagos.activate("{CHIP}")
        x = torch.ones(3).to(flagos.device()).requires_grad_()
        (x + 1).sum().backward()
        seen = []
        plain = _engine_exit._KernelFree.backward
        def spy(ctx, grad):
            seen.append((isinstance(threading.current_thread(), threading._DummyThread),
                         str(grad.device)))
            return plain(ctx, grad)
        _engine_exit._KernelFree.backward = staticmethod(spy)
        print("DRAINED", _engine_exit.drain(), seen, flush=True)
        print("BROKEN CHIP", file=sys.stderr, flush=True)
        log = logging.getLogger("flagos")
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.DEBUG)
        def broken(x):
            raise RuntimeError("the chip is gone")
        _engine_exit._KernelFree.apply = broken
        print("DRAINED", _engine_exit.drain())
    """, env={"FLAGOS_FALLBACK": "allow",
              "FLAGOS_ROUTE": "aten::mul=error,aten::clone=error,aten::fill_=error,aten::zero_=error"})
    assert proc.stdout.splitlines() == ["DRAINED True [(True, 'flagos:0')]", "DRAINED True"], \
        proc.stdout + proc.stderr
    healthy, broken = proc.stderr.split("BROKEN CHIP\n")
    assert healthy == "", proc.stderr
    assert "the engine drain at exit failed: the chip is gone" in broken
    assert "Traceback" not in broken, proc.stderr


# When the exit drain runs, how long it waits and what it leaves behind: its own logic, the same
# on every chip (the pass itself, on the chip's engine thread, is the test above's, on each chip).
drain_logic = pytest.mark.skipif(
    CHIP != "cpu", reason="the exit drain's own logic, the same on every chip: runs once, in the cpu run")


SPY_ON_THE_DRAIN = """
import threading, time, torch, flagos
from flagos.integrations import _engine_exit
seen = []
plain = _engine_exit._KernelFree.backward
def spy(ctx, grad):
    seen.append(str(grad.device))
    return plain(ctx, grad)
_engine_exit._KernelFree.backward = staticmethod(spy)
def drain(label):
    seen.clear()
    print(label, _engine_exit.drain(), seen, flush=True)
def one_pass():
    x = torch.ones(3).to(flagos.device()).requires_grad_()
    (x + 1).sum().backward()
"""


@drain_logic
def test_the_exit_drain_runs_only_when_a_pass_may_be_held():
    """No pass through the engine yet (flagos activated at `import torch`, which runs no
    backward), flagos not activated, or native mode (no flagos engine thread): nothing to wait
    for, and no pass is pushed."""
    proc = run_python(SPY_ON_THE_DRAIN + """
drain("BEFORE")
one_pass()
drain("AFTER")
""", env={"FLAGOS_DEVICE": CHIP, "FLAGOS_FALLBACK": "allow"})
    assert proc.stdout.splitlines() == ["BEFORE True []", "AFTER True ['flagos:0']"], proc.stdout
    proc = run_python(SPY_ON_THE_DRAIN + """
x = torch.ones(3, requires_grad=True)
(x + 1).sum().backward()
drain("INACTIVE")
flagos.activate("cpu", mode="native")
(x + 1).sum().backward()
drain("NATIVE")
""", env={"FLAGOS_FALLBACK": "allow"})
    assert proc.stdout.splitlines() == ["INACTIVE True []", "NATIVE True []"], proc.stdout


@drain_logic
def test_the_exit_drain_leaves_an_engine_without_a_flagos_queue_alone():
    """A backward pass before activation leaves the engine without a queue for flagos: backward
    on flagos tensors is refused (and noted as a pass), and at exit there is nothing to drain;
    a pass pushed there could only fail."""
    proc = run_python(f"""
        import torch, flagos
        from flagos.integrations import _engine_exit
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        flagos.activate("{CHIP}")
        pushed = []
        _engine_exit._one_pass = lambda device: pushed.append(str(device))
        b = torch.ones(2).to(flagos.device()).requires_grad_()
        try:
            (b * 2).sum().backward()
        except flagos.NoEngineQueueError:
            print("REFUSED")
        print("DRAINED", _engine_exit.drain(), pushed)
    """, env={"FLAGOS_FALLBACK": "allow"})
    assert proc.stdout.splitlines() == ["REFUSED", "DRAINED True []"], proc.stdout + proc.stderr


@drain_logic
def test_the_exit_drain_gives_up_after_pytorchs_limit_and_says_so():
    """The engine thread held in a hook past TORCH_AUTOGRAD_SHUTDOWN_WAIT_LIMIT: drain() says
    False and warns; once the hook returns, a drain finds the thread free (the limit is read at
    each drain) and waits for the thread the first drain left behind too: if that one were still
    returning from the engine when the interpreter finalizes, the process would abort at exit.
    Here it is made slow to return."""
    proc = run_python(SPY_ON_THE_DRAIN + f"""
import os
flagos.activate("{CHIP}")
started, release = threading.Event(), threading.Event()
one_pass_of_the_drain = _engine_exit._one_pass
def slow_first_return(device, first=[True]):
    one_pass_of_the_drain(device)
    if first.pop() if first else False:
        time.sleep(1.5)
_engine_exit._one_pass = slow_first_return

class FailsOnceTheHookRuns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        started.wait(60)
        raise ValueError("the CPU branch failed")

def hook(g):
    started.set()
    release.wait(60)
    return g

b = torch.ones(2).to(flagos.device()).requires_grad_()
yb = b * 2
yb.register_hook(hook)
loss = FailsOnceTheHookRuns.apply(torch.ones(2, requires_grad=True)).sum() + yb.sum().cpu()
try:
    loss.backward()
except ValueError:
    pass
drain("BUSY")
print("DAEMON", [t.daemon for t in threading.enumerate() if t.name == "flagos-engine-drain"])
release.set()
os.environ["TORCH_AUTOGRAD_SHUTDOWN_WAIT_LIMIT"] = "120"
drain("FREE")
print("LEFT", [t.name for t in threading.enumerate() if t.name == "flagos-engine-drain"])
""", env={"FLAGOS_FALLBACK": "allow", "TORCH_AUTOGRAD_SHUTDOWN_WAIT_LIMIT": "0.5"}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert lines[0] == "BUSY False []", proc.stdout
    # the thread it left behind does not hold the interpreter's exit (a daemon), as the
    # engine's own threads do not
    assert lines[1] == "DAEMON [True]", proc.stdout
    # the first drain's pass, still queued when it gave up, runs first; then the second one's
    assert lines[2] in ("FREE True ['flagos:0']", "FREE True ['flagos:0', 'flagos:0']"), proc.stdout
    assert lines[3] == "LEFT []", proc.stdout
    assert "autograd's engine thread was still busy 0 s after the program ended" in proc.stderr


@runs_once
def test_pytorchs_assert_on_another_accelerators_backward_names_the_way_out(monkeypatch):
    """A plain cuda backward in a device-mode process meets PyTorch's stream assert
    (pytorch/pytorch#161129); the engine's answer is replaced here, as no GPU is at hand."""
    class Engine:
        def run_backward(self, *args, **kwargs):
            raise RuntimeError("opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED at "
                               "\"engine.cpp\":1084, please report a bug to PyTorch.")

    x = torch.ones(3, requires_grad=True)
    loss = (x * 2).sum()
    monkeypatch.setattr(torch.autograd.graph.Variable, "_execution_engine", Engine())
    with pytest.raises(flagos.AcceleratorBackwardError, match="FLAGOS_MODE=native") as raised:
        loss.backward()
    assert "161129" in str(raised.value) and "INTERNAL ASSERT" in str(raised.value.__cause__)
    monkeypatch.undo()
    (x * 3).sum().backward()  # the process goes on
    assert x.grad.tolist() == [3.0, 3.0, 3.0]

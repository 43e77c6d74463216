"""The host round trip of C-ABI chips in C (csrc/adapter_fallback.c): the common case of the CPU
fallback runs in the router without the Python runner, with the runner's results, layouts,
aliasing, counters, policy and errors; the other cases still go to the runner.

Each test runs in a fresh process on sim, so these run whatever chip the suite itself uses.
"""
from conftest import device_mode_only, run_python

pytestmark = device_mode_only


def run_sim(code: str, **env):
    return run_python(code, env={"FLAGOS_DEVICE": "sim", "FLAGOS_FALLBACK": "allow", **env})


# Counts the ops the Python runner is asked to run (the router calls Runner.__call__ through the
# type, so patching the class sees every call).
SPY = """
        import torch, flagos
        from flagos.runtime import _adapter_ops
        seen = []
        _call = _adapter_ops.Runner.__call__
        def spy(self, func, name, *rest):
            seen.append(name)
            return _call(self, func, name, *rest)
        _adapter_ops.Runner.__call__ = spy
        # results the C round trip hands to the runner to lay out (not row-major, math bits)
        uploads = []
        _upload = _adapter_ops.Runner._upload
        def upload_spy(self, *args):
            uploads.append(args[0])
            return _upload(self, *args)
        _adapter_ops.Runner._upload = upload_spy
"""


def test_common_cases_run_in_c_with_the_cpu_results():
    proc = run_sim(SPY + """
        torch.manual_seed(0)
        F = torch.nn.functional
        a, b = torch.randn(6, 5), torch.randn(6, 5)
        big = torch.randn(300, 256)                      # 300 KiB: a staging buffer
        img = torch.randn(2, 3, 8, 8)
        cases = {
            "unary": (torch.sin, (a,)),
            "staged": (torch.cos, (big,)),
            "transposed": (lambda x: torch.sin(x.t()), (a,)),
            "offset slice": (lambda x: torch.atan(x[2:5, 1:4]), (a,)),
            "two views of one buffer": (lambda x: torch.atan2(x[:4], x[2:]), (a,)),
            "binary": (torch.atan2, (a, b)),
            "list": (lambda x, y: torch.stack([x, y, x], 1), (a, b)),
            "two results": (lambda x: torch.max(x, 1), (a,)),
            "int results": (lambda x: torch.argsort(x, 1), (a,)),
            # (convolution, group_norm and nearest upsampling are on the kernel table: the
            # runner tries those first)
            "pooling": (lambda x: F.avg_pool2d(x, 2), (img,)),
            "batch norm": (lambda x: F.instance_norm(x), (img,)),
            "bilinear upsample": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (img,)),
        }
        for name, (op, inputs) in cases.items():
            moved = [t.to("flagos") for t in inputs]
            del seen[:], uploads[:]
            got = op(*moved)
            ran = [n for n in seen if n not in ("aten::t", "aten::slice.Tensor", "aten::empty.memory_format")]
            assert ran == [], (name, seen)
            want = op(*inputs)
            gots = got if isinstance(got, tuple) else (got,)
            wants = want if isinstance(want, tuple) else (want,)
            # row-major results go into new buffers in C; the runner lays out the others
            assert len(uploads) == sum(not w.is_contiguous() for w in wants), (name, len(uploads))
            for g, e in zip(gots, wants):
                assert g.device.type == "flagos" and g.dtype == e.dtype, name
                assert g.shape == e.shape and g.stride() == e.stride(), (name, g.stride(), e.stride())
                assert torch.equal(g.cpu(), e), name
        print("OK", len(cases))
    """)
    assert "OK 12" in proc.stdout


def test_written_arguments_and_aliasing():
    proc = run_sim(SPY + """
        import warnings
        torch.manual_seed(0)
        a = torch.randn(6, 5)
        x = a.to("flagos")
        del seen[:]
        # in place on a view: the base sees it, the other rows keep their values
        y = x.clone()
        r = y[1:3].sin_()
        want = a.clone(); want[1:3].sin_()
        assert torch.equal(y.cpu(), want)
        # out= of the right size: the caller's own object, its buffer written
        o = torch.empty(6, 5, device="flagos")
        ret = torch.sin(x, out=o)
        assert ret is o and torch.equal(o.cpu(), a.sin())
        # out= resized (PyTorch warns that it resizes a non-empty one): a buffer of its own
        small = torch.empty(3, device="flagos")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ret = torch.atan(x, out=small)
        assert ret is small and small.shape == (6, 5) and torch.equal(small.cpu(), a.atan())
        # two results into out= tensors
        v, i = torch.empty(6, device="flagos"), torch.empty(6, dtype=torch.long, device="flagos")
        rv, ri = torch.max(x, 1, out=(v, i))
        assert rv is v and ri is i
        assert torch.equal(v.cpu(), a.max(1).values) and torch.equal(i.cpu(), a.max(1).indices)
        ran = [n for n in seen if n not in ("aten::clone", "aten::slice.Tensor", "aten::empty.memory_format",
                                            "aten::_to_copy")]  # .cpu()
        assert ran == [], seen
        print("OK")
    """)
    assert "OK" in proc.stdout


def test_counters_match_the_runner():
    """The same op through the C round trip and through the runner (a host tensor in the call
    sends it there) counts the same bytes and dtypes."""
    proc = run_sim(SPY + """
        a = torch.randn(4, 4).to("flagos")
        h = torch.tensor(2.0)                            # a host tensor: the runner's case
        flagos.reset_report()
        del seen[:]
        torch.atan2(a, a)
        row = flagos.fallback_report().op("aten::atan2")
        print("C", row["calls"], row["bytes_to_host"], row["bytes_to_device"], row["dtypes"], seen)
        assert row["fallback_ns"] > 0
        flagos.reset_report()
        torch.atan2(a, h)
        row = flagos.fallback_report().op("aten::atan2")
        print("RUNNER", row["calls"], row["bytes_to_host"], row["bytes_to_device"], row["dtypes"], seen)
    """)
    out = proc.stdout
    assert "C {'override': 0, 'native': 0, 'fallback': 1} 64 64 ['torch.float32'] []" in out, out
    assert "RUNNER {'override': 0, 'native': 0, 'fallback': 1} 64 64 ['torch.float32'] ['aten::atan2']" in out


def test_a_round_trip_keeps_no_memory_once_it_returns():
    """Every object the C round trip makes for a call (the host views' shapes and strides, the
    results' descriptions) is released when the call ends: 1,500 fallbacks, one and two
    results, small and staged, hold no more Python memory than the first few."""
    proc = run_sim(SPY + """
        import tracemalloc
        a, big = torch.randn(6, 5).to("flagos"), torch.randn(300, 256).to("flagos")

        def calls(n):
            for _ in range(n):
                torch.sin(a), torch.max(a, 1), torch.cos(big)

        calls(20)                            # caches, pools and the report's rows fill up
        tracemalloc.start()
        calls(20)
        del seen[:]
        before = tracemalloc.get_traced_memory()[0]
        calls(500)
        grown = tracemalloc.get_traced_memory()[0] - before
        print("GREW", grown, "RUNNER", len(seen))
    """)
    grown, runner = proc.stdout.split()[1::2]
    assert runner == "0", proc.stdout      # every call took the C round trip
    assert int(grown) < 20_000, proc.stdout  # a tuple leaked per op would be 1,500 of them: 80 KB


def test_policy_comes_first():
    proc = run_sim("""
        import torch, flagos, warnings
        a = torch.ones(4, device="flagos")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.sin(a)
            torch.sin(a)
        print("WARNINGS", sum("aten::sin falls back" in str(x.message) for x in w))
    """, FLAGOS_FALLBACK="warn")
    assert "WARNINGS 1" in proc.stdout, proc.stdout
    proc = run_sim("""
        import torch, flagos
        a = torch.ones(4, device="flagos")
        b = torch.zeros(4, device="flagos")
        try:
            torch.sin(a, out=b)
        except flagos.FallbackError as e:
            print("ERROR", "FLAGOS_FALLBACK=error" in str(e))
        print("UNTOUCHED", b.cpu().tolist(), flagos.fallback_report().calls("fallback"))
    """, FLAGOS_FALLBACK="error")
    assert "ERROR True" in proc.stdout and "UNTOUCHED [0.0, 0.0, 0.0, 0.0] 0" in proc.stdout, proc.stdout


def test_out_of_memory_of_a_result_leaves_the_process_working():
    proc = run_sim("""
        import torch, flagos
        a = torch.ones(2, 2, device="flagos")               # allocation 1
        try:
            torch.sin(a)                                     # allocation 2: its result
            print("RAN")
        except torch.OutOfMemoryError as e:
            print("OOM", "injected failure" in str(e))
        print("AFTER", torch.sin(a).cpu().sum().item() > 0, flagos.fallback_report().calls("fallback"))
    """, FLAGOS_SIM_FAIL_ALLOC_AT="2")
    assert "OOM True" in proc.stdout and "RAN" not in proc.stdout, proc.stdout
    assert "AFTER True 1" in proc.stdout, proc.stdout


def test_autograd_through_the_round_trip():
    proc = run_sim("""
        import torch, flagos
        torch.manual_seed(0)
        a = torch.randn(5, 3)
        x = a.to("flagos").requires_grad_()
        torch.sin(x).sum().backward()
        h = a.clone().requires_grad_()
        torch.sin(h).sum().backward()
        print("GRAD", torch.equal(x.grad.cpu(), h.grad))
    """)
    assert "GRAD True" in proc.stdout, proc.stdout


def test_routes_decide_which_ops_take_it():
    """Routed to the fallback, an op with a kernel takes the C round trip; the runner's own
    ops (allocation, copies) stay the runner's whatever their route; routed native, an op with
    a kernel builder tries the kernel in the runner first."""
    proc = run_sim(SPY + """
        a = torch.randn(4, 4)
        fa = a.to("flagos")
        flagos.set_route("aten::neg", "fallback")
        flagos.set_route("aten::clone", "fallback")
        del seen[:]
        flagos.reset_report()
        n = torch.neg(fa)
        c = fa.clone()
        print("SEEN", seen, flagos.fallback_report().op("aten::neg")["calls"]["fallback"])
        assert torch.equal(n.cpu(), -a) and torch.equal(c.cpu(), a)
        flagos.set_route("aten::neg", "native")
        del seen[:]
        torch.nn.functional.gelu(fa)                    # a kernel builder, no C hot path case
        print("GELU", seen)
    """)
    assert "SEEN ['aten::clone'] 1" in proc.stdout, proc.stdout
    assert "GELU ['aten::gelu']" in proc.stdout, proc.stdout


def test_other_cases_still_go_to_the_runner():
    proc = run_sim(SPY + """
        a = torch.randn(4, 4)
        fa = a.to("flagos")
        cases = {
            "host tensor": lambda x: torch.atan2(x, torch.tensor(2.0)),
            "to the host": lambda x: torch.sin(x).to("cpu"),
            "complex": lambda x: torch.sin(torch.complex(x, x)),
            "empty": lambda x: torch.sin(x[:0]),
        }
        for name, op in cases.items():
            del seen[:]
            got = op(fa)
            assert any(n in ("aten::atan2", "aten::_to_copy", "aten::sin") for n in seen), (name, seen)
            assert torch.equal(got.cpu(), op(a)), name
        try:
            torch.atan2(fa, torch.ones(4, 4, device="flagos:1"))
        except Exception as e:
            print("MIXED", type(e).__name__)
        print("OK")
    """, FLAGOS_SIM_DEVICES="2")
    assert "OK" in proc.stdout, proc.stdout
    assert "MIXED DeviceMismatchError" in proc.stdout, proc.stdout

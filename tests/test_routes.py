"""Per-op routes, the CPU fallback and its report (device mode, cpu chip)."""
import atexit
import contextlib
import functools
import gc
import inspect
import json
import logging
import types
import warnings
import weakref

import pytest
import torch
from conftest import CHIP, assert_close, device_mode_only, run_python, runs_once

import flagos
from flagos import _C
from flagos.core import _schema
from flagos.report import _report
from flagos.runtime import _transfers

pytestmark = device_mode_only


def test_forced_fallback_matches_native(dev):
    x, y = torch.randn(4, 5), torch.randn(5, 3)
    flagos.set_route("aten::mm", "fallback")
    assert flagos.route_of("aten::mm") == "fallback"
    out = x.to(dev) @ y.to(dev); line = inspect.currentframe().f_lineno  # noqa: E702
    assert out.device == dev
    assert_close(out, x @ y)
    row = flagos.fallback_report().op("aten::mm")
    assert row["calls"]["fallback"] == 1 and row["calls"]["native"] == 0
    assert row["bytes_to_host"] == x.nbytes + y.nbytes
    assert row["bytes_to_device"] == 4 * 3 * 4
    assert row["dtypes"] == ["torch.float32"]
    assert row["site"].endswith(f"test_routes.py:{line}")
    assert row["fallback_ns"] > 0


def test_fallback_keeps_inplace_and_out_semantics(dev):
    flagos.set_route("aten::add_", "fallback")
    flagos.set_route("aten::mul", "fallback")  # mul.out included
    a = torch.ones(2, 3, device=dev)
    view = a[0]
    same = view.add_(5)
    assert same is view
    assert a.cpu().tolist() == [[6.0, 6.0, 6.0], [1.0, 1.0, 1.0]]
    out = torch.empty(2, 3, device=dev)
    res = torch.mul(a, 2, out=out)
    assert res is out and out.cpu()[0].tolist() == [12.0, 12.0, 12.0]
    report = flagos.fallback_report()
    assert set(report.fallback_ops) == {"aten::add_.Tensor", "aten::mul.out"}


def test_fallback_through_autograd(dev):
    flagos.set_route("aten::mm", "fallback")
    w = torch.randn(3, 2, requires_grad=True)
    fw = w.detach().to(dev).requires_grad_()
    x = torch.randn(4, 3)
    (x @ w).sum().backward()
    (x.to(dev) @ fw).sum().backward()
    assert_close(fw.grad, w.grad)
    assert flagos.fallback_report().op("aten::mm")["calls"]["fallback"] >= 2  # forward + backward


def test_views_never_fall_back(dev):
    flagos.set_route("aten::view", "fallback")
    a = torch.zeros(6, device=dev)
    v = a.view(2, 3)
    v.fill_(1.0)
    assert a.cpu().sum().item() == 6.0
    assert flagos.route_of("aten::view") == "native"


@pytest.mark.parametrize("op, call, shapes, dtype", [
    ("aten::linear", torch.nn.functional.linear, [(3, 8), (4, 8), (4,)], torch.float32),
    ("aten::linear", torch.nn.functional.linear, [(3, 8), (4, 8), (4,)], torch.complex64),
    ("aten::layer_norm", lambda x, w, b: torch.nn.functional.layer_norm(x, (8,), w, b), [(3, 8), (8,), (8,)],
     torch.float32),
], ids=["linear", "linear-complex", "layer_norm"])
def test_a_decomposition_routed_to_the_fallback_falls_back_whole_in_inference_mode(dev, op, call, shapes,
                                                                                    dtype):
    """Under inference mode a decomposition (linear, layer_norm) reaches the chip whole; routed
    to the fallback, it runs there whole, as asked, instead of as its parts on the chip (on C-ABI
    chips complex numbers take the runner's round trip, float32 the C one)."""
    torch.manual_seed(0)
    tensors = [torch.randn(shape, dtype=dtype) for shape in shapes]
    want = call(*tensors)
    flagos.set_route(op, "fallback")
    on_chip = [t.to(dev) for t in tensors]
    with torch.inference_mode(), flagos.track() as report:
        got = call(*on_chip)
    assert_close(got, want)
    rows = {row["op"]: row["calls"] for row in report.to_dict()["ops"]}
    assert rows == {op: {"override": 0, "native": 0, "fallback": 1}}, rows


def test_route_error_and_policy_error(dev):
    a = torch.ones(2, device=dev)
    flagos.set_route("aten::exp", "error")
    with pytest.raises(flagos.FallbackError, match=r"aten::exp is routed to 'error'"):
        a.exp()
    flagos.set_route("aten::exp", "fallback")
    flagos._C.set_fallback_policy(2)
    try:
        with pytest.raises(flagos.FallbackError, match=r"aten::exp would fall back.*FLAGOS_FALLBACK=error"):
            a.exp()
        assert a.cpu().tolist() == [1.0, 1.0]  # raised before running
    finally:
        flagos._C.set_fallback_policy(0)


def test_warn_once_per_op(dev):
    flagos.set_route("aten::sin", "fallback")
    a = torch.ones(2, device=dev)
    flagos._C.set_fallback_policy(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a.sin()
            a.sin()
        msgs = [str(w.message) for w in caught if issubclass(w.category, flagos.FallbackWarning)]
        assert len(msgs) == 1 and "aten::sin" in msgs[0]
    finally:
        flagos._C.set_fallback_policy(0)


def test_override_kernel(dev):
    calls = []

    def my_relu(x):
        calls.append(x.device.type)
        return torch.clamp(x, min=0)

    flagos.register_kernel("aten::relu", my_relu, chip=CHIP)
    try:
        out = torch.tensor([-1.0, 2.0], device=dev).relu()
        # torch-native chips hand the kernel their own tensors (the cpu chip CPU tensors, the
        # cuda chip CUDA tensors); C-ABI chips hand it flagos tensors
        own = flagos.core._state.active().chip.torch_type or "flagos"
        assert out.cpu().tolist() == [0.0, 2.0] and calls == [own]
        assert flagos.route_of("aten::relu") == "override"
        assert flagos.fallback_report().op("aten::relu")["calls"]["override"] == 1
    finally:
        flagos.unregister_kernel("aten::relu", chip=CHIP)
    assert flagos.route_of("aten::relu") == "native"


def test_forced_override_without_a_kernel_says_how_to_register_one(dev):
    calls = []

    def my_relu(x):
        calls.append(1)
        return torch.clamp(x, min=0)

    flagos.set_route("aten::relu", "override")
    with pytest.raises(flagos.ConfigError, match="routed to 'override' but no kernel is registered.*"
                                                 r"use flagos\.register_kernel\(\)"):
        torch.tensor([-1.0, 2.0], device=dev).relu()
    flagos.register_kernel("aten::relu", my_relu, chip=CHIP)
    try:  # the process goes on, and the forced route takes the kernel once there is one
        assert torch.tensor([-1.0, 2.0], device=dev).relu().cpu().tolist() == [0.0, 2.0]
        assert calls == [1] and flagos.fallback_report().op("aten::relu")["calls"]["override"] == 1
    finally:
        flagos.unregister_kernel("aten::relu", chip=CHIP)


def test_debug_log_names_each_ops_route_and_whether_it_was_forced(dev, caplog):
    flagos.set_route("aten::mul", "fallback")  # a fresh table: every op is resolved again
    x = torch.ones(2, device=dev)
    with caplog.at_level(logging.DEBUG, logger="flagos"):
        x * x
        x + x
    messages = [record.getMessage() for record in caplog.records]
    assert f"aten::mul.Tensor on {CHIP}: fallback (forced)" in messages
    assert f"aten::add.Tensor on {CHIP}: native" in messages


def test_routes_and_bad_route():
    flagos.set_route("aten::mm", "fallback")
    assert flagos.routes()["aten::mm"] == "fallback"
    with pytest.raises(flagos.ConfigError, match="use one of: auto, override, native, fallback, error"):
        flagos.set_route("aten::mm", "gpu")
    with pytest.raises(flagos.ConfigError, match="needs its namespace"):
        flagos.set_route("mm", "native")


def test_report_table_dict_json_save(dev, tmp_path):
    flagos.set_route("aten::mm", "fallback")
    a = torch.randn(3, 3, device=dev)
    (a @ a + 1).sum()
    report = flagos.fallback_report()
    text = str(report)
    lines = text.splitlines()
    assert lines[1].split() == ["op", "route", "calls", "fallback", "ms", "MB", "to", "host", "MB",
                                "from", "host", "first", "call", "site"]
    assert any(line.startswith("aten::mm ") and " fallback " in line for line in lines)
    d = report.to_dict()
    n_ops, n_calls = len(report.fallback_ops), d["totals"]["calls_by_route"]["fallback"]
    assert f"fallback: {n_ops} ops, {n_calls} calls" in lines[-1]
    assert n_calls >= 1 and report.op("aten::mm")["calls"]["fallback"] == 1
    assert 0 < d["totals"]["fallback_call_share"] < 1
    assert "aten::mm" in [r["op"] for r in json.loads(report.to_json())["ops"]]
    path = tmp_path / "r.json"
    report.save(str(path))
    assert json.loads(path.read_text())["totals"] == json.loads(report.to_json())["totals"]
    flagos.reset_report()
    assert flagos.fallback_report().calls() == 0


def test_track_scopes_the_report(dev):
    a = torch.ones(4, device=dev)
    a * 2
    with flagos.track() as r:
        a + 1
        a + 1
    assert r.op("aten::add.Tensor")["calls"]["native"] == 2
    assert r.op("aten::mul.Tensor") is None


def test_track_counts_only_the_bytes_moved_in_its_scope(dev):
    x, y = torch.randn(4, 5), torch.randn(5, 3)
    fx, fy = x.to(dev), y.to(dev)
    flagos.set_route("aten::mm", "fallback")
    fx @ fy                                   # before the scope: moved, not the scope's
    with flagos.track() as one:
        out = fx @ fy
    assert_close(out, x @ y)
    row = one.op("aten::mm")
    assert row["calls"]["fallback"] == 1
    assert row["bytes_to_host"] == x.nbytes + y.nbytes and row["bytes_to_device"] == 4 * 3 * 4
    flagos.set_route("aten::mm", "native")
    with flagos.track() as none:
        fx @ fy
    totals = none.to_dict()["totals"]
    assert none.op("aten::mm")["calls"]["native"] == 1 and none.calls("fallback") == 0
    assert (totals["bytes_to_host"], totals["bytes_to_device"]) == (0, 0)
    assert flagos.fallback_report().op("aten::mm")["bytes_to_device"] == 2 * 4 * 3 * 4


@runs_once
def test_report_written_at_exit(tmp_path):
    path = tmp_path / "report.json"
    run_python("""
        import torch, flagos
        flagos.activate("cpu")
        a = torch.randn(8, 8, device="flagos")
        (a @ a).sum().item()
    """, env={"FLAGOS_REPORT": str(path), "FLAGOS_ROUTE": "aten::mm=fallback",
              "FLAGOS_FALLBACK": "allow"})
    data = json.loads(path.read_text())
    mm = next(r for r in data["ops"] if r["op"] == "aten::mm")
    assert mm["calls"]["fallback"] == 1 and mm["bytes_to_host"] == 2 * 8 * 8 * 4


@runs_once
def test_unwritable_report_path_warns_and_keeps_the_run(tmp_path):
    bad = tmp_path / "missing-dir" / "r.json"
    proc = run_python("""
        import torch, flagos
        flagos.activate("cpu")
        print("result", (torch.ones(2, device="flagos") * 3).sum().item())
    """, env={"FLAGOS_REPORT": str(bad)})
    assert proc.returncode == 0 and "result 6.0" in proc.stdout
    assert "could not be written" in proc.stderr and "Point FLAGOS_REPORT" in proc.stderr
    assert '"aten::mul.Tensor"' in proc.stderr  # the report itself went to stderr
    # the warning at activation names the program's line that activated flagos
    assert f"<string>:3: RuntimeWarning: FLAGOS_REPORT={str(bad)!r} is not writable" in proc.stderr
    autoloaded = run_python("""
        import torch
        print("result", (torch.ones(2, device="flagos") * 3).sum().item())
    """, env={"FLAGOS_REPORT": str(bad), "FLAGOS_DEVICE": "cpu"})
    assert "result 6.0" in autoloaded.stdout
    assert f"<string>:2: RuntimeWarning: FLAGOS_REPORT={str(bad)!r} is not writable" in autoloaded.stderr


def test_activation_without_a_report_path_checks_nothing_and_registers_one_exit_hook(monkeypatch):
    """No FLAGOS_REPORT: activation warns of nothing; the exit hook that writes the report is
    registered once per process, however often flagos activates."""
    monkeypatch.delenv("FLAGOS_REPORT", raising=False)
    monkeypatch.setattr(_report, "_since", _report._since)  # on_activate restarts the clock
    hooks = atexit._ncallbacks()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _report.on_activate()
        _report.on_activate()
    assert atexit._ncallbacks() == hooks


def test_a_report_spans_the_time_since_the_reset_and_a_scope_its_own(monkeypatch):
    """elapsed_s is the clock's advance since reset_report() (or over a track() scope), read
    from flagos's own clock readings."""
    readings = iter([100.0, 102.5, 10.0, 10.75])
    monkeypatch.setattr(_report, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    monkeypatch.setattr(_report, "_since", _report._since)
    flagos.reset_report()
    assert flagos.fallback_report().elapsed_s == 2.5
    with flagos.track() as scope:
        pass
    assert scope.elapsed_s == 0.75


def test_routes_take_op_objects_as_well_as_names(dev):
    """set_route and route_of take torch.ops objects: an OpOverload names that overload only
    (aten.mul.Tensor, not aten.mul.Scalar), the default overload its plain name
    (aten.mm.default is 'aten::mm'); the results match plain PyTorch on the CPU."""
    aten = torch.ops.aten
    torch.manual_seed(0)
    x = torch.randn(3, 3)
    fx = x.to(dev)
    flagos.set_route(aten.mul.Tensor, "fallback")
    flagos.set_route(aten.mm.default, "fallback")
    with flagos.track() as report:
        product = aten.mul.Tensor(fx, fx)
        scaled = aten.mul.Scalar(fx, 2.0)
        matmul = aten.mm.default(fx, fx)
    assert report.op("aten::mul.Tensor")["calls"]["fallback"] == 1
    assert report.op("aten::mul.Scalar")["calls"] == {"override": 0, "native": 1, "fallback": 0}
    assert report.op("aten::mm")["calls"]["fallback"] == 1
    assert flagos.route_of(aten.mul.Tensor) == "fallback"
    assert flagos.route_of(aten.mm.default) == "fallback"
    assert flagos.route_of(aten.mul.Scalar) == "native"
    assert_close(product, x * x)
    assert_close(scaled, x * 2.0)
    assert_close(matmul, x @ x, atol=1e-5, rtol=1.3e-6)


def test_a_report_built_by_hand_adds_up():
    """`flagos.Report` is public: an empty one is all zeros, and the table's milliseconds and
    megabytes are the rows' nanoseconds and bytes (hand-computed)."""
    empty = flagos.Report()
    assert empty.to_dict()["totals"] == {
        "ops": 0, "calls": 0, "calls_by_route": {k: 0 for k in empty.to_dict()["totals"]["calls_by_route"]},
        "fallback_ops": 0, "fallback_s": 0.0, "fallback_call_share": 0.0, "fallback_time_share": 0.0,
        "bytes_to_host": 0, "bytes_to_device": 0, "bytes_between_devices": 0,
        "compiled_graph_calls": 0, "downcast_calls": 0, "downcast_bytes": 0}
    assert str(empty).splitlines()[-1].startswith("total: 0 ops, 0 calls; fallback: 0 ops, 0 calls")
    assert "between devices" not in str(empty)

    def row(op, fallback, native, ns, to_host, to_device):
        return {"op": op, "calls": {"override": 0, "native": native, "fallback": fallback, "error": 0},
                "fallback_ns": ns, "bytes_to_host": to_host, "bytes_to_device": to_device,
                "site": None}

    report = flagos.Report([row("aten::mm", 3, 0, 2_500_000, 3_000_000, 1_500_000),
                            row("aten::add.Tensor", 0, 5, 0, 0, 0)], elapsed_s=0.01, chip="sim")
    lines = str(report).splitlines()
    mm = next(line for line in lines if line.startswith("aten::mm "))
    assert mm.split()[1:6] == ["fallback", "3", "2.50", "3.000", "1.500"]
    assert lines[-1] == ("total: 2 ops, 8 calls; fallback: 1 ops, 3 calls (37.5% of calls), "
                         "2.50 ms (25.0% of 0.01 s), 3.00 MB to host, 1.50 MB back")

    # rows: most fallback calls first, then most fallback time; numbers right-aligned
    big = flagos.Report([row("aten::cat", 2, 0, 1_000_000, 10, 123_456_789_000),
                         row("aten::sort", 2, 0, 9_000_000, 2_000, 2_000),
                         row("aten::mm", 3, 0, 2_500_000, 3_000_000, 1_500_000)], elapsed_s=1.0)
    lines = str(big).splitlines()
    assert [line.split()[0] for line in lines[3:6]] == ["aten::mm", "aten::sort", "aten::cat"]
    head = lines[1]
    for line in lines[3:6]:  # each figure ends where its column's header ends
        for column in ("calls", "fallback ms", "MB to host", "MB from host"):
            end = head.index(column) + len(column)
            assert line[end - 1] != " " and (end == len(line) or line[end] == " "), (column, line)
    assert lines[-1].endswith("123458.29 MB back")


def test_every_figure_in_the_table_is_its_row_scaled_exactly():
    """Each figure of the text table, the totals line, the bytes between devices and the downcast
    line, with values large enough that a unit off by one part in a million shows (hand-computed);
    a report built with no arguments says 0.00 s and no chip; rows without downcast counts count
    none; to_json indents by two."""
    empty = flagos.Report()
    assert str(empty).splitlines()[0] == "flagos fallback report (chip: -, 0.00 s)"
    assert json.loads(empty.to_json()) == empty.to_dict()
    assert empty.to_json().splitlines()[1] == '  "chip": null,'

    row = {"op": "aten::sort", "calls": {"override": 0, "native": 0, "fallback": 7, "error": 0},
           "fallback_ns": 123_456_789_000, "bytes_to_host": 987_654_321_000,
           "bytes_to_device": 123_456_789_000, "site": None}
    report = flagos.Report([row], elapsed_s=1000.0, chip="sim", bytes_between_devices=1_234_567_891)
    assert report.fallback_seconds == 123.456789
    assert (report.downcast_calls, report.downcast_bytes) == (0, 0)
    lines = str(report).splitlines()
    assert lines[3].split()[1:6] == ["fallback", "7", "123456.79", "987654.321", "123456.789"]
    assert lines[4] == ("total: 1 ops, 7 calls; fallback: 1 ops, 7 calls (100.0% of calls), "
                        "123456.79 ms (12.3% of 1000.00 s), 987654.32 MB to host, 123456.79 MB back")
    assert lines[5] == ("between devices: 1234.568 MB copied from one flagos device to another "
                        "(1234567891 bytes)")
    assert len(lines) == 6  # no downcast line: no policy, no downcast calls

    # the downcast line: named by the policy alone, or by its calls alone
    policy_only = flagos.Report([row], elapsed_s=1.0, downcast_to="float16")
    assert str(policy_only).splitlines()[-1] == ("downcast (dtype_policy='downcast'): 0 calls made "
                                                 "float16 instead of bfloat16, 0.000 MB")
    counted = dict(row, downcast_calls=3, downcast_bytes=1_234_567_891)
    calls_only = flagos.Report([counted], elapsed_s=1.0)
    assert str(calls_only).splitlines()[-1] == ("downcast (dtype_policy='downcast'): 3 calls made "
                                                "another dtype instead of bfloat16, 1234.568 MB")


def test_a_scope_counts_only_what_ran_inside_it():
    """track() reports the compiled-graph calls and the bytes copied between devices of its
    own scope, not the process's totals before it."""
    _C.count_compiled_call()
    _C.count_compiled_call()
    _transfers.add(1_000_000)
    with flagos.track() as scope:
        for _ in range(3):
            _C.count_compiled_call()
        _transfers.add(250_000)
    assert (scope.compiled_calls, scope.to_dict()["totals"]["bytes_between_devices"]) == (3, 250_000)


_library_ops = torch.library.Library("flagos_routes_test", "DEF")  # kept for the process
_library_ops.define("scaled(Tensor x) -> Tensor")
_library_ops.impl("scaled", lambda x: x * 3, "CompositeExplicitAutograd")
_library_ops.impl("scaled", lambda x: x * 3 + 100, "PrivateUse1")  # the flagos device's kernel
_library_ops.define("scaled.twice(Tensor x) -> Tensor")  # a named overload, kernels of its own
_library_ops.impl("scaled.twice", lambda x: x * 6, "CompositeExplicitAutograd")
_library_ops.impl("scaled.twice", lambda x: x * 6 + 100, "PrivateUse1")

_device_kernel_calls: list = []


@functools.cache
def _custom_ops():
    """Ops with kernels for the flagos device, defined once per process, after activation
    (torch.library knows the name "flagos" from then on, as a user's script would)."""
    @torch.library.custom_op("flagos_routes_test::gelu_gate", mutates_args=())
    def gelu_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x) * torch.sigmoid(gate)  # every other device's kernel

    @gelu_gate.register_kernel("flagos")
    def _(x, gate):
        _device_kernel_calls.append((type(x), x.device.type, gate.device.type))
        return torch.nn.functional.gelu(x).mul_(gate.sigmoid())  # the same values, other ops

    @gelu_gate.register_fake
    def _(x, gate):
        return torch.empty_like(x)

    def backward(ctx, grad):
        x, gate = ctx.saved_tensors
        s = torch.sigmoid(gate)
        cdf = 0.5 * (1 + torch.erf(x / 2 ** 0.5))
        pdf = torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
        return grad * s * (cdf + x * pdf), grad * torch.nn.functional.gelu(x) * s * (1 - s)

    gelu_gate.register_autograd(
        backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))

    @torch.library.custom_op("flagos_routes_test::shift_", mutates_args=("x",), device_types="flagos")
    def shift_(x: torch.Tensor, by: float) -> None:
        """Only the flagos device has a kernel: there is no CPU kernel to fall back to."""
        x.add_(by)

    @torch.library.custom_op("flagos_routes_test::refuse", mutates_args=(), device_types="flagos")
    def refuse(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("refuse: this kernel takes no tensors today")

    return types.SimpleNamespace(gelu_gate=gelu_gate, shift_=shift_, refuse=refuse)


class _GatedMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.gate, self.down = (torch.nn.Linear(8, 16), torch.nn.Linear(8, 16),
                                         torch.nn.Linear(16, 8))

    def forward(self, x):
        return self.down(_custom_ops().gelu_gate(self.up(x), self.gate(x)))


def test_a_kernel_registered_for_the_device_through_torch_library_runs_with_its_tensors(dev):
    """`custom_op(...).register_kernel("flagos")` is the device's own kernel for that op, as
    register_kernel("cuda") is CUDA's: flagos calls it with the flagos tensors (its ops come
    back through the router), forward and backward (register_autograd), and a model built on
    the op trains as on CPU, where the op's CPU kernel runs."""
    torch.manual_seed(0)
    model, x = _GatedMLP(), torch.randn(4, 8)
    on_chip = _GatedMLP().to(dev)
    on_chip.load_state_dict(model.state_dict())
    model(x).square().mean().backward()
    _device_kernel_calls.clear()
    with flagos.track() as report:
        on_chip(x.to(dev)).square().mean().backward()
    assert _device_kernel_calls == [(type(x.to(dev)), "flagos", "flagos")]
    for want, got in zip(model.parameters(), on_chip.parameters()):
        assert_close(got.grad, want.grad, atol=1e-5)
    row = report.op("flagos_routes_test::gelu_gate")
    assert row["route"] == "override" and row["calls"] == {"override": 1, "native": 0, "fallback": 0}
    assert flagos.route_of("flagos_routes_test::gelu_gate") == "override"


def test_an_op_with_only_a_kernel_for_the_flagos_device_runs(dev):
    """An op whose only kernel is the flagos device's (`device_types="flagos"`) has no CPU
    kernel to fall back to: before, it failed "Could not run ... with arguments from the 'CPU'
    backend". It runs, and what it writes is the caller's tensor (a view of it sees it)."""
    x = torch.arange(6.0).to(dev)
    view = x.view(2, 3)
    assert _custom_ops().shift_(x, 1.5) is None
    assert x.cpu().tolist() == [1.5, 2.5, 3.5, 4.5, 5.5, 6.5]
    assert view.cpu().tolist() == [[1.5, 2.5, 3.5], [4.5, 5.5, 6.5]]
    with pytest.raises(ValueError, match="refuse: this kernel takes no tensors today"):
        _custom_ops().refuse(x)
    assert (x + 1).cpu().tolist() == [2.5, 3.5, 4.5, 5.5, 6.5, 7.5]  # and the device goes on


def test_flagos_register_kernel_and_forced_routes_come_before_the_devices_kernel(dev):
    """An override registered with flagos.register_kernel (the chip's own tensors) wins over
    the one registered for the device through torch.library; a route forced to native or
    fallback runs the op's other kernel (here CompositeExplicitAutograd's x * 3), as asked."""
    op = torch.ops.flagos_routes_test.scaled
    x = torch.arange(3.0).to(dev)
    assert op(x).cpu().tolist() == [100.0, 103.0, 106.0]  # PrivateUse1's kernel: the device's
    assert op.twice(x).cpu().tolist() == [100.0, 106.0, 112.0]  # each overload its own
    seen = []

    def kernel(t):
        seen.append(t.device.type)
        return t * 3 + 200

    flagos.register_kernel("flagos_routes_test::scaled", kernel)
    try:
        assert op(x).cpu().tolist() == [200.0, 203.0, 206.0]
        assert len(seen) == 1  # flagos.register_kernel's kernel ran, once
    finally:
        flagos.unregister_kernel("flagos_routes_test::scaled")
    assert op(x).cpu().tolist() == [100.0, 103.0, 106.0]
    for route in ("native", "fallback"):
        flagos.set_route("flagos_routes_test::scaled", route)
        assert op(x).cpu().tolist() == [0.0, 3.0, 6.0], route
        assert flagos.route_of("flagos_routes_test::scaled") == route
    flagos.set_route("flagos_routes_test::scaled", "override")  # the device's kernel is one
    assert op(x).cpu().tolist() == [100.0, 103.0, 106.0]


def test_route_of_an_op_no_library_has_defined_yet(dev):
    """A route may be set, and asked for, before the library that defines the op is imported:
    route_of answers the route the op will take (the chip's kernel unless forced), and an op
    the dispatcher does not know has no kernel of the device's to look for."""
    name = "flagos_routes_test_later::op"
    assert flagos.route_of(name) == "native"
    flagos.set_route(name, "fallback")
    assert flagos.route_of(name) == "fallback"
    with pytest.raises(RuntimeError, match="does not exist"):  # PyTorch's answer, for the record
        torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1")


def test_an_op_name_is_looked_up_as_torch_ops_knows_it():
    """The one lookup from a dispatcher name to its OpOverload (routes, autocast, the ops CPU
    runs whole): the default overload without a suffix, and None, not an error, for an operator
    or overload torch.ops does not know."""
    assert _schema.op_overload("aten::add") is torch.ops.aten.add.default
    assert _schema.op_overload("aten::add.Tensor") is torch.ops.aten.add.Tensor
    for unknown in ("aten::no_such_op", "aten::add.no_such_overload", "flagos_no_such_lib::op"):
        assert _schema.op_overload(unknown) is None


def test_an_unregistered_kernel_is_let_go(dev):
    """After unregister_kernel, flagos keeps no reference to the kernel: whatever it holds (a
    closure over model weights, say) is freed, even before the op runs again."""
    class Kernel:
        def __call__(self, x):
            return torch.clamp(x, min=0)

    kernel = Kernel()
    alive = weakref.ref(kernel)
    flagos.register_kernel("aten::relu", kernel, chip=CHIP)
    try:
        assert torch.tensor([-1.0, 2.0], device=dev).relu().cpu().tolist() == [0.0, 2.0]
        assert flagos.route_of("aten::relu") == "override"
    finally:
        flagos.unregister_kernel("aten::relu", chip=CHIP)
    del kernel
    gc.collect()
    assert alive() is None


def test_the_site_of_a_fallback_is_the_users_line_not_torchs(dev):
    """An op reached through torch's own Python (F.layer_norm, in torch/nn/functional.py) is
    reported at the line of user code that called it."""
    x = torch.randn(2, 8)
    flagos.set_route("aten::native_layer_norm", "fallback")
    out = torch.nn.functional.layer_norm(x.to(dev), (8,)); line = inspect.currentframe().f_lineno  # noqa: E702
    assert_close(out, torch.nn.functional.layer_norm(x, (8,)))
    assert flagos.fallback_report().op("aten::native_layer_norm")["site"].endswith(f"test_routes.py:{line}")


def test_the_site_of_a_fallback_called_by_contextlib_or_functools_is_the_users_line(dev):
    """The standard library's own Python that calls a function it was handed (an ExitStack's
    callbacks, a singledispatch function's default) is not the user's code either."""
    x = torch.randn(4)
    flagos.set_route("aten::neg", "fallback")
    flagos.set_route("aten::exp", "fallback")
    with contextlib.ExitStack() as stack:
        stack.callback(torch.neg, x.to(dev))
    with_line = inspect.currentframe().f_lineno - 2  # the exit runs the callback: the with's line
    exp_of = functools.singledispatch(torch.exp)
    assert_close(exp_of(x.to(dev)), x.exp()); line = inspect.currentframe().f_lineno  # noqa: E702
    report = flagos.fallback_report()
    assert report.op("aten::neg")["site"].endswith(f"test_routes.py:{with_line}"), report.op("aten::neg")["site"]
    assert report.op("aten::exp")["site"].endswith(f"test_routes.py:{line}"), report.op("aten::exp")["site"]

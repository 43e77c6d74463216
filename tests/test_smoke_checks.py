"""The checks of `flagos diagnose`'s smoke test (flagos/tools/_smoke.py) read as measured: each
detail against what this test computes itself on the suite's chip and on CPU, the tolerance of
each matmul check at its limit, a check that raises, the verdict, and the child process that
runs a chip's checks (its environment, and how it ends when it gives no answer)."""
import os
import signal
import sys
import time

import pytest
import torch
from conftest import CHIP, device_mode_only

import flagos
from flagos.tools import _smoke

pytestmark = device_mode_only

NAMES = ["activate", "allocate", "copy round trip", "matmul vs CPU", "float16", "bfloat16"]


def _matmul_error(dtype) -> float:
    """The smoke test's matmul, done here: the largest error against CPU float32 on the same
    rounded inputs, relative to the result's magnitude (at least 1)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 48, generator=g).to(dtype)
    b = torch.randn(48, 16, generator=g).to(dtype)
    reference = a.float() @ b.float()
    out = (a.to(flagos.device()) @ b.to(flagos.device())).cpu()
    assert out.dtype == dtype
    return float((out.float() - reference).abs().max()) / max(1.0, float(reference.abs().max()))


def test_every_check_on_the_suite_chip_reads_as_measured():
    held = torch.empty(2**20, device=flagos.device())  # 4 MiB in use before: the check counts its own
    found = _smoke.run_checks(CHIP)
    del held
    assert found["chip"] == CHIP
    checks = {c["name"]: c for c in found["checks"]}
    assert [c["name"] for c in found["checks"]] == NAMES
    for check in found["checks"]:
        assert check["seconds"] >= 0 and round(check["seconds"], 4) == check["seconds"], check
    count = torch.flagos.device_count()
    assert checks["activate"] == {**checks["activate"], "level": "OK",
                                  "detail": f"device mode, {count} device(s), flagos:0"}
    counted = ", allocator counts +1.0 MiB" if CHIP == "sim" else ""  # the cpu chip counts nothing
    assert checks["allocate"]["detail"] == f"1.0 MiB on flagos:0{counted}"
    hops = "host -> flagos:0 -> flagos:1 -> host" if count > 1 else "host -> flagos:0 -> host"
    assert checks["copy round trip"]["detail"] == f"{hops}, 16 KiB bit-exact"
    err = _matmul_error(torch.float32)
    assert checks["matmul vs CPU"]["detail"] == f"float32 32x48 @ 48x16 (native kernel): error {err:.1e}"
    half = _matmul_error(torch.float16)
    assert checks["float16"] == {**checks["float16"], "level": "OK", "detail": f"native, matmul error {half:.1e}"}
    brain = _matmul_error(torch.bfloat16)
    if "bfloat16" not in flagos.core._state.active().chip.native_dtypes:
        # sim by default: no bfloat16 kernels, its matmul runs on the CPU fallback
        assert checks["bfloat16"]["level"] == "WARN"
        assert checks["bfloat16"]["detail"] == (f"not native on {CHIP}: bfloat16 ops run on the CPU "
                                                f"fallback (correct, slower); matmul error {brain:.1e}")
        assert found["verdict"] == "warn"
    else:
        assert checks["bfloat16"]["detail"] == f"native, matmul error {brain:.1e}"
        assert found["verdict"] == "ok"


@pytest.mark.parametrize("name, tolerance", [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_each_matmul_check_passes_at_its_tolerance_and_fails_past_it(monkeypatch, name, tolerance):
    state = flagos.core._state.active()
    check = _smoke._matmul_float32 if name == "float32" else _smoke._half
    native = name in state.chip.native_dtypes

    monkeypatch.setattr(_smoke, "_matmul", lambda dtype: (tolerance, False))
    level, detail = check(state, name)
    assert level == ("OK" if native or name == "float32" else "WARN"), detail
    assert detail.endswith(f"error {tolerance:.1e}")

    monkeypatch.setattr(_smoke, "_matmul", lambda dtype: (tolerance * 1.01, False))
    level, detail = check(state, name)
    assert level == "FAIL"
    past = f"error {tolerance * 1.01:.2e} > {tolerance:.0e}"
    assert detail == (f"float32 32x48 @ 48x16 (native kernel): {past}" if name == "float32"
                      else f"matmul {past}")


def test_a_matmul_that_fell_back_says_so(monkeypatch):
    state = flagos.core._state.active()
    monkeypatch.setattr(_smoke, "_matmul", lambda dtype: (0.0, True))
    assert _smoke._matmul_float32(state, "float32") == \
        ("OK", "float32 32x48 @ 48x16 (CPU fallback): error 0.0e+00")
    level, detail = _smoke._half(state, "float16")
    assert level == "WARN" and detail.startswith(f"not native on {CHIP}: float16 ops run on the CPU fallback")


def test_a_check_that_raises_fails_alone_and_names_its_first_line(monkeypatch):
    def broken(state, name):
        raise RuntimeError("the copy engine stopped\nsecond line")

    def silent(state, name):
        raise ValueError()

    monkeypatch.setattr(_smoke, "_round_trip", broken)
    monkeypatch.setattr(_smoke, "_allocate", silent)
    found = _smoke.run_checks(CHIP)
    checks = {c["name"]: c for c in found["checks"]}
    assert list(checks) == NAMES and found["verdict"] == "fail"
    assert (checks["copy round trip"]["level"], checks["copy round trip"]["detail"]) == \
        ("FAIL", "RuntimeError: the copy engine stopped")
    assert (checks["allocate"]["level"], checks["allocate"]["detail"]) == ("FAIL", "ValueError: ")
    assert checks["matmul vs CPU"]["level"] == "OK" and checks["float16"]["level"] == "OK"


def test_a_round_trip_that_changes_values_fails_with_the_count(monkeypatch):
    real_cpu = torch.Tensor.cpu

    def lossy(self, *args, **kwargs):
        out = real_cpu(self, *args, **kwargs).clone()
        out.view(-1)[:3] += 1.0
        return out

    monkeypatch.setattr(torch.Tensor, "cpu", lossy)
    state = flagos.core._state.active()
    level, detail = _smoke._round_trip(state, "copy round trip")
    assert level == "FAIL" and detail.endswith(": 3 of 4096 values changed")


@pytest.mark.parametrize("levels, verdict", [
    ([], "ok"), (["OK"], "ok"), (["OK", "WARN"], "warn"), (["WARN", "OK"], "warn"),
    (["WARN", "FAIL"], "fail"), (["FAIL", "OK"], "fail"), (["OK", "WARN", "FAIL", "OK"], "fail")])
def test_the_verdict_is_the_worst_level(levels, verdict):
    assert _smoke._verdict([{"level": level} for level in levels]) == verdict


def test_a_check_records_its_seconds_to_a_tenth_of_a_millisecond(monkeypatch):
    monkeypatch.setattr(_smoke.time, "perf_counter", lambda: 12.3456789)
    assert _smoke._check("x", "OK", "d", 10.0) == {"name": "x", "level": "OK", "detail": "d",
                                                    "seconds": 2.3457}
    assert _smoke._mib(3 * 2**19) == "1.5 MiB"


def test_a_child_runs_with_the_defaults_and_finds_this_flagos(monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(_smoke.__file__)))
    root = os.path.dirname(root)
    for name in _smoke._CHILD_UNSET:
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("FLAGOS_FALLBACK", "error")
    monkeypatch.setenv("FLAGOS_SIM_DEVICES", "3")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = _smoke._child_environment()
    assert not set(_smoke._CHILD_UNSET) & set(env)
    assert env["FLAGOS_FALLBACK"] == "allow" and env["FLAGOS_SIM_DEVICES"] == "3"
    assert env["PYTHONPATH"] == root + os.pathsep + "/elsewhere"
    monkeypatch.delenv("PYTHONPATH")
    assert _smoke._child_environment()["PYTHONPATH"] == root


def test_which_chips_a_fresh_process_may_fork_for(monkeypatch):
    assert _smoke.host_side("cpu") and _smoke.host_side("sim")
    assert not _smoke.host_side("cuda") and not _smoke.host_side("npu")
    assert not _smoke.host_side("opencl")  # its driver has threads of its own
    assert not _smoke.can_fork("cpu")  # this process has flagos active
    monkeypatch.setattr(_smoke._state, "active_or_none", lambda: None)
    monkeypatch.setattr(_smoke.threading, "active_count", lambda: 1)
    assert _smoke.can_fork("cpu") and _smoke.can_fork("sim") and not _smoke.can_fork("cuda")
    monkeypatch.setattr(_smoke.threading, "active_count", lambda: 2)
    assert not _smoke.can_fork("cpu")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.parametrize("end, said", [
    ("raise", "the test process ended without an answer (exit code 1)"),
    ("signal", f"the test process ended without an answer (killed by signal {int(signal.SIGKILL)})"),
])
def test_a_forked_child_that_gives_no_answer_is_reported_by_how_it_ended(monkeypatch, end, said):
    def checks(chip):
        if end == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("the chip went away")

    monkeypatch.setattr(_smoke, "run_checks", checks)
    child = _smoke._Child("cpu", fork=True)
    answer = child.result(time.monotonic() + 60)
    assert answer == {"chip": "cpu", "verdict": "fail",
                      "checks": [{"name": "run", "level": "FAIL", "detail": said, "seconds": 0.0}]}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_past_its_deadline_is_killed(monkeypatch):
    monkeypatch.setattr(_smoke, "run_checks", lambda chip: time.sleep(30))
    child = _smoke._Child("cpu", fork=True)
    real_kill, killed = os.kill, []
    monkeypatch.setattr(_smoke.os, "kill", lambda pid, sig: (killed.append((pid, sig)), real_kill(pid, sig)))
    answer = child.result(time.monotonic() + 0.5)
    assert answer["checks"][0]["detail"] == f"the smoke test did not finish in {_smoke.TIMEOUT_S:.0f} s"
    assert killed == [(child.pid, signal.SIGKILL)]  # killed, not waited for
    with pytest.raises(ChildProcessError):
        os.waitpid(child.pid, os.WNOHANG)  # and reaped


def test_the_smoke_tests_get_60_seconds_together(monkeypatch):
    """docs/cli.md: every chip's test has the same deadline, 60 s after the results are asked for."""
    deadlines = []
    monkeypatch.setattr(_smoke.time, "monotonic", lambda: 1000.0)
    monkeypatch.setattr(_smoke._Child, "__init__", lambda self, chip, fork: setattr(self, "chip", chip))
    monkeypatch.setattr(_smoke._Child, "result", lambda self, deadline: deadlines.append(deadline) or self.chip)
    tests = _smoke.SmokeTests()
    for chip in ("cpu", "sim"):
        tests.start(chip)
    assert tests.results() == ["cpu", "sim"] and deadlines == [1060.0, 1060.0]


def test_a_chip_that_cannot_activate_is_one_failed_check():
    """This process has the suite's chip active in device mode, so activating another fails:
    the smoke test answers with that one failed check, and raises nothing."""
    other = "sim" if CHIP == "cpu" else "cpu"
    found = _smoke.run_checks(other)
    assert (found["chip"], found["verdict"], len(found["checks"])) == (other, "fail", 1)
    (check,) = found["checks"]
    assert (check["name"], check["level"]) == ("activate", "FAIL")
    assert check["detail"].startswith(f"ConfigError: flagos is already active on chip '{CHIP}'")


@pytest.mark.parametrize("wrong, said", [
    (lambda t: t.double(), "matmul gave torch.float64 (32, 16), expected torch.float32 (32, 16)"),
    (lambda t: t[:, :8], "matmul gave torch.float32 (32, 8), expected torch.float32 (32, 16)"),
])
def test_a_matmul_of_the_wrong_dtype_or_shape_is_a_failed_check(monkeypatch, wrong, said):
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: wrong(real_cpu(self, *a, **k)))
    found = _smoke.run_checks(CHIP)
    check = next(c for c in found["checks"] if c["name"] == "matmul vs CPU")
    assert (check["level"], check["detail"]) == ("FAIL", f"RuntimeError: {said}")


def test_children_fork_only_when_allowed_and_torch_warms_up_once_before_the_first(monkeypatch):
    started, warmed = [], []
    monkeypatch.setattr(_smoke._Child, "__init__", lambda self, chip, fork: started.append((chip, fork)))
    monkeypatch.setattr(_smoke, "_warm_up_torch", lambda: warmed.append(len(started)))
    monkeypatch.setattr(_smoke, "can_fork", lambda chip: chip != "opencl")
    default = _smoke.SmokeTests()  # a caller that did not ask: new interpreters only
    default.start("cpu")
    assert started == [("cpu", False)] and warmed == []
    started.clear()
    forking = _smoke.SmokeTests(allow_fork=True)
    forking.start("opencl")  # not forked: nothing to warm up for
    assert warmed == []
    for chip in ("cpu", "sim"):
        forking.start(chip)
    assert started == [("opencl", False), ("cpu", True), ("sim", True)]
    assert warmed == [1]  # once, before the first fork


def test_warming_up_a_pytorch_without_distributed_is_no_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", None)  # its import now fails
    with pytest.raises(ImportError):
        import torch.distributed.tensor  # noqa: F401
    _smoke._warm_up_torch()

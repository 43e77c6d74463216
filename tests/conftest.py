"""The suite runs in device mode on the cpu chip; anything that needs another
activation (native mode, autoload, bad environment) runs in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flagos
import flagos.runtime._registration
from flagos.runtime import _adapter_ops

sys.path.insert(0, os.path.dirname(__file__))

CHIP = os.environ.get("FLAGOS_TEST_CHIP", "cpu")
DEVICE_MODE = flagos.runtime._registration.device_mode_supported()
# The suite's own process runs in device mode; on a PyTorch without the Python device guard
# (2.9) only the tests that start their own native-mode processes run.
device_mode_only = pytest.mark.skipif(
    not DEVICE_MODE, reason=f"device mode needs torch._C._acc (PyTorch > 2.9); this is {torch.__version__}")
# Tests in the chip-dependent files (scripts/test.sh runs them again on sim and opencl) that do
# not use the run's chip: their own process names its chips itself, or none (run_python leaves
# the run's FLAGOS_ variables out). The same in every run, so they run once, in the cpu run.
runs_once = pytest.mark.skipif(
    CHIP != "cpu", reason="names its chips itself: runs once, in the cpu run")
# Tests in those files whose subject is not the chip (an import order, a library's cached
# choice): the same on every chip, so they run once, in the cpu run.
same_on_every_chip = pytest.mark.skipif(
    CHIP != "cpu", reason="tests an import order, not the chip: runs once, in the cpu run")


# FLAGOS_TEST_RUNNER_ONLY=1 (set by tests/test_sim_kernels.py for a run of its own): a C-ABI
# chip's router gets no C fast path, so every op goes through the Python runner (its kernel-table
# rules and its round trip), which otherwise sees only what the C path leaves to it.
RUNNER_ONLY = os.environ.get("FLAGOS_TEST_RUNNER_ONLY") == "1"


def _without_c_fast_path():
    init = _adapter_ops.Runner.__init__

    def runner_only(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.c_fast = None  # read by the router when it is configured: none, every op to the runner

    _adapter_ops.Runner.__init__ = runner_only


@pytest.fixture(scope="session", autouse=True)
def flagos_active():
    os.environ.setdefault("FLAGOS_FALLBACK", "allow")
    if not DEVICE_MODE:
        return None
    if RUNNER_ONLY:
        _without_c_fast_path()
    return flagos.activate(CHIP)


@pytest.fixture
def dev():
    return flagos.device()


def reference_device(index: int = 0) -> torch.device:
    """Plain PyTorch's device a test compares the run's chip with: the payload device of a
    torch-native chip whose payloads are not host tensors (cuda, npu, ...), whose random
    numbers, autocast policy and kernels flagos tensors get there; the CPU otherwise (the cpu
    chip, and C-ABI chips, whose random numbers and autocast are the CPU's)."""
    chip = flagos.core._state.active_or_none().chip
    if chip.torch_type and not chip.payload_is_host:
        return chip.torch_device(index)
    return torch.device("cpu")


@pytest.fixture
def ref():
    return reference_device()


@pytest.fixture(autouse=True)
def clean_routes():
    """Every test starts with automatic routes and empty counters."""
    if not DEVICE_MODE:
        yield
        return
    flagos.core._routes.clear_routes()
    flagos.reset_report()
    yield
    flagos.core._routes.clear_routes()


@pytest.fixture(autouse=True)
def restore_process_state():
    """What a test may change for the whole process goes back after it, even when the test
    fails half-way: the fallback policy, override kernels, the current device and the
    current streams. (Routes and counters: clean_routes.)"""
    if not DEVICE_MODE:
        yield
        return
    overrides = dict(flagos.core._routes._overrides)
    yield
    flagos._C.set_fallback_policy(flagos._activation._POLICIES[flagos.core._env.get("FLAGOS_FALLBACK") or "warn"])
    if flagos.core._routes._overrides != overrides:
        flagos.core._routes._overrides.clear()
        flagos.core._routes._overrides.update(overrides)
        flagos._C.invalidate()
    if flagos.core._state.active_or_none() is None:
        return
    if torch.flagos.current_device() != 0:
        torch.flagos.set_device(0)
    for index in range(torch.flagos.device_count()):
        torch.flagos.set_stream(torch.flagos.default_stream(index))  # no call when already current


def run_python(code: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (a new process can activate anew)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


class OpCounter:
    """Counts aten ops called with flagos tensor arguments, seen from a dispatch mode above the
    router. (Ops that only create flagos tensors from host data, e.g. `.to("flagos")`, reach the
    router as the empty/copy_ ops PyTorch splits them into, below any mode: not counted here.)"""

    def __init__(self):
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = Counter()

        def on_flagos(v):
            if isinstance(v, flagos.FlagosTensor):
                return True
            if isinstance(v, (list, tuple)):
                return any(on_flagos(x) for x in v)
            return False

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if on_flagos(args) or on_flagos(tuple(kwargs.values())):
                    counts[flagos.core._schema.op_name(func)] += 1
                return func(*args, **kwargs)

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def assert_close(actual, expected, atol=1e-6, rtol=1e-5):
    actual = actual.detach().cpu() if isinstance(actual, torch.Tensor) else torch.as_tensor(actual)
    expected = expected.detach().cpu() if isinstance(expected, torch.Tensor) else torch.as_tensor(expected)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def run_pytest(paths, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run test files in a fresh pytest process with `env` (FLAGOS_TEST_CHIP=sim: a file
    written for sim also runs from the cpu suite); the caller asserts on the outcome."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, paths)]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

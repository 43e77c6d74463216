"""The smoke test `flagos diagnose` runs on each available chip, each in its own process.

A process activates one chip (device mode cannot be undone), so every chip is tested in a
child: forked from a fresh `flagos` command (it has torch imported already, which saves a
second or more per chip), or a new interpreter (`python -m flagos.tools._smoke CHIP`) when the
caller's process is not fresh (flagos already active, other threads running) or the chip is a
GPU-like chip whose driver must not see a fork.

Each check is a dict {"name", "level" (OK, WARN, FAIL), "detail", "seconds"}.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

import torch

import flagos

from .. import chips
from ..chips.adapter import AdapterChip
from ..core import _state

OK, WARN, FAIL = "OK", "WARN", "FAIL"
TIMEOUT_S = 60.0

# Largest error of a 32x48 @ 48x16 matmul against CPU float32 on the same rounded inputs,
# relative to the result's magnitude: the per-dtype tolerances of FlagGems' accuracy tests,
# loosened for a 48-term sum.
_MATMUL_TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

# Settings of the caller that would change what the smoke test measures, or activate a chip
# at `import torch` in the child: the child runs with defaults and allows fallback silently.
_CHILD_UNSET = ("FLAGOS_DEVICE", "FLAGOS_DEVICE_BACKEND", "FLAGOS_MODE", "FLAGOS_ROUTE",
                "FLAGOS_REPORT", "FLAGOS_LOG_LEVEL")


def _check(name: str, level: str, detail: str, start: float) -> dict:
    return {"name": name, "level": level, "detail": detail,
            "seconds": round(time.perf_counter() - start, 4)}


def _verdict(checks: list[dict]) -> str:
    levels = {c["level"] for c in checks}
    return "fail" if FAIL in levels else "warn" if WARN in levels else "ok"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def run_checks(chip: str) -> dict:
    """Activate `chip` in this process and run every check; never raises."""
    checks: list[dict] = []
    start = time.perf_counter()
    try:
        info = flagos.activate(chip)
    except Exception as e:
        checks.append(_check("activate", FAIL, f"{type(e).__name__}: {e}", start))
        return {"chip": chip, "verdict": "fail", "checks": checks}
    checks.append(_check("activate", OK, f"{info['mode']} mode, {info['device_count']} "
                         f"device(s), {flagos.device()}", start))
    state = _state.active()
    steps = (("allocate", _allocate), ("copy round trip", _round_trip),
             ("matmul vs CPU", _matmul_float32), ("float16", _half), ("bfloat16", _half))
    for name, step in steps:
        start = time.perf_counter()
        try:
            level, detail = step(state, name)
        except Exception as e:  # the check failed; the other checks still run
            level, detail = FAIL, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        checks.append(_check(name, level, detail, start))
    return {"chip": chip, "verdict": _verdict(checks), "checks": checks}


def _allocate(state, name):
    dev = flagos.device()
    before = state.chip.memory_allocated(state.current)
    x = torch.empty(2**18, dtype=torch.float32, device=dev)  # 1 MiB
    grown = state.chip.memory_allocated(state.current) - before
    if x.device != dev:
        return FAIL, f"torch.empty(device={dev}) gave a tensor on {x.device}"
    counted = f", allocator counts +{_mib(grown)}" if grown else ""
    return OK, f"1.0 MiB on {dev}{counted}"


def _round_trip(state, name):
    g = torch.Generator().manual_seed(0)
    host = torch.randn(64, 64, generator=g)
    path = [flagos.device(0)] + ([flagos.device(1)] if state.device_count > 1 else [])
    x = host
    for dev in path:
        x = x.to(dev)
    back = x.cpu()
    hops = " -> ".join(["host", *map(str, path), "host"])
    if not torch.equal(back, host):
        bad = int((back != host).sum())
        return FAIL, f"{hops}: {bad} of {host.numel()} values changed"
    return OK, f"{hops}, 16 KiB bit-exact"


def _matmul(dtype):
    """(max abs error relative to the result's size, fell back to the CPU?) of one matmul."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 48, generator=g).to(dtype)
    b = torch.randn(48, 16, generator=g).to(dtype)
    reference = a.float() @ b.float()
    dev = flagos.device()
    with flagos.track() as report:
        out = (a.to(dev) @ b.to(dev)).cpu()
    if out.dtype != dtype or out.shape != reference.shape:
        raise RuntimeError(f"matmul gave {out.dtype} {tuple(out.shape)}, expected {dtype} "
                           f"{tuple(reference.shape)}")
    err = float((out.float() - reference).abs().max()) / max(1.0, float(reference.abs().max()))
    row = report.op("aten::mm")
    fell_back = bool(row and row["calls"]["fallback"])
    return err, fell_back


def _matmul_float32(state, name):
    err, fell_back = _matmul(torch.float32)
    where = "CPU fallback" if fell_back else "native kernel"
    if err > _MATMUL_TOLERANCE["float32"]:
        return FAIL, f"float32 32x48 @ 48x16 ({where}): error {err:.2e} > {_MATMUL_TOLERANCE['float32']:.0e}"
    return OK, f"float32 32x48 @ 48x16 ({where}): error {err:.1e}"


def _half(state, name):
    dtype = getattr(torch, name)
    tolerance = _MATMUL_TOLERANCE[name]
    err, fell_back = _matmul(dtype)
    if err > tolerance:
        return FAIL, f"matmul error {err:.2e} > {tolerance:.0e}"
    native = name in state.chip.native_dtypes
    if fell_back or not native:
        return WARN, (f"not native on {state.chip.name}: {name} ops run on the CPU fallback "
                      f"(correct, slower); matmul error {err:.1e}")
    return OK, f"native, matmul error {err:.1e}"


# ---- running each chip in its own process -----------------------------------------------

def _child_environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CHILD_UNSET}
    env["FLAGOS_FALLBACK"] = "allow"
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def host_side(chip: str) -> bool:
    """The host and C-ABI adapters: chips without GPU-driver state that a fork could break
    (an adapter over a driver with threads of its own, such as opencl, says it is not)."""
    profile = chips.profile(chip)
    return chip == "cpu" or (isinstance(profile, AdapterChip) and profile.fork_safe)


def can_fork(chip: str) -> bool:
    """Forking is safe from a fresh process (no flagos activation, no other threads) for
    host-side chips."""
    return (hasattr(os, "fork") and _state.active_or_none() is None
            and threading.active_count() == 1 and host_side(chip))


class _Child:
    """One chip's smoke test running in a child process."""

    def __init__(self, chip: str, fork: bool):
        self.chip, self.pid, self.proc = chip, None, None
        if fork:
            read_end, write_end = os.pipe()
            self.pid = os.fork()
            if self.pid == 0:  # the child: test, answer, and leave without running atexit hooks
                os.close(read_end)
                code = 1
                try:
                    os.environ.clear()
                    os.environ.update(_child_environment())
                    data = json.dumps(run_checks(chip)).encode()
                    with os.fdopen(write_end, "wb") as out:
                        out.write(data)
                    code = 0
                finally:
                    os._exit(code)
            os.close(write_end)
            self.stream = os.fdopen(read_end, "rb")
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "flagos.tools._smoke", chip],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         env=_child_environment())
            self.stream = self.proc.stdout

    def result(self, deadline: float) -> dict:
        data, error = b"", ""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    error = f"the smoke test did not finish in {TIMEOUT_S:.0f} s"
                    break
                ready, _, _ = select.select([self.stream], [], [], left)
                chunk = self.stream.read1(65536) if ready else b""
                if ready and not chunk:
                    break
                data += chunk
        finally:
            self.stream.close()
            status = self._reap(kill=bool(error))
        try:
            return json.loads(data)
        except ValueError:
            detail = error or f"the test process ended without an answer ({status})"
            return {"chip": self.chip, "verdict": "fail",
                    "checks": [{"name": "run", "level": FAIL, "detail": detail, "seconds": 0.0}]}

    def _reap(self, kill: bool) -> str:
        if self.proc is not None:
            if kill:
                self.proc.kill()
            stderr = self.proc.communicate()[1].decode(errors="replace").strip()
            last = stderr.splitlines()[-1] if stderr else ""
            return f"exit code {self.proc.returncode}" + (f": {last}" if last else "")
        if kill:
            os.kill(self.pid, 9)
        _, status = os.waitpid(self.pid, 0)
        if os.WIFSIGNALED(status):
            return f"killed by signal {os.WTERMSIG(status)}"
        return f"exit code {os.waitstatus_to_exitcode(status)}"


def _warm_up_torch() -> None:
    """PyTorch imports torch.distributed.tensor at the first op on a tensor subclass (about
    a second of CPU); done once before forking, no child has to do it again."""
    try:
        import torch.distributed.tensor  # noqa: F401
    except ImportError:  # a PyTorch built without distributed: nothing to warm up
        pass


class SmokeTests:
    """Smoke tests started chip by chip, as soon as each chip is known to be available, and
    collected together."""

    def __init__(self, allow_fork: bool = False):
        self.allow_fork = allow_fork
        self.children: list[_Child] = []
        self._warm = False

    def start(self, chip: str) -> None:
        fork = self.allow_fork and can_fork(chip)
        if fork and not self._warm:
            _warm_up_torch()
            self._warm = True
        self.children.append(_Child(chip, fork))

    def results(self) -> list[dict]:
        deadline = time.monotonic() + TIMEOUT_S
        return [child.result(deadline) for child in self.children]


if __name__ == "__main__":
    print(json.dumps(run_checks(sys.argv[1])))

"""Running the `flagos` command the way a user does, and a workload to watch, for the CLI tests."""
from __future__ import annotations

import json
import os
import pathlib
import selectors
import subprocess
import sys

import torch

import flagos

ROOT = pathlib.Path(__file__).resolve().parents[1]


def command_env(extra: dict | None = None) -> dict:
    """The caller's environment without FLAGOS_* settings, with this checkout importable, and
    with Python's default buffering (no PYTHONUNBUFFERED): a command whose output is read as it
    runs must flush it itself, as it must for a user who pipes it."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLAGOS_") and k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def run_flagos(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m flagos ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "flagos", *args], env=command_env(env),
                          capture_output=True, text=True, timeout=timeout)


def run_json(*args: str, env: dict | None = None, returncode: int = 0):
    """`python -m flagos ARGS --json`, checked for its exit status, parsed."""
    proc = run_flagos(*args, "--json", env=env)
    assert proc.returncode == returncode, (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def run_workload() -> tuple[torch.nn.Module, int]:
    """A small model on flagos.device(), checked against the same model on plain CPU, with
    GELU forced onto the CPU fallback so that every chip has a fallback to count. Returns the
    model (its weights stay on the device while it lives) and the bytes they hold."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8),
                                torch.nn.LayerNorm(8))
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = torch.softmax(model(x), dim=-1)
        flagos.set_route("aten::gelu", "fallback")
        model.to(flagos.device())
        got = torch.softmax(model(x.to(flagos.device())), dim=-1).cpu()
    torch.testing.assert_close(got, expected, rtol=1.3e-6, atol=1e-5)
    return model, sum(p.numel() * p.element_size() for p in model.parameters())


def first_line(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The first line a running command prints, or an AssertionError after `timeout` seconds
    (a line it never flushed must fail the test, not hang it)."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no line from the command within {timeout} s (not flushed?)")
    return proc.stdout.readline()

"""benchmarks/gpu_check.py without a GPU: it refuses clearly, and --dry-run runs its whole
plumbing with the cpu chip (the GPU run itself needs an NVIDIA GPU; benchmarks/README.md)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from flagos_cli import command_env

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=command_env(), capture_output=True,
                          text=True, timeout=timeout)


def load_module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run")
def test_refuses_without_a_gpu():
    proc = run_script("--quick", timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("no NVIDIA GPU: torch.cuda.is_available() is False") and "--dry-run" in lines[0]


def test_bad_options_are_usage_errors():
    proc = run_script("--checks", "bert,resnet", timeout=120)
    assert proc.returncode == 2 and "unknown check resnet" in proc.stderr and "ddpm" in proc.stderr


def test_dry_run_runs_every_check_in_both_modes(tmp_path):
    out = tmp_path / "result.json"
    proc = run_script("--dry-run", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "flagos/native" in proc.stdout and "all checks passed" in proc.stdout
    result = json.loads(out.read_text())
    assert result["dry_run"] is True
    rows = result["results"]
    assert [(r["mode"], r["check"]) for r in rows] == [(m, c) for m in ("device", "native")
                                                       for c in ("ddpm", "bert", "train", "compile", "attention")]
    for r in rows:
        assert r["ok"], r
        assert r["max_abs_diff"] <= r["atol"] + 1e-12, r
        assert r["native_ms"] > 0 and r["flagos_ms"] > 0 and r["ratio"] == pytest.approx(r["flagos_ms"] / r["native_ms"])
    # the attention the flagos side ran, named per row: inference in device mode reaches the
    # chip whole (the payload device's own attention); native mode sees the CPU's fused kernel
    for r in rows:
        if r["check"] in ("attention", "bert"):
            whole = r["mode"] == "device"
            assert r["attention_ops"] == ["aten::scaled_dot_product_attention" if whole else
                                          "aten::_scaled_dot_product_flash_attention_for_cpu"], r
    assert "[flash_attention_for_cpu]" in proc.stdout and "[scaled_dot_product_attention]" in proc.stdout
    for mode in ("device", "native"):
        assert result["flagos"][mode]["chip"] == "cpu" and result["flagos"][mode]["mode"] == mode
    # the flagos side did run through flagos: its ops were routed (device-mode compile: one
    # compiled flagos graph call instead)
    eager = [r for r in rows if r["check"] != "compile"]
    assert all(r["flagos_op_calls"] > 0 for r in eager)
    compiled = next(r for r in rows if (r["mode"], r["check"]) == ("device", "compile"))
    assert compiled["compiled_calls"] == 1 and compiled["graphs_compiled"] == {"native": 1, "flagos": 1}


def test_a_result_out_of_tolerance_fails_the_check():
    gpu_check = load_module()
    x = torch.randn(4, 8)
    assert gpu_check._compare("bert", x, x.clone())["ok"]
    worse = gpu_check._compare("bert", x, x + 1e-2)
    assert not worse["ok"] and worse["max_abs_diff"] == pytest.approx(1e-2, rel=1e-3)
    assert "beyond rtol" in worse["detail"]
    assert not gpu_check._compare("bert", x, x[:2])["ok"]
    assert not gpu_check._compare("bert", x, x * float("nan"))["ok"]
    table = gpu_check.format_table([{"mode": "device", "check": "bert", "ok": False, "detail": "beyond rtol"}])
    assert "FAIL beyond rtol" in table

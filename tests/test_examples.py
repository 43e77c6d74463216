"""The README's main job and the quickstart run as documented, on the cpu chip, on sim and (the
main job) on the opencl chip where it is built.

Each example runs as its own process on the chip it names; scripts/test.sh runs this file once
per chip, and each case runs in the run of its chip, so the chips' cases share the two lanes."""
import pathlib

import pytest
from conftest import CHIP, DEVICE_MODE, device_mode_only, run_python, runs_once

import flagos

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPENCL = flagos.chips.profile("opencl")
on_opencl = pytest.mark.skipif(not OPENCL.detect(), reason="no opencl chip here: " + (
    "" if OPENCL.detect() else OPENCL.why_unavailable()))


def on(chip: str, *values: str):
    """A case of the example on `chip`: it runs in the suite's run of that chip."""
    marks = [pytest.mark.skipif(CHIP != chip, reason=f"an example on {chip}: runs in the {chip} run")]
    if chip != "cpu":
        marks.append(device_mode_only)
    if chip == "opencl":
        marks.append(on_opencl)
    return pytest.param(chip, *values, marks=marks)


def run_example(script: str, *argv: str, env: dict | None = None):
    """Run examples/<script> with these arguments as `python examples/<script> ...` would."""
    return run_python(f"""
        import runpy, sys
        sys.argv = {[script, *argv]!r}
        runpy.run_path(r"{ROOT / 'examples' / script}", run_name="__main__")
    """, env={"FLAGOS_FALLBACK": "allow", **(env or {})})


@pytest.mark.parametrize("chip", [on("cpu"), on("sim"), on("opencl")])
def test_diffusers_pipeline_example(tmp_path, chip):
    image = tmp_path / "ddpm.png"
    proc = run_example("diffusers_pipeline.py", "--device", chip, "--steps", "3",
                       "--out", str(image))
    assert image.stat().st_size > 0
    mode = "device" if DEVICE_MODE else "native"
    assert f"on chip {chip} ({mode} mode" in proc.stdout and "max |flagos - cpu|" in proc.stdout
    assert "flagos fallback report" in proc.stdout and "aten::convolution" in proc.stdout
    assert "save_pretrained + from_pretrained on flagos: the same image" in proc.stdout


@device_mode_only
@runs_once
def test_diffusers_pool_example():
    """Two workers on the cpu chip: every image equals the one process's for its seed (the
    example exits non-zero otherwise)."""
    proc = run_example("diffusers_pool.py", "--chip", "cpu", "--devices", "2", "--prompts", "3",
                       "--steps", "2")
    assert "2 worker(s) on chip cpu (cpu worker 0, cpu worker 1)" in proc.stdout
    assert "every image matches the one process's image for its seed" in proc.stdout


@runs_once
def test_quickstart_example():
    proc = run_example("quickstart.py", env={"FLAGOS_DEVICE": "cpu"})
    gelu = [l for l in proc.stdout.splitlines() if l.startswith("aten::gelu ")]
    assert gelu and " fallback " in gelu[0]
    assert "step 2: loss" in proc.stdout


@device_mode_only
@runs_once
def test_log_level_shows_activation_and_routes():
    proc = run_python("""
        import torch, flagos
        flagos.activate("cpu")
        torch.ones(2, device="flagos") + 1
    """, env={"FLAGOS_LOG_LEVEL": "debug", "FLAGOS_ROUTE": "aten::add=fallback",
              "FLAGOS_FALLBACK": "allow"})
    assert "flagos INFO: flagos active on chip cpu (device mode" in proc.stderr
    assert "flagos DEBUG: aten::add.Tensor on cpu: fallback (forced)" in proc.stderr
    assert "flagos DEBUG: aten::fill_.Scalar on cpu: native" in proc.stderr


@device_mode_only
@pytest.mark.parametrize("chip,dtype", [on("cpu", "float16"), on("sim", "float16"), on("sim", "bfloat16")])
def test_diffusers_pipeline_example_under_autocast(tmp_path, chip, dtype):
    """The main job under autocast matches the same run under CPU autocast (the example exits
    non-zero past the dtype's tolerance)."""
    image = tmp_path / "ddpm.png"
    proc = run_example("diffusers_pipeline.py", "--device", chip, "--steps", "1", "--dtype", dtype,
                       "--out", str(image))
    line = next(l for l in proc.stdout.splitlines() if "max |flagos - cpu|" in l)
    assert f"({dtype})" in line
    assert float(line.split("max |flagos - cpu| = ")[1].split(";")[0]) <= 0.16


@device_mode_only
@pytest.mark.parametrize("chip", [on("cpu"), on("sim")])
def test_transformers_generate_example(chip):
    """generate() + tokenizer.decode match plain CPU; fp16 autocast + GradScaler training steps
    match CPU within fp16 tolerance (the example exits non-zero otherwise)."""
    proc = run_example("transformers_generate.py", "--device", chip, "--steps", "2")
    assert "generated on flagos:0: 'the chip runs" in proc.stdout
    line = next(l for l in proc.stdout.splitlines() if l.startswith("max |loss difference|"))
    assert float(line.split("= ")[1]) <= 1e-3


@device_mode_only
@pytest.mark.parametrize("chip,offload", [on("cpu", "model"), on("sim", "sequential"), on("cpu", "group")])
def test_diffusers_pipeline_example_with_offload(tmp_path, chip, offload):
    """The main job with its weights offloaded to the host matches plain CPU (the example exits
    non-zero otherwise), and the report shows the UNet's ops ran on flagos."""
    image = tmp_path / "ddpm.png"
    proc = run_example("diffusers_pipeline.py", "--device", chip, "--steps", "1", "--offload",
                       offload, "--out", str(image))
    line = next(l for l in proc.stdout.splitlines() if "max |flagos - cpu|" in l)
    assert f"(float32, {offload} offload)" in line
    assert float(line.split("max |flagos - cpu| = ")[1].split(";")[0]) <= 1e-3
    assert "aten::convolution" in proc.stdout and image.stat().st_size > 0

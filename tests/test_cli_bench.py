"""`flagos bench` run as a user runs it: statistics, fallback share, peak memory and the ratio
against plain PyTorch on the CPU, parsed from its JSON; and flagos.tools.bench from Python."""
import json
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch
from conftest import CHIP, device_mode_only

import flagos.tools
from flagos.tools import _bench, _models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_flagos(*args, env=None, pythonpath=()):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [*pythonpath, REPO, full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "flagos", *args], env=full_env,
                          capture_output=True, text=True, timeout=300)


def _param_bytes(spec):
    model = _models.load(spec).model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_bench_against_plain_torch(tmp_path):
    chart = tmp_path / "bench.png"
    # one op forced to the CPU fallback: the mlp runs 8 ops a step, gelu is 1 of them
    proc = run_flagos("bench", "mlp", "--chips", "torch-cpu,cpu,sim", "--batch", "2",
                      "--warmup", "2", "--iters", "5", "--json", "-", "--plot", str(chart),
                      "--progress", "always", env={"FLAGOS_ROUTE": "aten::gelu=fallback"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert (data["model"], data["batch"], data["iters"], data["base"]) == ("mlp", 2, 5, "torch-cpu")
    native, cpu, sim = data["results"]
    assert (native["chip"], native["device"], native["mode"]) == ("torch-cpu", "cpu", None)
    assert [(r["chip"], r["device"], r["mode"]) for r in (cpu, sim)] == \
        [("cpu", "flagos:0", "device"), ("sim", "flagos:0", "device")]
    for row in data["results"]:
        assert len(row["warmup_ms"]) == 2 and len(row["latencies_ms"]) == 5
        lat = row["latencies_ms"]
        assert row["min_ms"] == min(lat) and row["max_ms"] == max(lat)
        assert row["p50_ms"] == pytest.approx(statistics.median(lat))
        assert row["min_ms"] <= row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert row["mean_ms"] == pytest.approx(statistics.fmean(lat))
        assert row["std_ms"] == pytest.approx(statistics.stdev(lat))
        assert row["throughput_per_s"] == pytest.approx(2 * 5 / (sum(lat) / 1e3))
        assert row["ratio"] == pytest.approx(row["p50_ms"] / native["p50_ms"])
        # every chip computed what plain PyTorch computed
        assert row["output_checksum"] == pytest.approx(native["output_checksum"],
                                                       rel=1e-4, abs=1e-4)
    assert native["ratio"] == 1.0
    assert native["fallback"] is None and native["peak_memory_bytes"] is None
    # --progress always: each chip's bar counts the 2 warm-up and 5 timed steps to the end, never past
    counts = [tuple(map(int, m)) for m in re.findall(r"\] (\d+)/(\d+) ", proc.stderr)]
    assert counts and all(done <= total == 7 for done, total in counts), counts
    assert counts.count((7, 7)) == 3
    for row in (cpu, sim):
        fallback = row["fallback"]
        assert fallback["ops"] == ["aten::gelu"]
        assert (fallback["calls"], fallback["fallback_calls"]) == (5 * 8, 5)
        assert fallback["call_share"] == pytest.approx(1 / 8) and 0 < fallback["time_share"] <= 1
    # the time inside sim's kernels (7 of the 8 ops a step): a share of sim's time only
    assert native["kernel_time_share"] is None and cpu["kernel_time_share"] is None
    assert 0 < sim["kernel_time_share"] < 1
    table = _bench.format_results(data).splitlines()
    assert "kernel time" in table[2]
    assert table[-1].split()[-2] == f"{100 * sim['kernel_time_share']:.1f}%"
    # sim's weights stay on the device while it is measured; the cpu chip's memory is the
    # host's, not tracked, and not reported as 0
    assert sim["peak_memory_bytes"] >= _param_bytes("mlp") and cpu["peak_memory_bytes"] is None
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000
    for chip in ("torch-cpu", "cpu", "sim"):
        assert f"{chip:<12} [##############################] 7/7" in proc.stderr


def test_a_chip_that_fails_is_reported_and_the_others_still_run(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_flagos("bench", "mlp", "--chips", f"torch-cpu,{CHIP}", "--warmup", "0",
                      "--iters", "2", "--json", str(out),
                      env={"FLAGOS_ROUTE": "aten::gelu=fallback", "FLAGOS_FALLBACK": "error"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    native, chip = json.loads(out.read_text())["results"]
    assert len(native["latencies_ms"]) == 2 and native["ratio"] == 1.0
    assert "FallbackError" in chip["error"] and "aten::gelu" in chip["error"]
    assert chip["error"].startswith(f"chip {CHIP}: ") and "latencies_ms" not in chip
    table = proc.stdout.splitlines()
    assert any(line.split()[:2] == [CHIP, "failed"] for line in table)
    assert any(line.startswith(f"error: chip {CHIP}: FallbackError") for line in table)


def test_plot_without_matplotlib_names_the_fix(tmp_path):
    # a matplotlib that cannot be imported, first on the path
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib')\n")
    proc = run_flagos("bench", "mlp", "--chips", "torch-cpu", "--plot", str(tmp_path / "x.png"),
                      pythonpath=[str(tmp_path)])
    assert proc.returncode == 2
    assert "pip install 'flagos[plot]'" in proc.stderr and not (tmp_path / "x.png").exists()


def test_bench_compiled_against_plain_torch_compiled():
    """--compile: every chip, plain PyTorch included, runs the model under torch.compile; the
    compile is in the first warm-up iteration, and the compiled model computes what the eager
    one does."""
    proc = run_flagos("bench", "mlp", "--chips", f"torch-cpu,{CHIP}", "--warmup", "1",
                      "--iters", "3", "--compile", "--json", "-")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["compile"] is True
    eager = flagos.tools.bench("mlp", chips="torch-cpu", warmup=0, iters=1)
    assert eager["compile"] is False and eager["results"][0]["compiled_graphs"] is None
    for row in data["results"]:
        assert len(row["warmup_ms"]) == 1 and len(row["latencies_ms"]) == 3
        assert row["compiled_graphs"] >= 1   # Dynamo's count in the chip's process
        assert row["output_checksum"] == pytest.approx(eager["results"][0]["output_checksum"],
                                                       rel=1e-4, abs=1e-4)
    proc = run_flagos("bench", "mlp", "--chips", "torch-cpu", "--compile", "--warmup", "0")
    assert proc.returncode == 2 and "--compile needs at least one warm-up iteration" in proc.stderr


def test_usage_errors():
    proc = run_flagos("bench", "resnet9000", "--iters", "1")
    assert proc.returncode == 2 and "unknown model 'resnet9000'" in proc.stderr
    assert "mlp, cnn, bert, unet, ddpm" in proc.stderr
    with pytest.raises(ValueError, match="unknown chip 'gpu'.*torch-cpu"):
        flagos.tools.bench("mlp", chips="torch-cpu,gpu")
    with pytest.raises(ValueError, match="unknown dtype 'half-ish'"):
        flagos.tools.bench("mlp", dtype="half-ish")
    with pytest.raises(ValueError, match="does not exist"):
        flagos.tools.bench("missing_file.py:build")


@device_mode_only
def test_python_api_runs_the_active_chip_here():
    data = flagos.tools.bench("cnn", chips=[CHIP, "torch-cpu"], batch=2, warmup=1, iters=3,
                              dtype="float16" if CHIP == "sim" else "float32")
    chip, native = data["results"]
    assert (chip["chip"], data["base"], chip["ratio"]) == (CHIP, CHIP, 1.0)
    assert chip["device"] == "flagos:0" and len(chip["latencies_ms"]) == 3
    assert native["ratio"] == pytest.approx(native["p50_ms"] / chip["p50_ms"])
    tol = 5e-2 if data["dtype"] == "float16" else 1e-4
    assert chip["output_checksum"] == pytest.approx(native["output_checksum"], rel=tol, abs=tol)


def test_a_childs_messages_reach_a_stderr_that_is_no_file(monkeypatch, capsys):
    """Where sys.stderr is not a file (a notebook, a captured stream), what the child process
    for another chip prints is collected and written there, as text, once it ends."""
    other = "cpu" if CHIP == "sim" else "sim"  # a chip this process does not run: a child does
    monkeypatch.setenv("FLAGOS_LOG_LEVEL", "info")
    (row,) = flagos.tools.bench("mlp", chips=[other], warmup=0, iters=1)["results"]
    assert row["chip"] == other and "error" not in row
    assert f"flagos INFO: flagos active on chip {other}" in capsys.readouterr().err


def test_the_bert_workload_draws_token_ids_its_vocabulary_has():
    """Every id of the built-in bert's batches indexes its embedding table, whatever the seed."""
    for seed in range(4):
        work = _models.load("bert", batch=16, seed=seed)
        ids, vocab = work.inputs["input_ids"], work.model.config.vocab_size
        assert ids.shape == (16, 32) and 0 <= int(ids.min()) and int(ids.max()) < vocab
        assert torch.equal(work.inputs["attention_mask"], torch.ones_like(ids))


def test_a_user_model_imports_its_own_neighbour_before_an_installed_module(tmp_path, monkeypatch):
    """`path.py:function` runs as a script would: its folder comes first on the path, so a
    neighbour module wins over an installed one of the same name (here the standard library's
    `colorsys`)."""
    (tmp_path / "colorsys.py").write_text("WIDTH = 24\n")
    (tmp_path / "workload.py").write_text(
        "import torch\nfrom colorsys import WIDTH\n\n"
        "def build(batch=1):\n    return torch.nn.Linear(WIDTH, 2), torch.ones(batch, WIDTH)\n")
    # no colorsys imported yet for this test, and whatever was there before it is put back after
    monkeypatch.setitem(sys.modules, "colorsys", None)
    monkeypatch.delitem(sys.modules, "colorsys")
    monkeypatch.setattr(sys, "path", list(sys.path))
    work = _models.load(f"{tmp_path / 'workload.py'}:build", batch=3)
    assert work.model.in_features == 24 and work.inputs.shape == (3, 24)
    assert sys.path[0] == str(tmp_path)


def test_which_chips_run_in_this_process(monkeypatch):
    """The plain-PyTorch reference runs in this process only where flagos does not intercept CPU
    ops (not active, or device mode; native mode does); a chip only where flagos is active on it
    (or "auto"). Every other run gets a process of its own."""
    from types import SimpleNamespace

    from flagos.tools import _childrun
    for state, reference, chips in (
            (None, True, {"cpu": False, "sim": False, "auto": False}),
            (SimpleNamespace(mode="device", chip=SimpleNamespace(name="sim")), True,
             {"cpu": False, "sim": True, "auto": True}),
            (SimpleNamespace(mode="native", chip=SimpleNamespace(name="cpu")), False,
             {"cpu": True, "sim": False, "auto": True})):
        monkeypatch.setattr(_childrun, "_active", lambda state=state: state)
        assert _childrun.runs_here(_childrun.REFERENCE) is reference, state
        assert {chip: _childrun.runs_here(chip) for chip in chips} == chips, state


@device_mode_only
def test_a_run_in_this_process_that_fails_is_a_child_error_naming_chip_and_error():
    """The reference runs in this process (device mode): its failure is reported as one chip's,
    with the original error's type and words, and the tool goes on."""
    from flagos.tools import _childrun
    with pytest.raises(_childrun.ChildError, match=r"^chip torch-cpu: TypeError: .*loads") as caught:
        _childrun.call(_childrun.REFERENCE, "json:loads")  # loads(chip=...): no document given
    assert caught.value.chip == _childrun.REFERENCE


def test_a_childs_environment_names_its_chip_and_drops_the_callers(monkeypatch):
    from flagos.tools import _childrun
    monkeypatch.setenv("FLAGOS_DEVICE", "cpu")
    monkeypatch.setenv("FLAGOS_REPORT", "/tmp/elsewhere.json")
    monkeypatch.delenv("FLAGOS_FALLBACK", raising=False)
    reference, sim = _childrun._child_env(_childrun.REFERENCE), _childrun._child_env("sim")
    assert "FLAGOS_DEVICE" not in reference and sim["FLAGOS_DEVICE"] == "sim"
    assert "FLAGOS_REPORT" not in reference and "FLAGOS_REPORT" not in sim
    assert reference["FLAGOS_FALLBACK"] == sim["FLAGOS_FALLBACK"] == "allow"


def test_children_run_the_reference_without_flagos_and_a_chip_on_it(tmp_path, monkeypatch):
    """A child process for the reference leaves flagos inactive (plain PyTorch); one for a chip
    runs with flagos active on it."""
    from flagos.tools import _childrun
    (tmp_path / "where_it_runs.py").write_text(
        "from flagos.core import _state\n\n\n"
        "def where(chip):\n"
        "    state = _state.active_or_none()\n"
        "    return [chip, state.chip.name if state else None]\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    assert _childrun._call_in_child(_childrun.REFERENCE, "where_it_runs:where", {}) == [_childrun.REFERENCE, None]
    assert _childrun._call_in_child("sim", "where_it_runs:where", {}) == ["sim", "sim"]

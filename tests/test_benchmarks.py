"""benchmarks/run_all.py, the one command for every figure: it runs the scripts, keeps each
one's figures with the machine they were measured on, and writes the table and the plots.
Its figures are not checked here (timings are not tests); its plumbing is."""
import importlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _benchmark_module(name: str):
    """A module of benchmarks/ (the folder is not a package)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_run_all_writes_json_table_and_plots(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--quick",
                           "--only", "fallback,redirect", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads((tmp_path / "results.json").read_text())
    assert [e["label"] for e in run["runs"]] == ["fallback_cost cpu", "fallback_cost sim", "redirect_overhead"]
    for entry in run["runs"]:
        env_of_run = entry["data"]["environment"]
        assert env_of_run["cores"] == os.cpu_count() and env_of_run["torch"]
        assert len(entry["load_average_before"]) == 3
    sizes = run["runs"][1]["data"]["results"]["sizes"]
    assert list(sizes) == ["64 KiB", "1 MiB", "16 MiB"]
    for figures in sizes.values():
        # one float32 tensor to the host and its result back, every call
        assert figures["bytes_moved_per_call"] == 2 * figures["bytes"]
        eff, ceiling = figures["efficiency"], figures["ceiling"]
        assert 0 < eff["min"] <= eff["median"] <= eff["max"]
        assert 0 < ceiling["min"] <= ceiling["median"] <= ceiling["max"]
    table = (tmp_path / "results.md").read_text()
    assert "| sim | 16 MiB |" in table and "### redirect_overhead" in table
    assert (tmp_path / "fallback.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_all_refuses_an_unknown_piece(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--only", "warp",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown piece(s) warp; choose from autoload, bench" in proc.stderr


def test_run_all_tables_and_plots_the_compile_piece(tmp_path):
    """The `compile` piece (compile_overhead.py) reaches the table and the models plot; a side
    whose Dynamo counts differ is named in the table instead of "same"."""
    run_all = _benchmark_module("run_all")
    counts = {"graphs": 1, "recompiles": 0, "graph_breaks": 0}
    figures = {"native_ms": 2.5, "flagos_ms": 2.6, "ratio": 1.04, "paired_ratio": 1.03,
               "dynamo_native": counts, "dynamo_flagos": counts,
               "compiled_while_timing": {"graphs": 0, "recompiles": 0, "graph_breaks": 0}}
    broken = dict(figures, dynamo_flagos={"graphs": 2, "recompiles": 1, "graph_breaks": 0})
    run = {"environment": {"utc": "now", "machine": "here", "load_average": [1.0, 1.0, 1.0]},
           "runs": [{"label": "compile_overhead cpu", "data": {"results": {
               "chip": "cpu", "compile_mode": "default", "threads": 1,
               "models": {"unet step": figures, "bert-tiny fwd": broken}}}}]}
    run["runs"][0]["data"]["results"]["models"]["unet step"]["floor_paired_ratio"] = 1.06
    table = run_all.markdown(run)
    assert "| unet step | 2.50 | 2.60 | 1.04 | 1.03 | 1.06 | same |" in table
    assert "| bert-tiny fwd |" in table and "flagos {'graphs': 2" in table
    written = run_all.plots(run, str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["models.png"]
    assert (tmp_path / "models.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_floor_wrapper_computes_what_the_cpu_does():
    """The floor beside the per-op figure must run the op and wrap every tensor it returns:
    layer_norm's three outputs, one output, a non-tensor result."""
    _floor = _benchmark_module("_floor")
    torch = _floor.torch
    x = torch.randn(4, 8)
    wrapped = _floor.floor_tensor(x)
    out, mean, rstd = torch.ops.aten.native_layer_norm(wrapped, [8], None, None, 1e-5)
    expected = torch.ops.aten.native_layer_norm(x, [8], None, None, 1e-5)
    for got, want in zip((out, mean, rstd), expected):
        assert type(got) is _floor.FloorTensor
        assert got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got._payload, want)
    total = wrapped.sum()
    assert type(total) is _floor.FloorTensor and torch.equal(total._payload, x.sum())
    assert wrapped.dim() == 2 and torch.ops.aten.sym_size.int(wrapped, 1) == 8
    # tensors in a list argument (cat's), a keyword argument, a list of outputs (split's)
    joined = torch.cat([wrapped, _floor.floor_tensor(x * 2)], dim=0)
    assert type(joined) is _floor.FloorTensor and torch.equal(joined._payload, torch.cat([x, x * 2]))
    scaled = torch.ops.aten.add.Tensor(wrapped, other=_floor.floor_tensor(x), alpha=3)
    assert torch.equal(scaled._payload, x + 3 * x)
    parts = torch.split(wrapped, 3, dim=1)
    assert [type(p) for p in parts] == [_floor.FloorTensor] * 3
    assert all(torch.equal(p._payload, q) for p, q in zip(parts, torch.split(x, 3, dim=1)))


def test_a_model_on_the_floor_computes_what_the_cpu_does():
    """The floor beside the model ratios runs the whole model behind the floor wrapper."""
    _floor = _benchmark_module("_floor")
    torch = _floor.torch
    torch.manual_seed(0)
    net = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = net(x)
        got = _floor.floor_module(net)(_floor.floor_tensor(x))
    assert all(type(p) is _floor.FloorTensor for p in net.parameters())
    assert type(got) is _floor.FloorTensor
    torch.testing.assert_close(got._payload, expected)


def test_run_all_puts_the_floors_figure_beside_each_op():
    """layer_norm and the realistic ops carry the floor's own overhead for the same op, in
    brackets; a run without the floor (an older build) shows the figure alone."""
    run_all = _benchmark_module("run_all")

    def op(native, flagos, floor):
        return {"native_us": native, "flagos_us": flagos, "floor_us": floor, "kernel_us": 0.0}

    results = {"chip": "cpu", "median_overhead_us": 3.8, "median_overhead_less_kernel_us": 3.8,
               "floor_median_overhead_us": 3.6,
               "small_ops": {"add": op(1.0, 4.8, 4.6), "layer_norm": op(2.0, 10.5, 10.75)},
               "realistic_ops": {"sdpa 1x8x128x64": {"native_us": 400.0, "flagos_us": 416.0,
                                                     "overhead_us": 15.5, "floor_overhead_us": 11.0},
                                 "conv2d 1x256x8x8": {"native_us": 800.0, "flagos_us": 812.0}}}
    run = {"environment": {"utc": "now", "machine": "here", "load_average": [1.0, 1.0, 1.0]},
           "runs": [{"label": "dispatch_overhead cpu", "data": {"results": results}}]}
    models = {"bert-tiny fwd": {"native_ms": 0.5, "flagos_ms": 1.2, "ratio": 2.4, "floor_ratio": 2.2},
              "unet step": {"native_ms": 2.0, "flagos_ms": 4.0, "ratio": 2.0}}
    run["runs"].append({"label": "model_overhead cpu", "data": {"results": {"chip": "cpu", "models": models}}})
    table = run_all.markdown(run)
    assert "| cpu | 3.80 | - | 3.60 | 3.80 | 8.50 (8.75) | +15.5 (+11.0) | +12.0 |" in table
    assert "| bert-tiny fwd | 0.50 | 1.20 | 2.40 | 2.20 |" in table and "| unet step | 2.00 | 4.00 | 2.00 | - |" in table


def test_the_traced_floor_compiles_to_what_the_cpu_computes():
    """The floor beside the compiled figures is a wrapper subclass that torch.compile traces
    like flagos's: one graph whose output is wrapped, the CPU's values inside."""
    _floor = _benchmark_module("_floor")
    torch = _floor.torch
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = net(x)
        compiled = torch.compile(_floor.traced_floor_module(net))
        got = compiled(_floor.traced_floor_tensor(x))
    assert all(type(p) is _floor.TracedFloorTensor and p._is_param for p in net.parameters())
    assert type(got) is _floor.TracedFloorTensor and type(got._payload) is torch.Tensor
    torch.testing.assert_close(got._payload, expected)


def test_run_all_takes_the_chips_and_tables_the_kernel_share(tmp_path):
    run_all = _benchmark_module("run_all")
    labels = [label for _, label, _ in run_all._jobs(True, False, ("cpu", "opencl"))]
    assert "dispatch_overhead opencl" in labels and "fallback_cost opencl" in labels
    assert not any("sim" in label for label in labels)
    bench = next(cmd for piece, _, cmd in run_all._jobs(True, False, ("cpu", "opencl")) if piece == "bench")
    assert bench[bench.index("--chips") + 1] == "torch-cpu,cpu,opencl"
    rows = [{"chip": "torch-cpu", "requested": "torch-cpu", "p50_ms": 2.0, "ratio": 1.0, "kernel_time_share": None},
            {"chip": "opencl", "requested": "opencl", "p50_ms": 5.0, "ratio": 2.5, "kernel_time_share": 0.6}]
    run = {"environment": {"utc": "now", "machine": "here", "load_average": [1.0, 1.0, 1.0]},
           "runs": [{"label": "bench unet", "data": {"results": rows}}]}
    table = run_all.markdown(run)
    assert "| model | torch-cpu | opencl |" in table
    assert "| unet | 2.00 (1.00x) | 5.00 (2.50x; kernels 60%) |" in table
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--chips", "torch-cpu",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--chips takes flagos chips" in proc.stderr

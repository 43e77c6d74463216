"""`flagos bench`'s figures and words, each against a hand-computed answer: the statistics, the
ratios, the table, the progress bar, the command line's defaults and exit codes. The runs that
measure real chips are in test_cli_bench.py; here the measurements are given, so every figure
the tool prints can be checked exactly."""
import io
import json
import statistics
import struct

import numpy
import pytest
import torch
from conftest import CHIP, device_mode_only
from matplotlib import pyplot

from flagos.tools import _bench, _childrun, _models, cli


def _row(chip, latencies, **extra):
    return {"chip": chip, "device": "cpu", "mode": None, "warmup_ms": [9.0],
            "latencies_ms": list(latencies), "peak_memory_bytes": None, "fallback": None,
            "compiled_graphs": None, "kernel_time_share": None, "output_checksum": 1.5, **extra}


@pytest.fixture
def measured(monkeypatch):
    """bench() with each chip's measurement given by the test: chip -> row, or an exception."""
    rows, asked = {}, []

    def call(chip, target, **kwargs):
        asked.append((chip, target, kwargs))
        answer = rows[chip]
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)
    monkeypatch.setattr(_childrun, "call", call)
    return rows, asked


def test_percentiles_interpolate_between_ranks_as_numpy_does():
    for values in ([4.0], [1.0, 2.0], [3.0, 1.0, 10.0, 7.5], [float(v * v % 17) for v in range(23)]):
        ordered = sorted(values)
        for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
            assert _bench._percentile(ordered, q) == pytest.approx(numpy.percentile(values, 100 * q),
                                                                   rel=1e-12), (values, q)
    # by hand: position (4 - 1) * 0.5 = 1.5, halfway between 2 and 6
    assert _bench._percentile([1.0, 2.0, 6.0, 9.0], 0.5) == 4.0


def test_summary_of_latencies_and_batch():
    latencies = [5.0, 1.0, 4.0, 2.0, 3.0]
    summary = _bench.summarize(latencies, batch=4)
    assert summary == {
        "min_ms": 1.0, "p50_ms": 3.0, "p90_ms": pytest.approx(4.6), "p99_ms": pytest.approx(4.96),
        "mean_ms": 3.0, "std_ms": pytest.approx(statistics.stdev(latencies)), "max_ms": 5.0,
        # 4 samples in each of 5 iterations, 15 ms in all
        "throughput_per_s": pytest.approx(4 * 5 / 0.015)}
    assert _bench.summarize([1.0, 3.0], batch=1)["std_ms"] == pytest.approx(2 ** 0.5)
    one = _bench.summarize([2.5], batch=1)
    assert one["std_ms"] == 0.0 and one["min_ms"] == one["p99_ms"] == one["max_ms"] == 2.5
    assert one["throughput_per_s"] == pytest.approx(400.0)


def test_ratios_are_against_the_first_chip(measured):
    rows, asked = measured
    rows.update({"torch-cpu": _row("torch-cpu", [2.0, 2.0, 4.0]),
                 "cpu": _row("cpu", [3.0, 5.0, 7.0]),
                 "sim": _row("sim", [8.0, 8.0, 8.0])})
    data = _bench.bench("mlp", chips=" torch-cpu,CPU,, sim", batch=2, warmup=1, iters=3, seed=7)
    assert [r["chip"] for r in data["results"]] == ["torch-cpu", "cpu", "sim"]
    assert [r["requested"] for r in data["results"]] == ["torch-cpu", "cpu", "sim"]
    assert (data["base"], data["batch"], data["warmup"], data["iters"], data["seed"]) == \
        ("torch-cpu", 2, 1, 3, 7)
    # medians 2, 5, 8; means 8/3, 5, 8
    assert [r["ratio"] for r in data["results"]] == [1.0, 2.5, 4.0]
    assert [r["ratio_mean"] for r in data["results"]] == pytest.approx([1.0, 15 / 8, 3.0])
    assert data["results"][1]["throughput_per_s"] == pytest.approx(2 * 3 / 0.015)
    # each chip measured once, with the arguments given
    assert [chip for chip, _, _ in asked] == ["torch-cpu", "cpu", "sim"]
    assert asked[0][1] == "flagos.tools._bench:measure"
    assert asked[0][2] == {"model": "mlp", "batch": 2, "warmup": 1, "iters": 3, "dtype": "float32",
                           "seed": 7, "progress": "never", "compile": False}


def test_the_python_api_defaults_are_the_command_lines(measured):
    rows, asked = measured
    rows.update({"torch-cpu": _row("torch-cpu", [1.0]), "auto": _row("sim", [2.0])})
    data = _bench.bench("bert")
    assert [chip for chip, _, _ in asked] == ["torch-cpu", "auto"]
    assert asked[0][2] == {"model": "bert", "batch": 1, "warmup": 3, "iters": 20, "dtype": "float32",
                           "seed": 0, "progress": "never", "compile": False}
    assert (data["batch"], data["warmup"], data["iters"], data["seed"], data["compile"]) == (1, 3, 20, 0, False)
    assert data["results"][1]["requested"] == "auto" and data["results"][1]["chip"] == "sim"


def test_a_failed_chip_has_no_ratio_and_a_failed_base_leaves_none(measured):
    rows, _ = measured
    rows.update({"torch-cpu": _row("torch-cpu", [2.0]),
                 "cpu": _childrun.ChildError("cpu", "RuntimeError: boom"),
                 "sim": _row("sim", [6.0])})
    data = _bench.bench("mlp", chips="torch-cpu,cpu,sim", warmup=0, iters=1)
    base, failed, sim = data["results"]
    assert failed == {"chip": "cpu", "error": "chip cpu: RuntimeError: boom", "requested": "cpu",
                      "ratio": None, "ratio_mean": None}
    assert (base["ratio"], sim["ratio"], sim["ratio_mean"]) == (1.0, 3.0, 3.0)
    data = _bench.bench("mlp", chips="cpu,sim", warmup=0, iters=1)
    assert data["base"] == "cpu"
    assert [(r["ratio"], r["ratio_mean"]) for r in data["results"]] == [(None, None)] * 2


@pytest.mark.parametrize("kwargs, words", [
    ({"chips": ""}, "no chips given"),
    ({"chips": " , "}, "no chips given"),
    ({"chips": []}, "no chips given"),
    ({"batch": 0}, "batch and iters must be at least 1"),
    ({"iters": 0}, "batch and iters must be at least 1"),
    ({"warmup": -1}, "warmup at least 0"),
    ({"compile": True, "warmup": 0}, "--compile needs at least one warm-up iteration"),
])
def test_bad_arguments_are_value_errors_before_anything_runs(measured, kwargs, words):
    rows, asked = measured
    with pytest.raises(ValueError, match=words):
        _bench.bench("mlp", **kwargs)
    assert asked == []


def test_the_smallest_arguments_are_accepted(measured):
    rows, asked = measured
    rows["torch-cpu"] = _row("torch-cpu", [1.0])
    _bench.bench("mlp", chips="torch-cpu", batch=1, iters=1, warmup=0)
    _bench.bench("mlp", chips="torch-cpu", iters=1, warmup=1, compile=True)
    assert [kwargs["compile"] for _, _, kwargs in asked] == [False, True]


def test_command_line_defaults():
    args = cli.build_parser().parse_args(["bench", "bert"])
    assert (args.model, args.chips, args.batch, args.warmup, args.iters, args.dtype, args.seed) == \
        ("bert", "torch-cpu,auto", 1, 3, 20, "float32", 0)
    assert (args.compile, args.json, args.plot, args.progress) == (False, None, None, "auto")
    args = cli.build_parser().parse_args(["bench", "mlp", "--warmup", "0", "--seed", "-3"])
    assert (args.warmup, args.seed) == (0, -3)
    for bad in (["--batch", "0"], ["--iters", "0"], ["--warmup", "-1"], ["--progress", "sometimes"]):
        with pytest.raises(SystemExit) as stopped:
            cli.build_parser().parse_args(["bench", "mlp", *bad])
        assert stopped.value.code == 2, bad


def _data(**extra):
    cpu = _row("cpu", [1.0, 2.0, 3.0], peak_memory_bytes=3 * 2**20, kernel_time_share=0.4251,
               fallback={"calls": 80, "fallback_calls": 10, "call_share": 0.125,
                         "time_share": 0.03333, "ops": ["aten::gelu"]})
    cpu.update(_bench.summarize(cpu["latencies_ms"], 2), ratio=1.5)
    base = _row("torch-cpu", [2.0], ratio=1.0)
    base.update(_bench.summarize(base["latencies_ms"], 2))
    return {"model": "mlp", "batch": 2, "dtype": "float16", "warmup": 1, "iters": 3,
            "base": "torch-cpu", "compile": False,
            "results": [base, {"chip": "sim", "error": "chip sim: OSError: gone", "ratio": None}, cpu],
            **extra}


def test_the_table_shows_every_figure_of_each_chip():
    lines = _bench.format_results(_data()).splitlines()
    assert lines[0] == "bench mlp: batch 2, float16, 1 warm-up + 3 measured iterations"
    assert lines[1] == ""
    assert lines[2].split("  ")[0] == "chip" and lines[2].endswith("ratio vs torch-cpu")
    base, sim, cpu = (line.split() for line in lines[4:7])   # a failed chip keeps its place
    assert base == ["torch-cpu", "2.000", "2.000", "2.000", "2.000", "2.000", "0.000", "1000.0",
                    "-", "-", "-", "-", "1.00x"]
    assert cpu == ["cpu", "1.000", "2.000", "2.800", "2.980", "2.000", "1.000", "1000.0",
                   "3.0", "MiB", "12.5%", "3.3%", "42.5%", "1.50x"]
    assert sim == ["sim", "failed"] + ["-"] * 11
    assert lines[7:] == ["error: chip sim: OSError: gone"]
    compiled = _bench.format_results(_data(compile=True)).splitlines()[0]
    assert compiled == "bench mlp, torch.compile: batch 2, float16, 1 warm-up + 3 measured iterations"


class _Clock:
    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


class _Stderr(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def _bar(monkeypatch, mode, tty=True, total=4, start=100.0):
    clock, err = _Clock(), _Stderr(tty)
    clock.now = start
    monkeypatch.setattr(_bench.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(_bench.sys, "stderr", err)
    return _bench._ProgressBar("sim", total, mode), clock, err


def test_the_progress_bar_draws_at_most_ten_times_a_second_and_always_the_end(monkeypatch):
    bar, clock, err = _bar(monkeypatch, "always", start=0.0)
    clock.now = 0.0625
    bar.update(1)                      # 62.5 ms after the start: not yet
    assert err.getvalue() == ""
    clock.now = 0.1
    bar.update(1)                      # 100 ms (exactly: 0.1 - 0.0): drawn
    assert err.getvalue() == "\rsim          [#######.......................] 1/4    0.1s"
    clock.now = 0.1875
    bar.update(3)                      # 87.5 ms after the last drawing: not yet
    assert err.getvalue().count("\r") == 1
    bar.update(4)                      # the end is drawn whenever it comes
    assert err.getvalue().endswith("\rsim          [##############################] 4/4    0.2s")
    bar.close()
    assert err.getvalue().endswith("4/4    0.2s\n")


def test_the_progress_bar_in_auto_waits_a_second_and_needs_a_terminal(monkeypatch):
    bar, clock, err = _bar(monkeypatch, "auto")
    clock.now = 100.9375
    bar.update(2)
    assert err.getvalue() == ""
    clock.now = 101.0
    bar.update(2)
    assert err.getvalue() == "\rsim          [###############...............] 2/4    1.0s"
    for mode, tty in (("auto", False), ("never", True)):
        bar, clock, err = _bar(monkeypatch, mode, tty=tty)
        clock.now += 5.0
        bar.update(4)
        bar.close()
        assert err.getvalue() == "", mode   # nothing drawn, no line ended


class _Args:
    def __init__(self, **kwargs):
        self.__dict__.update(model="mlp", chips="torch-cpu", batch=1, warmup=0, iters=1,
                             dtype="float32", seed=0, progress="never", compile=False,
                             json=None, plot=None)
        self.__dict__.update(kwargs)


def test_the_commands_exit_codes_and_where_it_writes(monkeypatch, tmp_path, capsys):
    data = _data()
    monkeypatch.setattr(_bench, "bench", lambda *a, **k: data)
    assert _bench.run(_Args()) == 1          # a chip failed
    assert capsys.readouterr().out.startswith("bench mlp: batch 2")
    data["results"].pop(1)   # the failed chip
    path = tmp_path / "out.json"
    assert _bench.run(_Args(json=str(path))) == 0
    assert capsys.readouterr().out.startswith("bench mlp: batch 2")
    assert json.loads(path.read_text())["results"][1]["p90_ms"] == pytest.approx(2.8)
    assert _bench.run(_Args(json="-")) == 0  # the JSON alone on stdout, no table
    assert json.loads(capsys.readouterr().out)["base"] == "torch-cpu"
    chart = tmp_path / "chart.png"
    assert _bench.run(_Args(plot=str(chart))) == 0
    assert capsys.readouterr().out.endswith(f"chart written to {chart}\n")
    png = chart.read_bytes()
    # a PNG of 11 x 4 inches at 100 dpi: its header's width and height
    assert png[:4] == b"\x89PNG" and struct.unpack(">II", png[16:24]) == (1100, 400)
    assert _bench.run(_Args(json="-", plot=str(chart))) == 0
    assert "chart written" not in capsys.readouterr().out

    def refuse(*a, **k):
        raise ValueError("unknown dtype 'x'")
    monkeypatch.setattr(_bench, "bench", refuse)
    assert _bench.run(_Args()) == 2
    assert capsys.readouterr().err == "flagos bench: unknown dtype 'x'\n"


@device_mode_only
def test_measure_counts_only_the_measured_iterations(monkeypatch):
    """The report is reset after the warm-up, and the shares are of the measured time, at most 1."""
    monkeypatch.setattr(_bench, "_kernel_seconds", iter([0.0, 1e9] * 2).__next__)
    row = _bench.measure(CHIP, "mlp", batch=1, warmup=2, iters=3, dtype="float32", seed=0)
    assert (len(row["warmup_ms"]), len(row["latencies_ms"])) == (2, 3)
    assert row["fallback"]["calls"] == 3 * 8   # the mlp runs 8 ops a step
    assert row["kernel_time_share"] == 1.0     # clamped: the fake kernels took longer than the run
    assert row["chip"] == CHIP and row["compiled_graphs"] is None
    reference = _bench.measure(_childrun.REFERENCE, "mlp", batch=1, warmup=0, iters=1,
                               dtype="float32", seed=0)
    assert reference["fallback"] is None and reference["kernel_time_share"] is None
    assert reference["output_checksum"] == pytest.approx(row["output_checksum"], rel=1e-5)


def test_measure_times_each_iteration_in_milliseconds_and_counts_its_progress(monkeypatch):
    """Each iteration's latency is the time its call took, in ms (a fake clock that only the
    model's call moves: 4 ms a call); the progress bar hears of every iteration, warm-up first."""
    clock, seen = _Clock(), []

    def call(net, inputs):
        clock.now += 0.004
        return net(*inputs)

    class Recorder:
        def __init__(self, label, total, mode):
            seen.append((label, total, mode))

        def update(self, done):
            seen.append(done)

        def close(self):
            seen.append("closed")

    torch_linear = _models.load("mlp").model[0]
    monkeypatch.setattr(_models, "load", lambda spec, batch, seed: _models.Workload(
        spec, torch_linear, (torch.ones(batch, 256),), call))
    monkeypatch.setattr(_bench.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(_bench, "_ProgressBar", Recorder)
    row = _bench.measure(_childrun.REFERENCE, "mlp", batch=2, warmup=2, iters=3, dtype="float32",
                         seed=0, progress="always")
    assert (len(row["warmup_ms"]), len(row["latencies_ms"])) == (2, 3)
    assert row["warmup_ms"] + row["latencies_ms"] == pytest.approx([4.0] * 5, rel=1e-9)
    assert seen == [("torch-cpu", 5, "always"), 1, 2, 3, 4, 5, "closed"]
    assert row["output_checksum"] == pytest.approx(float(torch_linear(torch.ones(2, 256)).detach().double().sum()))


class _Report:
    def __init__(self, calls, fallback_calls, fallback_seconds):
        self._calls = {None: calls, "fallback": fallback_calls}
        self.fallback_seconds, self.fallback_ops = fallback_seconds, ["aten::gelu"]

    def calls(self, route=None):
        return self._calls[route]


@device_mode_only
@pytest.mark.parametrize("report, kernels, shares", [
    (_Report(40, 10, 0.003), [0.5, 0.506], (0.25, 0.25, 0.5)),
    (_Report(0, 0, 0.0), [0.0, 0.0], (0.0, 0.0, 0.0)),
    (_Report(8, 8, 0.5), [0.0, 0.5], (1.0, 1.0, 1.0))])   # more than the measured time: 1
def test_the_shares_are_of_the_measured_time(monkeypatch, report, kernels, shares):
    """3 iterations of 4 ms (a fake clock the model's call moves): the fallback's and the
    kernels' seconds are shares of those 12 ms; the fallback calls a share of all calls."""
    clock = _Clock()

    def call(net, inputs):
        clock.now += 0.004
        return net(*inputs)

    monkeypatch.setattr(_models, "load", lambda spec, batch, seed: _models.Workload(
        spec, torch.nn.Linear(4, 2), (torch.ones(batch, 4),), call))
    monkeypatch.setattr(_bench.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(_bench, "_kernel_seconds", iter(kernels).__next__)
    monkeypatch.setattr(_bench.flagos, "fallback_report", lambda: report)
    row = _bench.measure(CHIP, "mine", batch=1, warmup=1, iters=3, dtype="float32", seed=0)
    assert row["latencies_ms"] == pytest.approx([4.0] * 3, rel=1e-9)
    fallback = row["fallback"]
    assert (fallback["calls"], fallback["fallback_calls"], fallback["ops"]) == \
        (report.calls(), report.calls("fallback"), ["aten::gelu"])
    assert (fallback["call_share"], fallback["time_share"], row["kernel_time_share"]) == \
        pytest.approx(shares, rel=1e-9, abs=1e-12)


def test_the_chart_draws_each_chips_latencies_spread_and_ratio(monkeypatch, tmp_path):
    """What the PNG shows, read from the figure before it is closed: one line per chip that
    ran, its median as a bar with whiskers from the fastest run to p90, the ratio above it."""
    kept, close = [], pyplot.close
    monkeypatch.setattr(pyplot, "close", kept.append)
    _bench.plot(_data(), str(tmp_path / "chart.png"))
    (fig,) = kept
    lines, bars = fig.axes
    assert [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in lines.lines] == \
        [("torch-cpu", [1], [2.0]), ("cpu", [1, 2, 3], [1.0, 2.0, 3.0])]   # the failed chip: none
    assert (lines.get_xlabel(), lines.get_ylabel(), lines.get_title()) == \
        ("iteration", "latency (ms)", "per-iteration latency")
    assert [t.get_text() for t in lines.get_legend().get_texts()] == ["torch-cpu", "cpu"]
    assert [bar.get_height() for bar in bars.patches] == [2.0, 2.0]
    (whiskers,) = bars.collections
    assert [[tuple(p) for p in segment] for segment in whiskers.get_segments()] == \
        [[(0.0, 2.0), (0.0, 2.0)], [(1.0, 1.0), (1.0, pytest.approx(2.8))]]
    assert [(t.get_text(), tuple(t.xy)) for t in bars.texts] == \
        [("1.00x", (0, 2.0)), ("1.50x", (1, pytest.approx(2.8)))]
    assert (bars.get_ylabel(), bars.get_title()) == ("p50 latency (ms), bars min to p90", "ratio vs torch-cpu")
    assert fig.get_suptitle() == "flagos bench mlp (batch 2, float16)"
    close(fig)

"""Measure a model's latency on several chips, each in its own process.

    flagos bench bert --chips torch-cpu,cpu,sim --iters 50
    flagos bench my_model.py:build --chips torch-cpu,sim --dtype float16 --json out.json

MODEL is a built-in workload (mlp, cnn, bert, unet, ddpm: small configs, seeded random weights)
or `path.py:function` returning (model, inputs). The chip `torch-cpu` is plain PyTorch on the CPU
without flagos, the native reference; the ratio column divides each chip's median latency by the
first chip's. Warm-up iterations are timed apart from the measured ones; the device is
synchronized after every iteration. On a C-ABI chip (sim, opencl) the "kernel time" column is
the share of the measured time spent inside the adapter's kernels (for an asynchronous chip,
their launches): the rest is flagos's path, the fallbacks and the host's Python. Exit codes: 0
every chip ran, 1 a chip failed, 2 usage.
"""
from __future__ import annotations

import math
import statistics
import sys
import time

import torch

import flagos

from ..chips.adapter import AdapterChip
from ..core import _state
from . import _childrun, _models
from ._common import format_bytes, format_table, non_negative_int, positive_int, write_json

DEFAULT_CHIPS = (_childrun.REFERENCE, "auto")
_PROGRESS = ("auto", "always", "never")


def add_arguments(parser) -> None:
    parser.add_argument("model", help="mlp, cnn, bert, unet, ddpm, or path/to/file.py:function")
    parser.add_argument("--chips", default=",".join(DEFAULT_CHIPS),
                        help="comma-separated chips to measure, the first is the ratio's base "
                             "(default: %(default)s; torch-cpu is plain PyTorch without flagos)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("--warmup", type=non_negative_int, default=3,
                        help="iterations before measuring, timed and reported apart (default 3)")
    parser.add_argument("--iters", type=positive_int, default=20,
                        help="measured iterations (default 20)")
    parser.add_argument("--dtype", default="float32",
                        help="float32, float16, bfloat16 or float64 (default float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs")
    parser.add_argument("--compile", action="store_true",
                        help="measure the model under torch.compile (compiled during the "
                             "warm-up, which then needs at least one iteration)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    parser.add_argument("--progress", choices=_PROGRESS, default="auto",
                        help="progress bar on stderr: auto (a terminal and a run over 1 s), "
                             "always, never")


# ---- the measurement, inside the process that runs the chip ------------------------------

class _ProgressBar:
    """A one-line bar on stderr, drawn at most ten times a second; in "auto" only on a
    terminal and only once the run has taken a second, so short runs print nothing."""

    def __init__(self, label: str, total: int, mode: str):
        self.label, self.total, self.mode = label, total, mode
        self.start = self.last = time.perf_counter()
        self.drawn = False

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if self.mode == "never" or (now - self.last < 0.1 and done < self.total):
            return
        if self.mode == "auto" and (not sys.stderr.isatty() or now - self.start < 1.0):
            return
        self.last, self.drawn = now, True
        filled = int(30 * done / self.total)
        sys.stderr.write(f"\r{self.label:<12} [{'#' * filled}{'.' * (30 - filled)}] "
                         f"{done}/{self.total} {now - self.start:6.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters  # only under --compile: Dynamo is heavy to import
    return int(counters["stats"]["unique_graphs"])


def _kernel_seconds() -> float | None:
    """Seconds inside the active adapter's kernels so far; None on a chip without an adapter."""
    state = _state.active_or_none()
    if state is None or not isinstance(state.chip, AdapterChip):
        return None
    return sum(seconds for _, _, seconds in state.chip.adapter.kernel_times())


def measure(chip: str, model: str, batch: int, warmup: int, iters: int, dtype: str,
            seed: int, progress: str = "never", compile: bool = False) -> dict:
    """Run one chip's measurement (in the process where flagos is active on `chip`)."""
    device = _childrun.device_for(chip)
    name = _childrun.chip_name(chip)
    work = _models.load(model, batch, seed)
    net = _models.cast_model(work.model, device, _models.parse_dtype(dtype))
    inputs = _models.move(work.inputs, device, _models.parse_dtype(dtype))
    if compile:  # the same Inductor on every chip; the first warm-up iteration compiles
        net = torch.compile(net)
    on_flagos = chip != _childrun.REFERENCE
    bar = _ProgressBar(name, warmup + iters, progress)

    outputs = []

    def step() -> float:
        start = time.perf_counter()
        outputs[:] = [work.call(net, inputs)]
        _childrun.synchronize(chip)
        return (time.perf_counter() - start) * 1e3

    with torch.no_grad():
        warm = []
        for i in range(warmup):
            warm.append(step())
            bar.update(i + 1)
        _childrun.reset_peak_memory(chip)
        if on_flagos:
            flagos.reset_report()
        kernels_before = _kernel_seconds() if on_flagos else None
        latencies = []
        for i in range(iters):
            latencies.append(step())
            bar.update(warmup + i + 1)
        kernel_seconds = None if kernels_before is None else _kernel_seconds() - kernels_before
    bar.close()
    result = {"chip": name, "device": str(device), "mode": _childrun.mode(chip),
              "warmup_ms": warm, "latencies_ms": latencies,
              "peak_memory_bytes": _childrun.peak_memory(chip), "fallback": None,
              # graphs Dynamo compiled in this process: the proof the run was compiled
              "compiled_graphs": _compiled_graphs() if compile else None,
              "kernel_time_share": (None if kernel_seconds is None
                                    else min(1.0, kernel_seconds / (sum(latencies) / 1e3)))}
    if on_flagos:
        report = flagos.fallback_report()
        calls, fallback_calls = report.calls(), report.calls("fallback")
        # time share against the measured iterations, not the report's own span
        result["fallback"] = {
            "calls": calls, "fallback_calls": fallback_calls,
            "call_share": fallback_calls / calls if calls else 0.0,
            "time_share": min(1.0, report.fallback_seconds / (sum(latencies) / 1e3)),
            "ops": report.fallback_ops}
    # the sum of the last output (after the report: its ops are not the model's): equal across
    # chips, to rounding, when they computed the same thing
    result["output_checksum"] = sum(float(t.detach().to("cpu", torch.float64).sum())
                                    for t in _models.output_tensors(outputs[0])
                                    if not t.is_complex())
    return result


# ---- statistics and the whole run --------------------------------------------------------

def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def summarize(latencies_ms: list[float], batch: int) -> dict:
    values = sorted(latencies_ms)
    return {
        "min_ms": values[0], "p50_ms": _percentile(values, 0.5),
        "p90_ms": _percentile(values, 0.9), "p99_ms": _percentile(values, 0.99),
        "mean_ms": statistics.fmean(values),
        "std_ms": statistics.stdev(values) if len(values) > 1 else 0.0,
        "max_ms": values[-1],
        "throughput_per_s": batch * len(values) / (sum(values) / 1e3),
    }


def bench(model: str, chips=DEFAULT_CHIPS, batch: int = 1, warmup: int = 3, iters: int = 20,
          dtype: str = "float32", seed: int = 0, progress: str = "never",
          compile: bool = False) -> dict:
    """Measure `model` on each chip (each in its own process unless it can run here).

    Returns {"model", "batch", "dtype", "warmup", "iters", "base", "results": [per chip]};
    a chip that failed has "error" instead of measurements. ValueError for bad arguments.
    """
    if isinstance(chips, str):
        chips = [c for c in chips.split(",") if c.strip()]
    chips = [_childrun.check_chip(c) for c in chips]
    if not chips:
        raise ValueError("no chips given; example: --chips torch-cpu,cpu,sim")
    _models.check_spec(model)
    _models.parse_dtype(dtype)
    if batch < 1 or iters < 1 or warmup < 0:
        raise ValueError("batch and iters must be at least 1, warmup at least 0")
    if compile and warmup < 1:
        raise ValueError("--compile needs at least one warm-up iteration (--warmup 1 or more): "
                         "compiling happens in the first call and is not a latency")
    results = []
    for chip in chips:
        try:
            row = _childrun.call(chip, f"{__name__}:measure", model=model, batch=batch,
                                 warmup=warmup, iters=iters, dtype=dtype, seed=seed,
                                 progress=progress, compile=compile)
            row.update(summarize(row["latencies_ms"], batch))
        except _childrun.ChildError as e:
            row = {"chip": chip, "error": str(e)}
        row["requested"] = chip
        results.append(row)
    base = results[0]
    for row in results:
        ok = "error" not in row and "error" not in base
        row["ratio"] = row["p50_ms"] / base["p50_ms"] if ok else None
        row["ratio_mean"] = row["mean_ms"] / base["mean_ms"] if ok else None
    return {"model": model, "batch": batch, "dtype": dtype, "warmup": warmup, "iters": iters,
            "seed": seed, "compile": compile, "torch": torch.__version__, "base": base["chip"], "results": results}


# ---- output ------------------------------------------------------------------------------

def _share(row, key) -> str:
    return "-" if not row.get("fallback") else f"{100 * row['fallback'][key]:.1f}%"


def format_results(data: dict) -> str:
    headers = ["chip", "min ms", "p50 ms", "p90 ms", "p99 ms", "mean ms", "std ms", "samples/s",
               "peak mem", "fallback calls", "fallback time", "kernel time",
               f"ratio vs {data['base']}"]
    rows, errors = [], []
    for r in data["results"]:
        if "error" in r:
            rows.append([r["chip"]] + ["failed"] + ["-"] * (len(headers) - 2))
            errors.append(r["error"])
            continue
        rows.append([r["chip"]] + [f"{r[k]:.3f}" for k in
                                   ("min_ms", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "std_ms")]
                    + [f"{r['throughput_per_s']:.1f}", format_bytes(r["peak_memory_bytes"]),
                       _share(r, "call_share"), _share(r, "time_share"),
                       "-" if r.get("kernel_time_share") is None
                       else f"{100 * r['kernel_time_share']:.1f}%",
                       "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"])
    compiled = ", torch.compile" if data.get("compile") else ""
    head = (f"bench {data['model']}{compiled}: batch {data['batch']}, {data['dtype']}, "
            f"{data['warmup']} warm-up + {data['iters']} measured iterations")
    return "\n".join([head, "", format_table(headers, rows), *(f"error: {e}" for e in errors)])


def check_plot_available() -> str | None:
    """None when matplotlib can draw, else the message that names the fix."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed: "
                "pip install 'flagos[plot]' (or pip install matplotlib)")
    return None


def plot(data: dict, path: str) -> None:
    """A PNG: per-iteration latency of each chip, and its median with the p10-p90 band."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    ok = [r for r in data["results"] if "error" not in r]
    fig, (lines, bars) = plt.subplots(1, 2, figsize=(11, 4))
    for r in ok:
        lines.plot(range(1, len(r["latencies_ms"]) + 1), r["latencies_ms"], label=r["chip"])
    lines.set_xlabel("iteration")
    lines.set_ylabel("latency (ms)")
    lines.set_title("per-iteration latency")
    lines.legend()
    names = [r["chip"] for r in ok]
    bars.bar(names, [r["p50_ms"] for r in ok], color="tab:blue")
    bars.errorbar(names, [r["p50_ms"] for r in ok],
                  yerr=[[r["p50_ms"] - r["min_ms"] for r in ok],
                        [r["p90_ms"] - r["p50_ms"] for r in ok]], fmt="none", ecolor="black")
    for x, r in enumerate(ok):
        if r["ratio"] is not None:
            bars.annotate(f"{r['ratio']:.2f}x", (x, r["p90_ms"]), ha="center", va="bottom")
    bars.set_ylabel("p50 latency (ms), bars min to p90")
    bars.set_title(f"ratio vs {data['base']}")
    fig.suptitle(f"flagos bench {data['model']} (batch {data['batch']}, {data['dtype']})")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def run(args) -> int:
    if args.plot:
        missing = check_plot_available()
        if missing:
            print(f"flagos bench: {missing}", file=sys.stderr)
            return 2
    try:
        data = bench(args.model, args.chips, batch=args.batch, warmup=args.warmup,
                     iters=args.iters, dtype=args.dtype, seed=args.seed, progress=args.progress,
                     compile=args.compile)
    except ValueError as e:
        print(f"flagos bench: {e}", file=sys.stderr)
        return 2
    if args.json != "-":
        print(format_results(data))
    if args.json:
        write_json(data, args.json)
    if args.plot:
        plot(data, args.plot)
        if args.json != "-":
            print(f"chart written to {args.plot}")
    return 1 if any("error" in r for r in data["results"]) else 0

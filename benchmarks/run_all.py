"""Every benchmark in one command: one JSON, a markdown table and PNG plots.

    python benchmarks/run_all.py [--out benchmarks/results] [--only NAME,...] [--chips cpu,sim]
                                 [--compile] [--quick]

Runs each script of this folder (each in its own process, `--json` to a scratch file) and
`flagos bench` for mlp, bert, unet and ddpm on torch-cpu (plain PyTorch) and each chip of
`--chips` (default cpu,sim; add opencl where its adapter is built), and writes into --out:

    results.json   every figure, with the machine, torch version, threads and load average of
                   each run (the load is read before and after each script)
    results.md     the tables benchmarks/README.md embeds
    overhead.png   per-op overhead over native, flagos beside the floor, per chip
    models.png     flagos / native time ratios of whole models (eager; compiled: the `compile`
                   piece, and flagos bench with --compile)
    fallback.png   the fallback's efficiency (ideal host round trip / fallback time) by size

`--quick` runs every piece with few iterations: to check the pipeline, not to quote figures.
Names for --only: dispatch, models, compile, fallback, autoload, redirect, bench (`compile` is
benchmarks/compile_overhead.py: the per-call cost of compiled graphs over flagos tensors).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import environment  # noqa: E402

CHIPS = ("cpu", "sim")
BENCH_MODELS = ("mlp", "bert", "unet", "ddpm")


def _jobs(quick: bool, compile: bool, chips=CHIPS) -> list[tuple[str, str, list[str]]]:
    """(piece, label, command) for every run, in order. model_overhead and compile_overhead
    measure the cpu chip (torch-native, device mode) whatever the chips."""
    few = quick
    jobs = []
    for chip in chips:
        jobs.append(("dispatch", f"dispatch_overhead {chip}",
                     ["dispatch_overhead.py", "--chip", chip]
                     + (["--number", "100", "--repeat", "3"] if few else [])))
    jobs.append(("models", "model_overhead cpu",
                 ["model_overhead.py", "--chip", "cpu"] + (["--repeat", "1", "--number", "1"] if few else [])))
    jobs.append(("compile", "compile_overhead cpu",
                 ["compile_overhead.py", "--chip", "cpu"] + (["--repeat", "3", "--number", "2"] if few else [])))
    for chip in chips:
        jobs.append(("fallback", f"fallback_cost {chip}",
                     ["fallback_cost.py", "--chip", chip] + (["--repeat", "2"] if few else [])))
    jobs.append(("autoload", "autoload_cost", ["autoload_cost.py"] + (["--repeat", "2"] if few else [])))
    jobs.append(("redirect", "redirect_overhead",
                 ["redirect_overhead.py"] + (["--number", "100", "--repeat", "2"] if few else [])))
    iters = ["--warmup", "1", "--iters", "2"] if few else ["--warmup", "3", "--iters", "20"]
    for model in BENCH_MODELS:
        for compiled in (False, True) if compile else (False,):
            jobs.append(("bench", f"bench {model}" + (" compiled" if compiled else ""),
                         ["-m", "flagos", "bench", model, "--chips", ",".join(("torch-cpu", *chips)), *iters,
                          "--progress", "never"] + (["--compile"] if compiled else [])))
    return jobs


def _run(label: str, command: list[str], scratch: str) -> dict:
    out = os.path.join(scratch, label.replace(" ", "_") + ".json")
    script = command[0] != "-m"
    argv = [sys.executable, os.path.join(HERE, command[0]), *command[1:]] if script else [sys.executable, *command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    # this checkout's flagos, installed or not
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
    before = environment()
    print(f"== {label}", flush=True)
    proc = subprocess.run([*argv, "--json", out], env=env, capture_output=True, text=True)
    after = environment()
    entry = {"label": label, "command": " ".join(["python", *([f"benchmarks/{command[0]}"] if script else command[:1]), *command[1:]]),
             "returncode": proc.returncode, "load_average_before": before["load_average"],
             "load_average_after": after["load_average"]}
    if proc.returncode != 0 or not os.path.exists(out):
        entry["error"] = (proc.stdout + proc.stderr)[-2000:]
        print(f"   failed (exit {proc.returncode}):\n{entry['error']}", flush=True)
        return entry
    with open(out) as f:
        entry["data"] = json.load(f)
    return entry


# ---- the tables --------------------------------------------------------------------------

def _with_floor(value: float, floor: float | None, fmt: str) -> str:
    """A figure, and the floor's own figure for the same op beside it where it was measured."""
    return fmt.format(value) + ("" if floor is None else f" ({fmt.format(floor)})")


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(r) + " |" for r in rows)]


def markdown(run: dict) -> str:
    env = run["environment"]
    lines = [f"Measured {env['utc']} UTC on {env['machine']}; load average at the start "
             f"{', '.join(f'{x:.2f}' for x in env['load_average'] or [])}.", ""]
    by_piece: dict[str, list[dict]] = {}
    for entry in run["runs"]:
        by_piece.setdefault(entry["label"].split()[0], []).append(entry)
    ok = [e for e in run["runs"] if "data" in e]

    dispatch = [e for e in ok if e["label"].startswith("dispatch_overhead")]
    if dispatch:
        lines += ["### Per-op overhead (µs over native, median; floor = trivial C-dispatch wrapper, "
                  "in brackets the floor's figure for the same op)", ""]
        rows = []
        for e in dispatch:
            r = e["data"]["results"]
            small = r["small_ops"]
            floor = r["floor_median_overhead_us"]
            real = r["realistic_ops"]
            less_kernel = r.get("median_overhead_less_kernel_us")
            has_kernels = any(v.get("kernel_us") for v in small.values())
            rows.append([r["chip"], f"{r['median_overhead_us']:.2f}",
                         f"{less_kernel:.2f}" if has_kernels and less_kernel is not None else "-",
                         "-" if floor is None else f"{floor:.2f}",
                         f"{small['add']['flagos_us'] - small['add']['native_us']:.2f}",
                         _with_floor(small["layer_norm"]["flagos_us"] - small["layer_norm"]["native_us"],
                                     None if small["layer_norm"]["floor_us"] is None else
                                     small["layer_norm"]["floor_us"] - small["layer_norm"]["native_us"], "{:.2f}"),
                         *(_with_floor(v.get("overhead_us", v["flagos_us"] - v["native_us"]),
                                       v.get("floor_overhead_us"), "{:+.1f}") for v in real.values())])
        names = list(dispatch[0]["data"]["results"]["realistic_ops"])
        lines += _table(["chip", "median small op", "less the adapter's kernels", "floor", "add", "layer_norm",
                         *names], rows) + [""]
    models = [e for e in ok if e["label"].startswith("model_overhead")]
    if models:
        lines += ["### Whole models, eager (flagos / native time, median; floor: the same model "
                  "behind the trivial C-dispatch wrapper)", ""]
        for e in models:
            r = e["data"]["results"]
            lines += _table(["model", "native ms", "flagos ms", "ratio", "floor (paired)"],
                            [[k, f"{v['native_ms']:.2f}", f"{v['flagos_ms']:.2f}", f"{v['ratio']:.2f}",
                              "-" if v.get("floor_ratio") is None else f"{v['floor_ratio']:.2f}"]
                             for k, v in r["models"].items()]) + [f"(chip {r['chip']})", ""]
    compiled = [e for e in ok if e["label"].startswith("compile_overhead")]
    if compiled:
        lines += ["### Whole models under torch.compile (flagos / native time, median; paired: "
                  "the median of each run's ratio; floor: a trivial traceable wrapper subclass, "
                  "paired likewise)", ""]
        for e in compiled:
            r = e["data"]["results"]
            rows = []
            for k, v in r["models"].items():
                same = v["dynamo_native"] == v["dynamo_flagos"] and not any(v["compiled_while_timing"].values())
                floor = v.get("floor_paired_ratio")
                rows.append([k, f"{v['native_ms']:.2f}", f"{v['flagos_ms']:.2f}", f"{v['ratio']:.2f}",
                             f"{v['paired_ratio']:.2f}", "-" if floor is None else f"{floor:.2f}",
                             "same" if same else
                             f"native {v['dynamo_native']}, flagos {v['dynamo_flagos']}, "
                             f"while timing {v['compiled_while_timing']}"])
            lines += _table(["model", "native ms", "flagos ms", "ratio", "paired", "floor (paired)",
                             "graphs, recompiles, breaks"],
                            rows) + [f"(chip {r['chip']}, compile mode {r['compile_mode']}, "
                                     f"{r['threads']} thread(s))", ""]
    fallback = [e for e in ok if e["label"].startswith("fallback_cost")]
    if fallback:
        lines += ["### Fallback round trip (efficiency = host copy in + op + copy out, by hand / fallback time)", ""]
        rows = []
        for e in fallback:
            r = e["data"]["results"]
            for size, v in r["sizes"].items():
                eff = v["efficiency"]
                ceiling = v.get("ceiling")
                rows.append([r["chip"], size, f"{v['host_copy_mb_s']:.0f}", f"{v['fallback_us']['median']:.1f}",
                             f"{eff['min']:.2f} / {eff['median']:.2f} / {eff['max']:.2f}",
                             "-" if ceiling is None else f"{ceiling['median']:.2f}"])
        lines += _table(["chip", "size", "host copy MB/s", "fallback µs", "efficiency min / median / max",
                         "ceiling (the floor's)"], rows) + [""]
    benches = [e for e in ok if e["label"].startswith("bench")]
    if benches:
        lines += ["### flagos bench (p50 ms; ratio vs plain PyTorch; on a C-ABI chip the share of "
                  "its time inside the adapter's kernels)", ""]
        rows = []
        for e in benches:
            d = e["data"]
            cells = [e["label"].split(" ", 1)[1]]
            for r in d["results"]:
                share = r.get("kernel_time_share")
                cells.append("failed" if "error" in r else f"{r['p50_ms']:.2f} ({r['ratio']:.2f}x"
                             + ("" if share is None else f"; kernels {100 * share:.0f}%") + ")")
            rows.append(cells)
        lines += _table(["model", *(r.get("requested", r["chip"]) for r in benches[0]["data"]["results"])],
                        rows) + [""]
    for name in ("autoload_cost", "redirect_overhead"):
        for e in ok:
            if e["label"] == name:
                lines += [f"### {name}", "", "```json", json.dumps(e["data"]["results"], indent=1), "```", ""]
    failed = [e for e in run["runs"] if "error" in e]
    if failed:
        lines += ["### Failed runs", ""] + [f"- {e['label']}: exit {e['returncode']}" for e in failed] + [""]
    return "\n".join(lines)


# ---- the plots ---------------------------------------------------------------------------

def plots(run: dict, out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ok = [e for e in run["runs"] if "data" in e]
    dispatch = [e["data"]["results"] for e in ok if e["label"].startswith("dispatch_overhead")]
    if dispatch:
        fig, ax = plt.subplots(figsize=(10, 4))
        ops = list(dispatch[0]["small_ops"])
        width = 0.8 / (len(dispatch) + 1)
        for i, r in enumerate(dispatch):
            ax.bar([x + i * width for x in range(len(ops))],
                   [r["small_ops"][o]["flagos_us"] - r["small_ops"][o]["native_us"] for o in ops],
                   width, label=f"flagos, {r['chip']} chip")
        first = dispatch[0]["small_ops"]   # the floor is chip-independent: the first run's
        floor = [first[o]["floor_us"] - first[o]["native_us"] if first[o]["floor_us"] is not None else 0
                 for o in ops]
        ax.bar([x + len(dispatch) * width for x in range(len(ops))], floor, width, label="floor", color="grey")
        ax.set_xticks([x + width for x in range(len(ops))], ops)
        ax.set_ylabel("µs over native per op (median)")
        ax.set_title("per-op overhead, 8x8 float32, one thread")
        ax.legend()
        written.append(_save(fig, plt, out, "overhead.png"))
    ratios = []
    for e in ok:
        if e["label"].startswith("model_overhead"):
            ratios += [(f"{k} (eager)", v["ratio"]) for k, v in e["data"]["results"]["models"].items()]
        if e["label"].startswith("compile_overhead"):
            ratios += [(f"{k} (compiled)", v["paired_ratio"]) for k, v in e["data"]["results"]["models"].items()]
        if e["label"].startswith("bench"):
            for r in e["data"]["results"][1:]:
                if r.get("ratio") is not None:
                    ratios.append((f"{e['label'][6:]} {r['chip']}", r["ratio"]))
    if ratios:
        fig, ax = plt.subplots(figsize=(10, max(3, 0.3 * len(ratios))))
        ax.barh([k for k, _ in ratios], [v for _, v in ratios])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("flagos / native time (1.0 = native)")
        ax.set_title("whole models")
        written.append(_save(fig, plt, out, "models.png"))
    fallback = [e["data"]["results"] for e in ok if e["label"].startswith("fallback_cost")]
    if fallback:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in fallback:
            sizes = list(r["sizes"])
            med = [r["sizes"][s]["efficiency"]["median"] for s in sizes]
            low = [m - r["sizes"][s]["efficiency"]["min"] for m, s in zip(med, sizes)]
            high = [r["sizes"][s]["efficiency"]["max"] - m for m, s in zip(med, sizes)]
            ax.errorbar(sizes, med, yerr=[low, high], marker="o", capsize=4, label=f"{r['chip']} chip")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("efficiency (by hand / fallback)")
        ax.set_title("fallback round trip vs host copies")
        ax.legend()
        written.append(_save(fig, plt, out, "fallback.png"))
    return written


def _save(fig, plt, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the results")
    p.add_argument("--only", default="", help="comma-separated pieces to run (default: all)")
    p.add_argument("--chips", default=",".join(CHIPS),
                   help="chips for the per-op, fallback and bench pieces (default: cpu,sim; e.g. cpu,sim,opencl)")
    p.add_argument("--compile", action="store_true", help="also run flagos bench under torch.compile")
    p.add_argument("--quick", action="store_true", help="few iterations: checks the pipeline only")
    args = p.parse_args(argv)
    pieces = {"dispatch", "models", "compile", "fallback", "autoload", "redirect", "bench"}
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if only - pieces:
        p.error(f"unknown piece(s) {', '.join(sorted(only - pieces))}; choose from {', '.join(sorted(pieces))}")
    chips = tuple(c.strip() for c in args.chips.split(",") if c.strip())
    if not chips or "torch-cpu" in chips:
        p.error("--chips takes flagos chips (torch-cpu, the reference, is always run by bench)")
    os.makedirs(args.out, exist_ok=True)
    run = {"environment": environment(), "quick": args.quick, "chips": list(chips), "runs": []}
    with tempfile.TemporaryDirectory() as scratch:
        for piece, label, command in _jobs(args.quick, args.compile, chips):
            if not only or piece in only:
                run["runs"].append(_run(label, command, scratch))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(run, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown(run) + "\n")
    written = plots(run, args.out)
    print(f"written: {', '.join(['results.json', 'results.md', *map(os.path.basename, written)])} in {args.out}")
    return 1 if any("error" in e for e in run["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())

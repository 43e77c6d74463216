"""The conformance sweep: PyTorch's OpInfo database on the flagos device against plain CPU.

    python tests/conformance/run.py                       # everything: cpu, sim and opencl, all dtypes
    python tests/conformance/run.py --ops 'add,nn.functional.conv*' --chips sim
    python tests/conformance/run.py --write-doc docs/conformance.md

Prints the table and the unexpected failures; exits 1 on a failing case that is not in
expected_failures.py, and on a listed pattern that now passes (remove it: the list shrinks).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import fnmatch
import json
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import runner  # noqa: E402

from flagos import chips as flagos_chips  # noqa: E402

OUTCOMES = ("pass", "mismatch", "stride", "error", "crash", "skip")


def select(op_filter, dtypes, directions):
    """[(op key, dtype, direction)] in op_db order; op_filter: comma-separated globs."""
    pats = [p for p in (op_filter or "").split(",") if p]
    out = []
    for key, op in harness.ops().items():
        if pats and not any(fnmatch.fnmatchcase(key, p) for p in pats):
            continue
        out.extend((key, d, direction) for d, direction in harness.cases(op, dtypes, directions))
    return out


def table(results, chips, dtypes):
    """Markdown table: outcome counts per chip, dtype and direction."""
    counts = collections.Counter()
    for key, r in results.items():
        chip, _, dtype, direction = key.split(":")
        counts[(chip, dtype, direction, r["outcome"])] += 1
    rows = ["| chip | dtype | direction | " + " | ".join(OUTCOMES) + " |",
            "|---|---|---|" + "---:|" * len(OUTCOMES)]
    for chip in chips:
        for dtype in dtypes:
            for direction in ("fwd", "bwd", "inf"):
                n = [counts[(chip, dtype, direction, o)] for o in OUTCOMES]
                if sum(n):
                    rows.append(f"| {chip} | {dtype} | {direction} | " + " | ".join(map(str, n)) + " |")
    return "\n".join(rows)


def default_chips() -> str:
    """cpu and sim everywhere; opencl too where its adapter was built and finds a device."""
    return "cpu,sim,opencl" if flagos_chips.profile("opencl").detect() else "cpu,sim"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chips", default=default_chips())
    ap.add_argument("--dtypes", default=",".join(harness.DTYPES))
    ap.add_argument("--directions", default="fwd,bwd,inf")
    ap.add_argument("--ops", default="", help="comma-separated globs over op[.variant] names")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--results", default="", help="write every case's result here (JSON lines)")
    ap.add_argument("--write-doc", default="", help="write the table and failures to this markdown file")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)

    chips = args.chips.split(",")
    dtypes = [d for d in args.dtypes.split(",") if d]
    cases = select(args.ops, dtypes, args.directions.split(","))
    expected = runner.load_expected()
    sink = open(args.results, "w") if args.results else None
    results = {}
    start = time.time()

    def on_result(key, r):
        if sink:
            sink.write(json.dumps({"case": key, **r}) + "\n")
            sink.flush()
        if not args.quiet and r["outcome"] not in ("pass", "skip"):
            tag = "expected" if runner.cause_of(key, expected) else "UNEXPECTED"
            print(f"{tag} {r['outcome']:8} {key}  {r['message'][:160]}", flush=True)

    for chip in chips:
        print(f"{chip}: {len(cases)} cases, {args.workers} workers", flush=True)
        results.update(runner.run(chip, cases, args.workers, args.timeout, on_result))
    seconds = time.time() - start
    unexpected, stale = runner.judge(results, expected, globs=not args.ops)
    if not {"cpu", "sim"} <= set(chips) or set(dtypes) != set(harness.DTYPES) \
            or set(args.directions.split(",")) != {"fwd", "bwd", "inf"}:
        stale = []  # a partial sweep cannot tell which listed patterns are stale

    print(table(results, chips, dtypes))
    print(f"{len(results)} cases in {seconds:.0f} s")
    for key in unexpected:
        print(f"unexpected {results[key]['outcome']}: {key}: {results[key]['message']}")
    for line in stale:
        print(f"tests/conformance/expected_failures.py: {line}")
    if args.write_doc:
        write_doc(args.write_doc, results, chips, dtypes, seconds, unexpected, stale, expected, argv,
                  args.workers)
    return 1 if unexpected or stale else 0


def write_doc(path, results, chips, dtypes, seconds, unexpected, stale, expected, argv,
              args_workers):
    import torch
    by_cause = collections.Counter(runner.cause_of(k, expected) for k, r in results.items()
                                   if r["outcome"] not in ("pass", "skip"))
    cmd = os.environ.get("CONFORMANCE_COMMAND") or \
        "python tests/conformance/run.py " + shlex.join(argv or sys.argv[1:])
    lines = [
        "# Conformance: PyTorch's OpInfo database on the flagos device",
        "",
        "Generated by `scripts/conformance.sh`; how the harness works and how to read this table "
        "is in the section after the numbers.",
        "",
        f"Last run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{seconds / 60:.0f} min on {os.cpu_count()} cores ({args_workers} workers per chip), "
        f"torch {torch.__version__}, {harness.MAX_SAMPLES} samples per case, command `{cmd}`.",
        "",
        table(results, chips, dtypes),
        "",
        f"{len(results)} cases. Failures by cause (expected_failures.py):",
        "",
        "| cases | cause |",
        "|---:|---|",
    ]
    for cause, n in by_cause.most_common():
        lines.append(f"| {n} | {cause or '**not listed: unexpected**'} |")
    lines += ["", f"Unexpected failures: {len(unexpected)}"]
    if unexpected:
        lines += [""] + [f"- `{k}` {results[k]['outcome']}: {results[k]['message'][:200]}"
                         for k in unexpected]
    if stale:
        lines += ["", "Listed as expected but now passing:", ""]
        lines += [f"- {line}" for line in stale]
    text = "\n".join(lines) + "\n"
    old = open(path).read() if os.path.exists(path) else ""
    marker = "\n## How it works"
    tail = old[old.index(marker):] if marker in old else ""
    with open(path, "w") as f:
        f.write(text + tail)


if __name__ == "__main__":
    sys.exit(main())

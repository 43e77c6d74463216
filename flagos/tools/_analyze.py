"""Which ops of a script fall back to the CPU: run it unchanged on a chip and print its coverage.

    flagos analyze [--chip NAME] [--target CHIP] [--json PATH] [--html PATH] -- python script.py ARGS

The command runs in a child process with flagos active on --chip (FLAGOS_DEVICE: the script
imports torch and uses "flagos" or flagos.device()) and the fallback report written at its exit
(FLAGOS_REPORT). Then: per op, the route it took (native or fallback), calls, time in the
fallback and the first call site, and the verdict "fallback share of op time X%". flagos times
fallbacks, not native kernels, so op time is counted as the run's tracked time (activation to
exit) and X is a lower bound of the fallbacks' share of the time spent in ops.

--target CHIP answers "what would fall back there" without that chip: every op seen is
classified against the target's coverage (an adapter chip's kernel table read from its
library; for torch-native chips a coverage file shipped in flagos/report/coverage/).

Exit status: the script's own (0 when it succeeded); 1 when the run gave no report; 2 usage.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .. import chips
from ..chips import names
from ..core import _env
from ..errors import ChipNotFoundError
from ..report._html import render
from ..report._sites import short_site
from ..report.coverage import ROUTES, for_chip
from ._common import format_table, write_json

EXIT_NO_REPORT, EXIT_USAGE = 1, 2


class UsageError(ValueError):
    """A bad command line: the message says what to give instead."""


def add_arguments(parser) -> None:
    parser.add_argument("--chip", metavar="NAME",
                        help="chip to run the script on (default: FLAGOS_DEVICE, else auto)")
    parser.add_argument("--target", metavar="CHIP",
                        help="also say which ops would fall back on CHIP (sim, cuda, mps, cpu, or "
                             "an adapter on FLAGOS_ADAPTER_PATH)")
    parser.add_argument("--json", metavar="PATH", help="write the analysis as JSON ('-': stdout)")
    parser.add_argument("--html", metavar="PATH", help="write the report as a self-contained HTML page")
    parser.add_argument("command", nargs="...", metavar="-- COMMAND",
                        help="the program to run, e.g. -- python train.py --epochs 1")


def _check_chip(chip: str) -> str:

    try:
        name = names.resolve(chip, chips.known()).chip  # vendor names too: "ascend" is npu
    except ChipNotFoundError as e:
        raise UsageError(str(e)) from None
    if name == "auto":
        return name
    if not chips.profile(name).detect():
        available = [n for n in chips.known() if chips.profile(n).detect()]
        raise UsageError(f"chip {name!r} is not available on this machine; available here: "
                         f"{', '.join(available)}. Use --target {name} to see what would fall "
                         f"back there without running on it.")
    return name


def _command(command) -> list[str]:
    command = list(command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("no command to analyze: give it after '--', e.g. "
                         "flagos analyze --chip sim -- python train.py")
    if command[0].endswith(".py"):  # `flagos analyze -- train.py`: this interpreter runs it
        if not os.path.isfile(command[0]):
            raise UsageError(f"no such script: {command[0]}")
        command = [sys.executable, *command]
    return command


def _read_report(path: str) -> dict | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _verdict(totals: dict, elapsed_s: float) -> str:
    return (f"fallback share of op time {100 * totals['fallback_time_share']:.1f}% "
            f"({1000 * totals['fallback_s']:.1f} ms in fallbacks of {elapsed_s:.2f} s tracked; "
            f"{totals['fallback_ops']} of {totals['ops']} ops, "
            f"{totals['calls_by_route']['fallback']} of {totals['calls']} calls)")


def _classify(analysis: dict, target: str) -> None:
    """Add each op's route on `target` and the target's totals to the analysis."""

    coverage = for_chip(target)
    calls = dict.fromkeys(ROUTES, 0)
    ops = {route: [] for route in ROUTES}
    for row in analysis["ops"]:
        route, reason = coverage.classify(row["op"], row.get("dtypes") or ())
        row["target"] = {"route": route, "reason": reason}
        calls[route] += sum(row["calls"].values())
        ops[route].append(row["op"])
    short = ", ".join(op.split("::", 1)[-1] for op in ops["fallback"][:8])
    more = f", ... ({len(ops['fallback']) - 8} more)" if len(ops["fallback"]) > 8 else ""
    verdict = (f"on {coverage.chip}: {len(ops['fallback'])} of {len(analysis['ops'])} ops would "
               f"fall back ({calls['fallback']} of {sum(calls.values())} calls)"
               + (f": {short}{more}" if ops["fallback"] else ""))
    if ops["unknown"]:
        verdict += f"; {len(ops['unknown'])} ops not in its coverage"
    analysis["target"] = {**coverage.describe(), "fallback_ops": ops["fallback"],
                          "unknown_ops": ops["unknown"], "calls_by_route": calls, "verdict": verdict}


def analyze(command, chip: str | None = None, target: str | None = None,
            stdout=None, stderr=None) -> dict:
    """Run `command` (a list, e.g. ["python", "train.py"]) on `chip` and return its analysis:
    the fallback report's data (chip, elapsed_s, totals, ops) plus command, status, verdict and,
    with `target`, each op's route on that chip. Raises UsageError for a bad chip or command,
    RuntimeError when the run gave no report. stdout/stderr: where the command's output goes
    (default: inherited)."""
    command = _command(command)
    chip = _check_chip(chip or _env.requested_device() or "auto")
    if target is not None:
        try:
            alias = names.ALIASES.get(target.strip().lower())
            target = alias.chip if alias else target  # a vendor name: "ascend" is npu
            for_chip(target)  # before the run: a bad target is a usage error, not a lost run
        except ValueError as e:
            raise UsageError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="flagos-analyze-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        env = dict(os.environ, FLAGOS_DEVICE=chip, FLAGOS_REPORT=report_path)
        env.pop("FLAGOS_DEVICE_BACKEND", None)
        env.setdefault("FLAGOS_FALLBACK", "allow")  # the table lists every fallback; no warnings
        try:
            child = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr)
        except OSError as e:
            raise UsageError(f"cannot run {command[0]!r}: {e.strerror or e}") from None
        try:
            status = child.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached the command too: it writes its report as it exits, so show that
            status = child.wait()
        report = _read_report(report_path)
    if report is None:
        if status != 0:  # it failed on its own (its error is above): no advice about flagos
            how = f"was ended by signal {-status}" if status < 0 else f"failed with exit status {status}"
            raise RuntimeError(f"{' '.join(command)} {how} before flagos wrote its report "
                               f"(see the command's error above)")
        raise RuntimeError(
            f"{' '.join(command)} exited with status {status} and left no flagos report: it must "
            f"import torch (flagos activates there on chip {chip!r}) and exit normally "
            f"(os._exit skips the report)")
    analysis = {"command": command, "status": status, **report}
    analysis["verdict"] = _verdict(report["totals"], report["elapsed_s"])
    analysis["target"] = None
    if target is not None:
        _classify(analysis, target)
    return analysis


def coverage_table(analysis: dict) -> str:
    """The per-op table: ops that fell back first (most time first), then by calls."""

    target = analysis.get("target")
    headers = ["op", "route", "calls", "fallback calls", "fallback ms", "first call site"]
    if target:
        headers.append(f"on {target['chip']}")
    rows = []
    ordered = sorted(analysis["ops"], key=lambda r: (-r["fallback_ns"], -r["calls"]["fallback"],
                                                     -sum(r["calls"].values()), r["op"]))
    for r in ordered:
        c = r["calls"]
        row = [r["op"], "/".join(k for k in ("override", "native", "fallback") if c[k]),
               sum(c.values()), c["fallback"], f"{r['fallback_ns'] / 1e6:.2f}", short_site(r["site"])]
        if target:
            row.append(r["target"]["route"])
        rows.append(row)
    return format_table(headers, rows)


def run(args) -> int:
    to_stdout = args.json == "-"
    try:
        # JSON on stdout: the script's own output goes to stderr so stdout stays parseable
        analysis = analyze(args.command, chip=args.chip, target=args.target,
                           stdout=sys.stderr if to_stdout else None)
    except UsageError as e:
        print(f"flagos analyze: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RuntimeError as e:
        print(f"flagos analyze: {e}", file=sys.stderr)
        return EXIT_NO_REPORT
    out = sys.stderr if to_stdout else sys.stdout
    status = analysis["status"]
    ended = f"ended by signal {-status}" if status < 0 else f"exit status {status}"
    print(f"\nflagos analyze: {' '.join(analysis['command'])} on chip {analysis['chip']} ({ended})",
          file=out)
    print(coverage_table(analysis), file=out)
    print(f"verdict: {analysis['verdict']}", file=out)
    if analysis["target"]:
        print(f"target: {analysis['target']['verdict']}", file=out)
    try:
        if args.json:
            write_json(analysis, args.json)
        if args.html:
            with open(args.html, "w") as f:
                f.write(render(analysis))
            print(f"report page: {args.html}", file=out)
    except OSError as e:
        print(f"flagos analyze: cannot write {e.filename}: {e.strerror}; give a writable path",
              file=sys.stderr)
        return EXIT_NO_REPORT
    return 128 - status if status < 0 else status  # ended by signal N: 128+N, as shells say

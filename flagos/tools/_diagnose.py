"""Is this machine ready for flagos? Chips, adapters, smoke tests, a verdict.

Versions, every chip and adapter with its status and the reason, the devices, the adapter
search path, the environment, a smoke test on each available chip, a one-line verdict, and a
block to paste into a bug report.

Every chip flagos knows is listed: available, unavailable (package missing, driver missing,
not built into this PyTorch, no devices) or broken (ABI mismatch, missing symbol, load error,
init failed); the smoke test (allocate, copy round trip, a matmul compared with CPU, float16
and bfloat16) runs on each available chip in its own process.

exit status: 0 ready (warnings allowed), 1 a check failed (a broken chip or adapter, a failed
smoke test, an invalid FLAGOS_* value, or --chip names a chip that is not available),
2 usage error (--chip names a chip flagos does not know).
"""
from __future__ import annotations

import sys
import time

from ..chips import names as chip_names
from ..errors import ChipNotFoundError
from ..report import _probe
from . import _smoke
from ._common import format_bytes, write_json

_MARK = {"OK": "[OK]  ", "WARN": "[WARN]", "FAIL": "[FAIL]", "SKIP": "[--]  "}
_STATUS_MARK = {_probe.AVAILABLE: "OK", _probe.UNAVAILABLE: "SKIP", _probe.BROKEN: "FAIL"}


def add_arguments(parser) -> None:
    parser.add_argument("--chip", metavar="NAME", help="diagnose this chip only "
                        "(default: every chip flagos knows)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--no-smoke", dest="smoke", action="store_false",
                        help="list chips and devices only, run no smoke test")


def diagnose(chip: str | None = None, smoke: bool = True, _allow_fork: bool = False) -> dict:
    """The findings as a dict: versions, chips, devices, adapter_path, environment, config_problems,
    smoke, verdict {"level": ok|warn|fail, "text"}, bug_report, seconds.

    chip: one chip name (flagos.ChipNotFoundError, naming the known chips, if flagos does
    not know it). seconds: the time spent here, after Python and torch are loaded.
    Smoke tests run in child processes, so calling this never activates flagos here.
    """
    start = time.perf_counter()
    known = _probe.known_chips()
    if chip is not None and chip not in known and chip.strip().lower() in (
            *chip_names.ALIASES, *chip_names.UNSUPPORTED):
        chip = chip_names.resolve(chip, known).chip  # "ascend" is npu; "rknn" says why not
    if chip is not None and chip not in known:
        raise ChipNotFoundError(f"unknown chip {chip!r}; flagos knows: {', '.join(known)} "
                         f"(adapters are found on FLAGOS_ADAPTER_PATH)")
    names = [chip] if chip else list(known)
    tests = _smoke.SmokeTests(allow_fork=_allow_fork)
    found = {}
    # Host-side chips (cpu, adapters) are probed and their smoke tests started first, before
    # anything here wakes a GPU driver, whose state would not survive the fork of a test.
    for group in ([n for n in names if _smoke.host_side(n)],
                  [n for n in names if not _smoke.host_side(n)]):
        for status in _probe.chip_statuses(group):
            found[status["chip"]] = status
            if smoke and status["status"] == _probe.AVAILABLE:
                tests.start(status["chip"])
    statuses = [found[n] for n in names]
    findings = {
        "versions": _probe.versions(),
        "chips": statuses,
        "adapter_path": _probe.adapter_search_path(),
        "devices": _probe.device_rows(statuses),
        "environment": _probe.environment(),
        "config_problems": _probe.config_problems(),
        "smoke": tests.results(),
    }
    findings["verdict"] = _verdict(findings, chip)
    findings["seconds"] = round(time.perf_counter() - start, 3)
    findings["bug_report"] = _bug_report(findings)
    return findings


def _verdict(findings: dict, chip: str | None) -> dict:
    ready = [s["chip"] for s in findings["chips"] if s["status"] == _probe.AVAILABLE]
    broken = [s for s in findings["chips"] if s["status"] == _probe.BROKEN]
    failed = [r["chip"] for r in findings["smoke"] if r["verdict"] == "fail"]
    warned = [r["chip"] for r in findings["smoke"] if r["verdict"] == "warn"]
    problems = [f"{s['chip']} is broken ({s['reason'].split(':')[0]})" for s in broken]
    problems += [f"{d['chip']}:{d['index']} {d['status']}" for d in findings["devices"]
                 if d["status"] != "ok"]
    problems += [f"smoke test failed on {c}" for c in failed]
    problems += findings["config_problems"]
    if chip is not None and not ready and not broken:
        problems.append(f"{chip} is not available ({findings['chips'][0]['reason']})")
    usable = [c for c in ready if c not in failed]
    summary = f"ready: {', '.join(usable) or 'no chip'}"
    if problems:
        return {"level": "fail", "text": f"FAIL: {'; '.join(problems)}; {summary}"}
    if warned:
        return {"level": "warn", "text": f"OK with warnings on {', '.join(warned)}; {summary}"}
    return {"level": "ok", "text": f"OK: {summary}"}


def _bug_report(findings: dict) -> str:
    v = findings["versions"]
    lines = [f"flagos {v['flagos']}, torch {v['torch']}, Python {v['python']}, {v['os']}"]
    for s in findings["chips"]:
        found = ", ".join(f"{k} {val}" for k, val in s["versions"].items())
        state = f"{s['status']}, {s['device_count']} device(s)" if not s["reason"] else s["reason"]
        lines.append(f"chip {s['chip']}: {state}" + (f" [{found}]" if found else ""))
    lines += [f"device {d['chip']}:{d['index']}: {d['status']}" for d in findings["devices"]
              if d["status"] != "ok"]
    for r in findings["smoke"]:
        bad = [c for c in r["checks"] if c["level"] != "OK"]
        # the first problem in full; later checks often fail for the same reason
        first = f" ({bad[0]['name']}: {bad[0]['level']} {bad[0]['detail']}" if bad else ""
        more = f"; then {', '.join(c['name'] + ' ' + c['level'] for c in bad[1:])}" if bad[1:] else ""
        lines.append(f"smoke {r['chip']}: {r['verdict']}{first}{more}{')' if bad else ''}")
    lines += [f"{k}={val}" for k, val in findings["environment"].items()]
    lines.append(f"verdict: {findings['verdict']['text']}")
    return "\n".join(lines)


def format_text(findings: dict) -> str:
    v = findings["versions"]
    out = [f"flagos {v['flagos']}   torch {v['torch']}   Python {v['python']}   {v['os']}", "",
           "Chips"]
    width = max(len(s["chip"]) for s in findings["chips"])
    for s in findings["chips"]:
        mark = _MARK[_STATUS_MARK[s["status"]]]
        if s["status"] == _probe.AVAILABLE:
            found = ", ".join(f"{k} {val}" for k, val in s["versions"].items())
            what = (f"available, {s['device_count']} device(s), {s['mode']} mode"
                    + (f" ({found})" if found else ""))
        else:
            what = f"{s['status']}: {s['reason']}"
        out.append(f"  {mark} {s['chip'].ljust(width)}  {what}")
    out += ["", "Devices"]
    for d in findings["devices"]:
        if d["status"] != "ok":
            out.append(f"  {_MARK['FAIL']} {d['chip']}:{d['index']}  {d['status']}")
            continue
        memory = f"{format_bytes(d['memory_used'])} / {format_bytes(d['memory_total'])} used"
        out.append(f"  {_MARK['OK']} {d['chip']}:{d['index']}  {d['name']}, {memory}, "
                   f"native {' '.join(d['native_dtypes'])}")
    if not findings["devices"]:
        out.append("  (none)")
    out += ["", "Adapter search path"]
    for entry in findings["adapter_path"]:
        held = ", ".join(entry["libraries"]) or ("(empty)" if entry["exists"] else "(no such folder)")
        out.append(f"  {entry['folder']}  [{entry['source']}]  {held}")
    out += ["", "Environment"]
    settings = [f"  {k}={val}" for k, val in findings["environment"].items()]
    out += settings or ["  (no FLAGOS_* or vendor variables set)"]
    out += [f"  {_MARK['FAIL']} {p}" for p in findings["config_problems"]]
    for r in findings["smoke"]:
        out += ["", f"Smoke test: {r['chip']}"]
        for c in r["checks"]:
            out.append(f"  {_MARK[c['level']]} {c['name']:<16} {c['detail']}")
    out += ["", f"Verdict: {findings['verdict']['text']}  ({findings['seconds']:.1f} s)", "",
            "Bug report (paste this):", "```", findings["bug_report"], "```"]
    return "\n".join(out)


def run(args) -> int:
    try:
        findings = diagnose(chip=args.chip, smoke=args.smoke, _allow_fork=True)
    except ChipNotFoundError as e:
        print(f"flagos diagnose: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        write_json(findings)
    else:
        print(format_text(findings))
    return 1 if findings["verdict"]["level"] == "fail" else 0

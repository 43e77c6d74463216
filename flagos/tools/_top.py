"""A refreshing view of every device and of the programs that export flagos metrics.

Devices: memory used/total, utilization where the chip exposes it. Programs: their op calls
and fallback share.

Programs appear when they serve metrics: flagos.metrics.start_http_server(port) inside them,
or `flagos metrics`. They announce themselves in FLAGOS_RUNTIME_DIR, and top reads each one's
endpoint: fallback share = CPU-fallback calls / all op calls routed by flagos in that program.

exit status: 0 ok (Ctrl-C ends the view), 2 usage error.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from ..report import _exporters, _probe
from ._common import format_bytes, format_share, format_table, positive_int, write_json

SCRAPE_TIMEOUT_S = 1.0
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: a redraw without curses


def _interval(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def add_arguments(parser) -> None:
    parser.add_argument("--interval", type=_interval, default=2.0, metavar="S",
                        help="seconds between frames (default 2)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("-n", "--count", type=positive_int, metavar="N",
                        help="print N frames and exit (default: until Ctrl-C)")
    parser.add_argument("--json", action="store_true",
                        help="frames as JSON (--once: one object; otherwise one object a line)")


# ---- reading exporters ----------------------------------------------------------------------

def _parse(text: str) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def process_row(record: dict) -> dict:
    """What one announced exporter says about its program."""
    row = {"pid": record["pid"], "url": record["url"], "chip": record.get("chip"), "mode": None,
           "version": None, "calls": None, "fallback_calls": None, "fallback_share": None,
           "fallback_seconds": None, "memory_used": None, "status": "ok"}
    try:
        with urllib.request.urlopen(record["url"], timeout=SCRAPE_TIMEOUT_S) as response:
            samples = _parse(response.read().decode())
    except ImportError:
        row["status"] = "error: reading exporters needs prometheus_client: pip install flagos[metrics]"
        return row
    except Exception as e:  # a program that just ended or hangs: say so, keep the view going
        row["status"] = f"error: {type(e).__name__}: {e}"
        return row
    calls = fallback_calls = 0
    fallback_seconds = memory = 0.0
    for name, labels, value in samples:
        if name == "flagos_info":
            row.update(chip=labels.get("chip") or None, mode=labels.get("mode") or None,
                       version=labels.get("version"))
        elif name == "flagos_op_calls_total":
            calls += value
            fallback_calls += value if labels.get("route") == "fallback" else 0
        elif name == "flagos_op_fallback_seconds_total":
            fallback_seconds += value
        elif name == "flagos_device_memory_used_bytes":
            memory += value
    row.update(calls=int(calls), fallback_calls=int(fallback_calls),
               fallback_share=fallback_calls / calls if calls else None,
               fallback_seconds=round(fallback_seconds, 6), memory_used=int(memory))
    return row


def processes() -> list[dict]:
    records = _exporters.running()
    if not records:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(records))) as pool:
        return list(pool.map(process_row, records))


# ---- frames -------------------------------------------------------------------------------

def frame() -> dict:
    """One view: {"time", "devices": [device rows with utilization], "processes": [...]}."""
    return {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "devices": _probe.device_rows(utilization=True),
            "processes": processes()}


def _bar(used: int | None, total: int | None, width: int = 10) -> str:
    if not used or not total:
        return "[" + "." * width + "]"
    filled = min(width, round(width * used / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def format_frame(view: dict, interval: float | None = None) -> str:
    refresh = f"   every {interval:g} s, Ctrl-C to quit" if interval else ""
    lines = [f"flagos top   {view['time']}{refresh}", ""]
    lines.append(format_table(
        ["CHIP", "IDX", "NAME", "MEMORY", "USED / TOTAL", "UTIL", "MODE", "STATUS"],
        [[d["chip"], d["index"], d["name"], _bar(d["memory_used"], d["memory_total"]),
          f"{format_bytes(d['memory_used'])} / {format_bytes(d['memory_total'])}",
          format_share(d["utilization"]), d["mode"], d["status"]] for d in view["devices"]]))
    lines += ["", f"Programs exporting flagos metrics ({_exporters.directory()}):"]
    if not view["processes"]:
        lines.append("  none (start one with flagos.metrics.start_http_server(port) or `flagos metrics`)")
    else:
        lines.append(format_table(
            ["PID", "CHIP", "MODE", "OP CALLS", "FALLBACK CALLS", "FALLBACK SHARE",
             "FALLBACK MS", "MEMORY", "URL / STATUS"],
            [[p["pid"], p["chip"] or "-", p["mode"] or "-", p["calls"], p["fallback_calls"],
              format_share(p["fallback_share"]),
              "-" if p["fallback_seconds"] is None else f"{1000 * p['fallback_seconds']:.1f}",
              format_bytes(p["memory_used"]), p["url"] if p["status"] == "ok" else p["status"]]
             for p in view["processes"]]))
    return "\n".join(lines)


def top(once: bool = True, interval: float = 2.0, count: int | None = None,
        as_json: bool = False) -> dict:
    """One frame as a dict (once=True), or the refreshing view on stdout until Ctrl-C (or
    `count` frames); returns the last frame."""
    if once:
        return frame()
    redraw = sys.stdout.isatty() and not as_json
    shown = 0
    view = {}
    try:
        while True:
            started = time.monotonic()
            view = frame()
            if as_json:
                text = json.dumps(view, default=str)
            else:
                text = (_CLEAR if redraw else "") + format_frame(view, interval) + ("" if redraw else "\n")
            print(text, flush=True)
            shown += 1
            if count is not None and shown >= count:
                break
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    return view


def run(args) -> int:
    if args.once:
        view = top(once=True)
        if args.json:
            write_json(view)
        else:
            print(format_frame(view))
        return 0
    top(once=False, interval=args.interval, count=args.count, as_json=args.json)
    return 0

"""One row per device of every available chip.

Columns: chip, index, name, vendor (for the cuda chip: NVIDIA, AMD, Hygon, Iluvatar or MetaX,
as PyTorch reports the device), memory used/total, native dtypes, mode, status.

Memory used is the whole device's (total - free, as nvidia-smi counts it); for the cpu chip it
is the host's. A C-ABI chip's memory (sim) belongs to the process that loads its adapter, so
from here it reads as free: `flagos top` shows what running programs hold.

exit status: 0 every device answers, 1 a device is in a failed state (its row says why),
2 usage error.
"""
from __future__ import annotations

import csv
import sys

from ..report import _probe
from ._common import format_bytes, format_table, write_json

COLUMNS = ("chip", "index", "name", "vendor", "memory_used", "memory_total", "native_dtypes", "mode", "status")


def add_arguments(parser) -> None:
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    form.add_argument("--csv", action="store_true",
                      help="print the rows as CSV (memory in bytes, dtypes space-separated)")


def devices() -> list[dict]:
    """Every device of every available chip, as dicts with the keys in COLUMNS (memory in
    bytes, None where a failed device cannot say; status "ok" or "error: ...")."""
    return _probe.device_rows()


def _write_csv(rows: list[dict]) -> None:
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow([" ".join(row[c]) if c == "native_dtypes" else
                         "" if row[c] is None else row[c] for c in COLUMNS])


def format_text(rows: list[dict]) -> str:
    headers = ["CHIP", "INDEX", "NAME", "VENDOR", "MEMORY USED", "MEMORY TOTAL", "NATIVE DTYPES", "MODE", "STATUS"]
    body = [[r["chip"], r["index"], r["name"], r["vendor"], format_bytes(r["memory_used"]),
             format_bytes(r["memory_total"]), ",".join(r["native_dtypes"]), r["mode"], r["status"]]
            for r in rows]
    return format_table(headers, body)


def run(args) -> int:
    rows = devices()
    if args.json:
        write_json(rows)
    elif args.csv:
        _write_csv(rows)
    else:
        print(format_text(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1

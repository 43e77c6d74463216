"""Output helpers shared by the subcommands: JSON to a file or stdout, aligned text tables."""
from __future__ import annotations

import json
import sys


def write_json(data, path: str | None = "-") -> None:
    """Write `data` as JSON to `path` ("-" or None: stdout)."""
    text = json.dumps(data, indent=2, default=str)
    if path in (None, "-"):
        sys.stdout.write(text + "\n")
        return
    with open(path, "w") as f:
        f.write(text + "\n")


def format_table(headers: list[str], rows: list[list]) -> str:
    """Rows of cells as an aligned plain-text table with a header line."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    from argparse import ArgumentTypeError  # only the command line needs it
    value = int(text)
    if value < 1:
        raise ArgumentTypeError(f"{text} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0."""
    from argparse import ArgumentTypeError
    value = int(text)
    if value < 0:
        raise ArgumentTypeError(f"{text} is negative")
    return value


def format_bytes(n: int | None) -> str:
    """1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def format_share(x: float | None) -> str:
    """0.231 -> '23.1%'; None -> '-'."""
    return "-" if x is None else f"{100 * x:.1f}%"

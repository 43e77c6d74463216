"""The per-chip compile caches: list them with their sizes, or clear them.

Activation points Inductor's and Triton's caches at FLAGOS_CACHE_DIR/<chip>-<vendor>-<arch>
(default: $XDG_CACHE_HOME/flagos or ~/.cache/flagos). Only folders flagos made (they hold
flagos-cache.json) are listed or removed; anything else in FLAGOS_CACHE_DIR is left alone.

exit status: 0 ok, 1 a folder could not be removed, 2 usage error (an unknown chip).
"""
from __future__ import annotations

import sys

from .. import chips
from ..chips import names
from ..integrations import _caches
from ._common import format_bytes, format_table, write_json


def add_arguments(parser) -> None:
    parser.add_argument("--clear", action="store_true", help="remove the cache folders")
    parser.add_argument("--chip", metavar="NAME",
                        help="only this chip's folders (a chip or vendor name: cuda, nvidia, cpu, sim)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _chip_name(chip: str, rows: list[dict]) -> str:
    """A typed chip name as folders record it; ValueError naming the choices."""
    name = chip.strip().lower()
    if name in names.ALIASES:
        name = names.ALIASES[name].chip
    known = set(chips.known()) | {r["chip"] for r in rows}
    if name not in known:
        raise ValueError(f"unknown chip {chip!r}; use one of: {', '.join(sorted(known))}")
    return name


def cache(clear: bool = False, chip: str | None = None) -> dict:
    """{"root", "folders": [{"folder", "path", "chip", "vendor", "architecture", "bytes"}],
    "removed": [...]} for FLAGOS_CACHE_DIR; `clear` removes the folders listed (`chip`: that
    chip's only). ValueError for an unknown chip, OSError when a folder cannot be removed."""
    root = _caches.root()
    rows = _caches.folders(root)
    if chip is not None:
        chip = _chip_name(chip, rows)
        rows = [r for r in rows if r["chip"] == chip]
    removed = _caches.clear(root, chip) if clear else []
    return {"root": root, "folders": [] if clear else rows, "removed": removed}


def format_text(result: dict) -> str:
    if result["removed"]:
        lines = [f"removed {r['path']} ({format_bytes(r['bytes'])})" for r in result["removed"]]
        return "\n".join(lines)
    if not result["folders"]:
        return f"no flagos cache folders in {result['root']}"
    body = [[r["folder"], r["chip"], r["vendor"], r["architecture"], format_bytes(r["bytes"])]
            for r in result["folders"]]
    total = sum(r["bytes"] for r in result["folders"])
    return (f"{result['root']}\n" + format_table(["FOLDER", "CHIP", "VENDOR", "ARCHITECTURE", "SIZE"], body)
            + f"\ntotal {format_bytes(total)}")


def run(args) -> int:
    try:
        result = cache(clear=args.clear, chip=args.chip)
    except ValueError as e:
        print(f"flagos cache: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"flagos cache: cannot remove {e.filename}: {e.strerror}; remove it by hand or "
              f"check its permissions", file=sys.stderr)
        return 1
    if args.json:
        write_json(result)
    elif args.clear and not result["removed"]:
        print(f"nothing to clear in {result['root']}")
    else:
        print(format_text(result))
    return 0

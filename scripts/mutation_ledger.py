"""The committed record of every mutant's outcome: docs/mutation/python.json and c.json.

A run's working state (cosmic-ray's sessions, the scratch trees) lives in .mutation/, which
does not outlive the machine; a full pass takes longer than one machine's life. So every result
is also merged into this ledger, and a run on a new checkout takes the results whose file is
unchanged from it instead of running those mutants again.

Per file: the sha256 of the source the results belong to, and per mutant (keyed the way the
runner names it) its status, the seconds it took and, for a survivor, what changed. A file
whose source changed starts an empty entry the first time a result for the new source is
merged, and keeps the entries of its last EARLIER_KEPT sources under "earlier": their kills
carry over to the new source (scripts/mutation_context.py), and a lane still running on an
older source adds to that source's entry instead of replacing the new one's. Two runs in two
work folders may merge into the same ledger: each merge reads, updates and rewrites the file
under a lock.
"""
from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager

from mutation_check import ROOT

LEDGER_DIR = os.path.join(ROOT, "docs", "mutation")
# Earlier sources' entries kept beside the current one.
EARLIER_KEPT = 2


def ledger_path(kind: str) -> str:
    return os.path.join(LEDGER_DIR, f"{kind}.json")


def load(kind: str) -> dict:
    try:
        with open(ledger_path(kind)) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _belongs(entry: dict | None, sha: str, fields: dict) -> bool:
    """Whether an entry holds results for this very source (and these fields' values)."""
    return entry is not None and entry.get("sha256") == sha and all(entry.get(k) == v for k, v in fields.items())


def sources(entry: dict | None) -> list[dict]:
    """A file's entries, the current source's first, then the earlier ones', newest first."""
    if entry is None:
        return []
    return [{k: v for k, v in entry.items() if k != "earlier"}, *entry.get("earlier", [])]


def entry_for(kind: str, path: str, sha: str, **fields) -> dict:
    """The file's mutants when the ledger holds results for this very source (and, for
    Python, the same operator set), current or earlier; {} otherwise."""
    for entry in sources(load(kind).get(path)):
        if _belongs(entry, sha, fields):
            return entry.get("mutants", {})
    return {}


@contextmanager
def _locked(kind: str):
    # The lock file lives in the ignored .mutation/ folder: the ledger itself is replaced on
    # every write, so it cannot carry the lock.
    lock_dir = os.path.join(ROOT, ".mutation")
    os.makedirs(lock_dir, exist_ok=True)
    with open(os.path.join(lock_dir, f"ledger-{kind}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def merge(kind: str, path: str, sha: str, mutants: dict[str, dict], match: dict | None = None,
          info: dict | None = None) -> None:
    """Adds or replaces `mutants` in the entry of the file's source `sha` (and `match` fields:
    the operator set). Results for one of the earlier sources kept go to its entry; for a
    source the ledger does not know, a new current entry starts and the one before is kept
    among the earlier ones. `info` fields (the number of mutants) are only updated."""
    match = match or {}
    with _locked(kind):
        data = load(kind)
        entries = sources(data.get(path))
        target = next((e for e in entries if _belongs(e, sha, match)), None)
        if target is None:
            target = {"sha256": sha, **match, "mutants": {}}
            entries = [target, *(e for e in entries if e.get("mutants"))]
        target.update(info or {})
        target["mutants"].update(mutants)
        current, *earlier = entries
        data[path] = {**current, **({"earlier": earlier[:EARLIER_KEPT]} if earlier else {})}
        _write(ledger_path(kind), data)


def _write(target: str, data: dict) -> None:
    """One line per mutant, files and mutants sorted: a run's changes read as a small diff."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    lines = ["{"]
    for i, path in enumerate(sorted(data)):
        lines.append(f"  {json.dumps(path)}: {{")
        _entry_lines(data[path], "    ", lines)
        lines.append("  }" + ("," if i < len(data) - 1 else ""))
    lines.append("}")
    tmp = target + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, target)


def _entry_lines(entry: dict, indent: str, lines: list[str]) -> None:
    for key in sorted(k for k in entry if k not in ("mutants", "earlier")):
        lines.append(f"{indent}{json.dumps(key)}: {json.dumps(entry[key])},")
    if entry.get("earlier"):
        lines.append(f'{indent}"earlier": [')
        for j, earlier in enumerate(entry["earlier"]):
            lines.append(f"{indent}  {{")
            _entry_lines(earlier, indent + "    ", lines)
            lines.append(f"{indent}  }}" + ("," if j < len(entry["earlier"]) - 1 else ""))
        lines.append(f"{indent}],")
    lines.append(f'{indent}"mutants": {{')
    mutants = entry.get("mutants", {})
    names = sorted(mutants, key=mutant_order)
    for j, name in enumerate(names):
        comma = "," if j < len(names) - 1 else ""
        lines.append(f"{indent}  {json.dumps(name)}: {json.dumps(mutants[name], sort_keys=True)}{comma}")
    lines.append(f"{indent}}}")


def mutant_order(name: str) -> tuple:
    """By line and column where the name starts with them (both runners' keys do)."""
    head = name.split(" ", 1)[0].split(":")
    numbers = tuple(int(p) for p in head[:2] if p.isdigit())
    return numbers, name

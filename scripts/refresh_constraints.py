"""Write constraints.txt: the versions of every package flagos's extras pull in, as installed now.

scripts/setup.sh installs the test and example dependencies under these pins, so a library
release cannot change what a fresh clone tests. Refresh on purpose, after the whole suite passed
on the new versions:

    pip install -U -e ".[test,examples]" && bash scripts/test.sh && python scripts/refresh_constraints.py

PyTorch itself is left out: flagos supports a range of versions (setup.sh installs 2.13.0 only when
no torch is present), and pinning it here would replace the torch a user already has.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("test", "examples")
# torch and the CUDA wheels it may bring are the user's choice, not ours to pin.
UNPINNED = re.compile(r"^(torch|nvidia-.*|triton|flagos)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(dist: metadata.Distribution, extras: tuple[str, ...]) -> list[str]:
    """Names of what `dist` requires, with the given extras of it selected."""
    names = []
    for req in dist.requires or []:
        name, _, marker = req.partition(";")
        marker = marker.strip()
        if marker and "extra" in marker:
            chosen = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if not any(canonical(e) in map(canonical, extras) for e in chosen):
                continue
        elif marker:
            # Platform markers: evaluate them the way pip would for this interpreter.
            if not Marker(marker).evaluate({"extra": ""}):
                continue
        base = re.split(r"[\s<>=!~\[(]", name.strip(), maxsplit=1)[0]
        if base:
            names.append(base)
    return names


def closure() -> dict[str, str]:
    """Installed name -> version for everything flagos[test,examples] needs, transitively."""
    pins: dict[str, str] = {}
    todo = requirement_names(metadata.distribution("flagos"), EXTRAS)
    while todo:
        name = todo.pop()
        key = canonical(name)
        if key in pins or UNPINNED.match(key):
            if UNPINNED.match(key) and key == "torch":
                # torch's own dependencies (sympy, networkx, ...) are pinned like the rest.
                todo += requirement_names(metadata.distribution("torch"), ())
                pins.setdefault("torch", "")
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency this machine does not need
        pins[key] = dist.version
        todo += requirement_names(dist, ())
    pins.pop("torch", None)
    return dict(sorted(pins.items()))


def main() -> int:
    pins = closure()
    lines = ["# Versions the flagos test suite has passed on; written by scripts/refresh_constraints.py.",
             "# scripts/setup.sh installs flagos's extras under these pins. PyTorch is not pinned here.",
             *(f"{name}=={version}" for name, version in pins.items())]
    (ROOT / "constraints.txt").write_text("\n".join(lines) + "\n")
    print(f"constraints.txt: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())

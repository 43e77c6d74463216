"""The `flagos` command's subcommands, each also a Python function.

    flagos.tools.diagnose()      flagos.tools.devices()      flagos.tools.top(once=True)
    flagos.tools.bench("bert")   flagos.tools.compare(...)   flagos.tools.analyze([...])
    flagos.tools.metrics(...)     flagos.tools.cache()

Each subcommand NAME lives in `flagos/tools/_NAME.py`, which defines the function NAME (the
Python API), `add_arguments(parser)` and `run(args) -> int` (the command line, see cli.py).
"""
from __future__ import annotations

import importlib

SUBCOMMANDS = ("diagnose", "devices", "top", "bench", "compare", "analyze", "metrics", "cache")

__all__ = list(SUBCOMMANDS)


def command_module(name: str):
    """The module implementing subcommand `name`."""
    return importlib.import_module(f"{__name__}._{name}")


def __getattr__(name: str):
    if name not in SUBCOMMANDS:
        raise AttributeError(f"module 'flagos.tools' has no attribute {name!r}")
    return getattr(command_module(name), name)

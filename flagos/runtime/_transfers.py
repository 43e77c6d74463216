"""Bytes copied from one flagos device to another (flagos:i -> flagos:j, i != j).

Only the copy ops that cross devices add to it (`Runner.copy_` and `Runner.to_copy` on a C-ABI
chip), so the per-op path of every other op is untouched. The report reads it
(`bytes_between_devices` in `Report.to_dict()["totals"]`).
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_bytes = 0


def add(nbytes: int) -> None:
    global _bytes
    with _lock:
        _bytes += nbytes


def total() -> int:
    return _bytes


def reset() -> None:
    global _bytes
    with _lock:
        _bytes = 0

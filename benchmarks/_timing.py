"""Shared timing helpers: medians of repeated runs, native and flagos in the same process."""
from __future__ import annotations

import os
import platform
import statistics
import time


def median_us(fn, number: int, repeat: int) -> float:
    """Median over `repeat` runs of the mean time of `number` calls, in microseconds."""
    for _ in range(max(number // 10, 3)):
        fn()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(runs)


def machine() -> str:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")

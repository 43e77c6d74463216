"""Shared timing helpers: medians of repeated runs, native and flagos in the same process, and
the machine each figure was measured on (written beside the figures with `--json`)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time


def median_us(fn, number: int, repeat: int, sync=None) -> float:
    """Median over `repeat` runs of the mean time of `number` calls, in microseconds. `sync`
    (the device's synchronize) ends each run, so that the work a chip queues asynchronously
    (opencl, cuda) is inside the time, as torch.utils.benchmark does for CUDA."""
    for _ in range(max(number // 10, 3)):
        fn()
    if sync is not None:
        sync()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        if sync is not None:
            sync()
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


def environment() -> dict:
    """What a figure depends on: the machine, the versions, the threads, the load."""
    import torch
    try:
        load = list(os.getloadavg())
    except OSError:  # not every platform has a load average
        load = None
    return {"machine": machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "load_average": load,
            "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")}


def add_json_option(parser) -> None:
    parser.add_argument("--json", metavar="PATH",
                        help="also write the figures, with the machine they were measured on, "
                             "as JSON")


def write_json(path: str | None, script: str, results: dict) -> None:
    """`results` with the environment, to `path` (nothing when path is None)."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"script": script, "environment": environment(), "results": results}, f,
                  indent=1)
        f.write("\n")


def spread(values: list[float]) -> dict:
    """min / median / max of repeated measurements."""
    ordered = sorted(values)
    return {"min": ordered[0], "median": statistics.median(ordered), "max": ordered[-1]}

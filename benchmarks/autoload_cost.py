"""What an installed flagos adds to `import torch` when FLAGOS_DEVICE is not set.

    python benchmarks/autoload_cost.py [--repeat 15]

Runs `python -c "import torch"` with PyTorch's backend autoload on (flagos's entry point
runs and returns at once) and off (TORCH_DEVICE_BACKEND_AUTOLOAD=0), alternating, and
reports the median difference. A second figure times the entry point itself in-process.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _timing import add_json_option, machine, write_json  # noqa: E402


def run(env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=15)
    add_json_option(p)
    args = p.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    on, off = [], []
    run(base)
    for _ in range(args.repeat):
        on.append(run(base))
        off.append(run({**base, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}))
    code = ("import time, torch; from importlib.metadata import entry_points; "
            "ep = [e for e in entry_points(group='torch.backends') if e.name == 'flagos'][0]; "
            "t = time.perf_counter(); ep.load()(); print((time.perf_counter() - t) * 1e3)")
    env = {**base, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    inproc = [float(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                   capture_output=True, text=True).stdout) for _ in range(5)]
    print(f"machine: {machine()}")
    print(f"import torch, autoload on:  median {statistics.median(on):.1f} ms")
    print(f"import torch, autoload off: median {statistics.median(off):.1f} ms")
    print(f"difference: {statistics.median(on) - statistics.median(off):+.1f} ms "
          f"(run-to-run spread ±{statistics.pstdev(off):.1f} ms)")
    print(f"flagos entry point (import flagos + autoload()), in process: median "
          f"{statistics.median(inproc):.2f} ms")
    write_json(args.json, "autoload_cost", {
        "import_torch_autoload_on_ms": statistics.median(on),
        "import_torch_autoload_off_ms": statistics.median(off),
        "entry_point_in_process_ms": statistics.median(inproc)})


if __name__ == "__main__":
    main()

"""Images per second of flagos.parallel.PipelinePool with 1, 2 and 4 workers against one process.

    python benchmarks/pool_throughput.py [--chip cpu] [--workers 1,2,4] [--images 8] [--steps 5]
                                         [--repeat 3] [--threads T]

The pipeline is examples/diffusers_pool.py's (a small DDPM UNet, seeded random weights). "One
process" is the same pipeline on the same chip in this process, timed with PyTorch's default
threads (one per core) and with one thread; the ratios are against the faster of the two. Each
pool divides the cores among its workers (docs/parallel.md). Every figure is the median of
--repeat runs of --images images, after one warm-up image per worker; the pool's start
(spawning the workers, importing torch, building the pipeline) is printed apart. On a machine
with C cores, expect at most about C times one process.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _timing import machine  # noqa: E402

import flagos  # noqa: E402
from flagos.parallel import PipelinePool  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "diffusers_pool.py"
# build_pipeline and generate, importable by the workers (spawn pickles functions by name)
sys.path.insert(0, str(EXAMPLE.parent))
from diffusers_pool import build_pipeline, generate  # noqa: E402


def images_per_s(run, requests, repeat: int) -> float:
    rates = []
    for _ in range(repeat):
        start = time.perf_counter()
        run(requests)
        rates.append(len(requests) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="cpu", help="chip: cpu, sim, or any chip present")
    parser.add_argument("--workers", default="1,2,4", help="pool sizes, comma-separated")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: the pool's, cores / workers)")
    args = parser.parse_args()
    requests = [{"seed": s, "steps": args.steps} for s in range(args.images)]
    print(machine())
    print(f"cores available to this process: {len(os.sched_getaffinity(0))}; load average "
          f"{os.getloadavg()[0]:.1f} at the start")

    flagos.activate(args.chip)
    pipe = build_pipeline(flagos.device())
    generate(pipe, {"seed": 0, "steps": 1})
    cores, ones = len(os.sched_getaffinity(0)), []
    for threads in sorted({cores, 1}, reverse=True):
        torch.set_num_threads(threads)
        ones.append(images_per_s(lambda rs: [generate(pipe, r) for r in rs], requests, args.repeat))
        print(f"one process on {args.chip}, {threads} thread(s): {ones[-1]:.2f} images/s "
              f"({args.images} images of {args.steps} steps, median of {args.repeat})")
    one = max(ones)

    for n in (int(w) for w in args.workers.split(",")):
        start = time.perf_counter()
        with PipelinePool(build_pipeline, devices=n, chip=args.chip, threads=args.threads) as pool:
            started = time.perf_counter() - start
            pool.map(generate, [{"seed": 0, "steps": 1}] * len(pool))
            rate = images_per_s(lambda rs, pool=pool: pool.map(generate, rs), requests, args.repeat)
        print(f"pool of {n} worker(s), {pool.threads or 'default'} thread(s) each: {rate:.2f} images/s "
              f"= {rate / one:.2f}x the faster one process (started in {started:.1f} s)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

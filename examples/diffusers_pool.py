"""A DDPM pipeline per device, in one call: flagos.parallel.PipelinePool.

    python examples/diffusers_pool.py [--chip cpu|sim|auto|...] [--devices all|N] [--prompts 8]
                                      [--steps 10]

Each worker process sees one device as its flagos:0 and builds the pipeline there once; the
"prompts" (DDPM is unconditional: a prompt is a seed) are spread over the workers and the images
come back in input order. Every image is compared with the one plain PyTorch on CPU makes in
this process for the same seed: the seed decides the image, whichever device served it. The
UNet is built from a small config with seeded random weights (no downloads). Prints images per
second for the pool and for the one process.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

from flagos.parallel import PipelinePool

TOLERANCE = 1e-3  # float32: summation order may differ between thread counts and chips


def build_pipeline(device) -> DDPMPipeline:
    """Runs in each worker (and once here, on the CPU, for the reference images)."""
    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(32, 64, 64), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    )
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=1000)).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: DDPMPipeline, request: dict) -> np.ndarray:
    """One request: the noise comes from a CPU generator seeded with the request's seed."""
    generator = torch.Generator("cpu").manual_seed(request["seed"])
    return pipe(batch_size=1, generator=generator, num_inference_steps=request["steps"],
                output_type="np").images[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default=None,
                        help="chip of the workers: cpu, sim, cuda, ... (default: FLAGOS_DEVICE or auto)")
    parser.add_argument("--devices", default="all",
                        help="'all' (every device; on the cpu chip one worker per core) or a number of workers")
    parser.add_argument("--prompts", type=int, default=8, help="images to make (seeds 0 .. N-1)")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per image")
    args = parser.parse_args()
    devices = args.devices if args.devices == "all" else int(args.devices)
    requests = [{"seed": seed, "steps": args.steps} for seed in range(args.prompts)]

    start = time.perf_counter()
    with PipelinePool(build_pipeline, devices=devices, chip=args.chip) as pool:
        started = time.perf_counter() - start
        print(f"{len(pool)} worker(s) on chip {pool.chip} ({', '.join(pool.devices)}), "
              f"{pool.threads or 'default'} torch thread(s) each; started in {started:.1f} s")
        pool.map(generate, [{"seed": 0, "steps": 1}] * len(pool))  # warm-up: one per worker
        start = time.perf_counter()
        images = pool.map(generate, requests)
        pool_s = time.perf_counter() - start

    reference = build_pipeline("cpu")  # PyTorch's default threads: one per core
    generate(reference, {"seed": 0, "steps": 1})
    start = time.perf_counter()
    expected = [generate(reference, r) for r in requests]
    one_s = time.perf_counter() - start

    diff = max(float(np.abs(a - b).max()) for a, b in zip(images, expected))
    print(f"{len(images)} images of {args.steps} steps: pool {len(images) / pool_s:.2f} images/s, "
          f"one plain-CPU process {len(images) / one_s:.2f} images/s ({os.cpu_count()} cores); "
          f"max |pool - one process| = {diff:.2e}")
    if diff > TOLERANCE:
        raise SystemExit(f"the pool's images differ from one process's by {diff}")
    print("every image matches the one process's image for its seed")


if __name__ == "__main__":
    main()

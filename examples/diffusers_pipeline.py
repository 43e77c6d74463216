"""The main job: a Diffusers DDPM pipeline on the default chip, with the fallback report.

    python examples/diffusers_pipeline.py [--device auto|cpu|cuda|...] [--steps 25] [--out ddpm.png]

The UNet is built from a small config with seeded random weights (no downloads), so the image
is noise-shaped; what matters is that the same script runs on every chip and the report says
which aten ops ran where. The run is compared with plain PyTorch on CPU.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
from PIL import Image

import flagos


def build_pipeline(seed: int) -> DDPMPipeline:
    torch.manual_seed(seed)
    unet = UNet2DModel(
        sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(32, 64, 64), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    )
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=1000))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: DDPMPipeline, steps: int, seed: int) -> tuple[np.ndarray, float]:
    generator = torch.Generator("cpu").manual_seed(seed)
    start = time.perf_counter()
    images = pipe(batch_size=1, generator=generator, num_inference_steps=steps, output_type="np").images
    return images, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="chip: auto, cpu, cuda, npu, ... (default: FLAGOS_DEVICE or auto)")
    parser.add_argument("--steps", type=int, default=25, help="denoising steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="ddpm.png", help="where to save the image")
    args = parser.parse_args()

    info = flagos.activate(args.device)
    print(f"flagos {info['version']} on chip {info['chip']} ({info['mode']} mode, "
          f"{info['devices'][0]}), torch {info['torch']}")

    reference, ref_s = generate(build_pipeline(args.seed), args.steps, args.seed)
    flagos.reset_report()
    pipe = build_pipeline(args.seed).to(flagos.device())
    images, run_s = generate(pipe, args.steps, args.seed)

    Image.fromarray((images[0] * 255).round().astype("uint8")).save(args.out)
    diff = float(np.abs(images - reference).max())
    print(f"{args.steps} steps on {flagos.device()}: {run_s:.2f} s (plain CPU: {ref_s:.2f} s); "
          f"max |flagos - cpu| = {diff:.2e}; image saved to {args.out}")
    print(flagos.fallback_report())
    if diff > 1e-3:
        raise SystemExit(f"flagos output differs from plain CPU by {diff}")


if __name__ == "__main__":
    main()

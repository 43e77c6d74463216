"""Diffusers' distributed inference recipe with accelerate, on flagos: one process per device.

    accelerate launch --num_processes 2 examples/distributed_inference.py [--device auto|cpu|sim|...]
    torchrun --standalone --nproc_per_node 2 examples/distributed_inference.py --device sim
    python examples/distributed_inference.py            # one process: every seed, for comparison

The recipe is Diffusers' own (docs: "Distributed inference", the accelerate section):
`PartialState()` starts the process group, `pipeline.to(distributed_state.device)` puts each
process on its own device and `split_between_processes` hands each process its share of the
work. Here the work is a list of seeds for a DDPM pipeline built from a small config with seeded
random weights (no downloads). The only flagos line is `flagos.activate()`: accelerate's device is
then flagos:(local rank) (on the cpu chip, every process has flagos:0; on sim, one sim device per
process) and its process group is flagos.dist_backend(). Each image is saved as
OUT/seed_<seed>.npy, with the process and device that made it in OUT/seed_<seed>.txt.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from accelerate import PartialState
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

import flagos


def build_pipeline(seed: int = 0) -> DDPMPipeline:
    torch.manual_seed(seed)
    unet = UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=100))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipeline: DDPMPipeline, seed: int, steps: int) -> np.ndarray:
    generator = torch.Generator("cpu").manual_seed(seed)
    return pipeline(batch_size=1, generator=generator, num_inference_steps=steps, output_type="np").images[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="the chip (flagos.activate)")
    parser.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds, one image each")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="distributed_inference")
    args = parser.parse_args()
    flagos.activate(args.device)

    # ---- Diffusers' recipe, unchanged ------------------------------------------------
    pipeline = build_pipeline()
    distributed_state = PartialState()
    pipeline.to(distributed_state.device)
    os.makedirs(args.out, exist_ok=True)
    with distributed_state.split_between_processes([int(s) for s in args.seeds.split(",")]) as seeds:
        for seed in seeds:
            image = generate(pipeline, seed, args.steps)
            np.save(os.path.join(args.out, f"seed_{seed}.npy"), image)
            with open(os.path.join(args.out, f"seed_{seed}.txt"), "w") as f:
                f.write(f"{distributed_state.process_index} {distributed_state.num_processes} "
                        f"{distributed_state.device} {flagos.info()['chip']}\n")
    distributed_state.wait_for_everyone()
    if distributed_state.is_main_process:
        print(f"{distributed_state.num_processes} process(es) on chip {flagos.info()['chip']}, "
              f"backend {distributed_state.backend}: images in {args.out}")


if __name__ == "__main__":
    main()

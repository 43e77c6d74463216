"""The main job: a Diffusers DDPM pipeline on the default chip, with the fallback report.

    python examples/diffusers_pipeline.py [--device auto|cpu|cuda|...] [--steps 25] [--out ddpm.png]
                                          [--dtype float32|float16|bfloat16]
                                          [--offload model|sequential|group]

The UNet is built from a small config with seeded random weights (no downloads), so the image
is noise-shaped; what matters is that the same script runs on every chip and the report says
which aten ops ran where. The run is compared with plain PyTorch on the chip's own PyTorch device
where it has one (cuda on the cuda chip: the same kernels and the same random numbers), else on
the CPU; with --dtype float16 or
bfloat16 both runs use autocast (torch.autocast("flagos") follows the payload device's policy).
With --offload the weights rest on the host and Diffusers moves them to flagos as they are
needed: a whole model at a time (model), each layer's weights for its own forward (sequential),
or one block of layers at a time (group). The noise comes from a seeded
torch.Generator(flagos.device()), which draws what the same generator of that device draws. Without
--offload the pipeline is then saved with save_pretrained, loaded back with from_pretrained onto
flagos and run again: the image must not change.
"""
from __future__ import annotations

import argparse
import tempfile
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


def place(pipe: DDPMPipeline, device: torch.device, offload: str | None) -> DDPMPipeline:
    """Move the pipeline to `device`, or let Diffusers offload it to the host between uses."""
    if offload is None:
        return pipe.to(device)
    if offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        pipe.enable_group_offload(onload_device=device, offload_type="block_level", num_blocks_per_group=1)
    return pipe


def generate(pipe: DDPMPipeline, device: torch.device, steps: int, seed: int,
             dtype: torch.dtype) -> tuple[np.ndarray, float]:
    generator = torch.Generator(device).manual_seed(seed)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        images = pipe(batch_size=1, generator=generator, num_inference_steps=steps,
                      output_type="np").images
    return images, time.perf_counter() - start


def save_and_reload(pipe: DDPMPipeline, device: torch.device, folder: str) -> DDPMPipeline:
    """save_pretrained + from_pretrained onto `device`. On C-ABI chips (sim) a flagos tensor's
    memory is an adapter buffer with no host storage for safetensors to read, so, as flagos's
    error says, the pipeline is saved from the host there."""
    try:
        pipe.save_pretrained(folder)
    except RuntimeError as e:
        if "adapter buffers" not in str(e):
            raise
        pipe.to("cpu").save_pretrained(folder)
    back = DDPMPipeline.from_pretrained(folder).to(device)
    back.set_progress_bar_config(disable=True)
    return back


def reference_device(chip: str) -> torch.device:
    """Plain PyTorch's device to compare with: the chip's own (cuda, npu, ...) where PyTorch has
    one here, else the CPU (the cpu chip, and C-ABI chips such as sim, whose random numbers are
    the CPU's)."""
    own = getattr(torch, chip, None) if chip != "cpu" else None
    available = getattr(own, "is_available", None)
    return torch.device(chip, 0) if callable(available) and available() else torch.device("cpu")


# How far flagos may be from plain PyTorch: float32 is exact in practice; half precision gets the
# FlagGems tolerances (the two runs use the same casting policy, so they agree far closer).
OFFLOAD_MODES = ("model", "sequential", "group")
TOLERANCE = {"float32": 1e-3, "float16": 1e-3 * 10, "bfloat16": 1.6e-2 * 10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="chip: auto, cpu, cuda, npu, ... (default: FLAGOS_DEVICE or auto)")
    parser.add_argument("--steps", type=int, default=25, help="denoising steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="ddpm.png", help="where to save the image")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE),
                        help="float16/bfloat16: run the pipeline under autocast")
    parser.add_argument("--offload", default=None, choices=OFFLOAD_MODES,
                        help="keep the weights on the host and move them to the chip as needed")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    info = flagos.activate(args.device)
    print(f"flagos {info['version']} on chip {info['chip']} ({info['mode']} mode, "
          f"{info['devices'][0]}), torch {info['torch']}")

    plain = reference_device(info["chip"])
    reference, ref_s = generate(build_pipeline(args.seed).to(plain), plain, args.steps, args.seed, dtype)
    flagos.reset_report()
    pipe = place(build_pipeline(args.seed), flagos.device(), args.offload)
    images, run_s = generate(pipe, flagos.device(), args.steps, args.seed, dtype)

    Image.fromarray((images[0] * 255).round().astype("uint8")).save(args.out)
    diff = float(np.abs(images - reference).max())
    offload = f", {args.offload} offload" if args.offload else ""
    print(f"{args.steps} steps on {flagos.device()} ({args.dtype}{offload}): {run_s:.2f} s (plain {plain.type}: {ref_s:.2f} s); "
          f"max |flagos - {plain.type}| = {diff:.2e}; image saved to {args.out}")
    print(flagos.fallback_report())
    if diff > TOLERANCE[args.dtype]:
        raise SystemExit(f"flagos output differs from plain {plain.type} by {diff}")
    if args.offload is None:
        with tempfile.TemporaryDirectory() as folder:
            again, _ = generate(save_and_reload(pipe, flagos.device(), folder), flagos.device(),
                                args.steps, args.seed, dtype)
        if not np.array_equal(again, images):
            raise SystemExit("the pipeline saved with save_pretrained and loaded back with "
                             "from_pretrained gives another image")
        print("save_pretrained + from_pretrained on flagos: the same image")


if __name__ == "__main__":
    main()

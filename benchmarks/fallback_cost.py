"""Cost of the CPU fallback: MB/s of the host round trip vs a plain host copy, in one run.

    python benchmarks/fallback_cost.py [--chip sim] [--repeat 7]

For each size, `neg` is forced onto the fallback route, so one call moves the tensor to the
host, negates it there and moves the result back. Its throughput (bytes moved each way / time)
is compared with `torch.Tensor.copy_` between two host tensors of the same size (a memcpy-class
copy) and with the host `neg` alone, all measured in the same process.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import machine, median_us  # noqa: E402

import flagos  # noqa: E402

SIZES = {"64 KiB": 16 * 1024, "1 MiB": 256 * 1024, "16 MiB": 4 * 1024 * 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", default="sim")
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    os.environ["FLAGOS_FALLBACK"] = "allow"
    info = flagos.activate(args.chip)
    dev = flagos.device()
    flagos.set_route("aten::neg", "fallback")
    print(f"machine: {machine()}")
    print(f"chip {info['chip']} ({info['mode']} mode); float32; median of {args.repeat} runs")
    print(f"{'size':<8}{'host copy MB/s':>16}{'host neg µs':>13}{'fallback neg µs':>17}"
          f"{'round trip MB/s':>17}{'vs copy':>9}")
    for label, n in SIZES.items():
        number = max(3, 2_000_000 // n)
        src, dst = torch.randn(n), torch.empty(n)
        on_chip = src.to(dev)
        copy_us = median_us(lambda d=dst, s=src: d.copy_(s), number, args.repeat)
        neg_us = median_us(lambda s=src: torch.neg(s), number, args.repeat)
        flagos.reset_report()
        fb_us = median_us(lambda t=on_chip: torch.neg(t), number, args.repeat)
        row = flagos.fallback_report().op("aten::neg")
        calls = row["calls"]["fallback"]
        moved = (row["bytes_to_host"] + row["bytes_to_device"]) / calls  # bytes per call
        copy_mbs = src.nbytes / copy_us
        trip_mbs = moved / max(fb_us - neg_us, 1e-9)
        print(f"{label:<8}{copy_mbs:>16.0f}{neg_us:>13.1f}{fb_us:>17.1f}{trip_mbs:>17.0f}"
              f"{trip_mbs / copy_mbs:>9.2f}")
    print("round trip MB/s = bytes moved to the host and back per call / (fallback time - host "
          "neg time); host copy MB/s = bytes copied / time")


if __name__ == "__main__":
    main()

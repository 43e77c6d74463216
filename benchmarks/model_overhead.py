"""Whole-model overhead: flagos / native time ratio for a BERT-style forward and a UNet step.

    python benchmarks/model_overhead.py [--chip cpu] [--mode device|native] [--repeat 7]
                                        [--floor | --no-floor]

Both models are built from small configs with seeded random weights; native and flagos run in
the same process, alternating, and the figures are medians.

The floor (on by default in device mode) runs each model a third time with its parameters,
buffers and inputs behind the trivial C-dispatch wrapper of dispatch_overhead.py (unwrap, call,
wrap each output; no routes, no checks): the least any tensor-subclass device pays on the same
model, as a ratio paired with the same run's native time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import models  # noqa: E402
from _floor import floor_available, floor_module, floor_tensor  # noqa: E402
from _timing import add_json_option, machine, write_json  # noqa: E402

import flagos  # noqa: E402


def timed(fn, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", default="cpu")
    p.add_argument("--mode", default=None, choices=("device", "native"))
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--number", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's intra-op threads (default 1, as the other scripts: OpenMP threads "
                        "waiting for a busy core would swamp the ratios on a shared machine)")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each model on the floor, a trivial C-dispatch wrapper (default: on)")
    add_json_option(p)
    args = p.parse_args()

    os.environ.setdefault("FLAGOS_FALLBACK", "allow")
    torch.set_num_threads(args.threads)
    info = flagos.activate(args.chip, mode=args.mode)
    dev = flagos.device()
    native_dev = torch.device("cpu") if info["mode"] == "device" else None

    bert_n, bert_f = models.bert(), models.bert().to(dev)
    ids, mask, _ = models.bert_batch(batch=4, seq=32)
    base_n, base_f = models.bert(size="base"), models.bert(size="base").to(dev)
    base_ids, base_mask, _ = models.bert_batch(batch=2, seq=128)
    unet_n = models.ddpm_pipeline().unet.eval()
    unet_f = models.ddpm_pipeline().unet.eval().to(dev)
    sample = torch.randn(1, 3, 16, 16)
    t = torch.tensor([10])

    cases = {
        "bert-tiny fwd": (lambda: bert_n(input_ids=ids, attention_mask=mask),
                          lambda: bert_f(input_ids=ids.to(dev), attention_mask=mask.to(dev))),
        "bert-base fwd": (lambda: base_n(input_ids=base_ids, attention_mask=base_mask),
                          lambda: base_f(input_ids=base_ids.to(dev), attention_mask=base_mask.to(dev))),
        "unet step": (lambda: unet_n(sample, t), lambda: unet_f(sample.to(dev), t.to(dev))),
    }
    floors = {}
    if args.floor and native_dev is not None and floor_available():
        bert_l, base_l = floor_module(models.bert()), floor_module(models.bert(size="base"))
        unet_l = floor_module(models.ddpm_pipeline().unet.eval())
        floors = {
            "bert-tiny fwd": lambda: bert_l(input_ids=floor_tensor(ids), attention_mask=floor_tensor(mask)),
            "bert-base fwd": lambda: base_l(input_ids=floor_tensor(base_ids),
                                            attention_mask=floor_tensor(base_mask)),
            "unet step": lambda: unet_l(floor_tensor(sample), floor_tensor(t)),
        }
    if native_dev is None:  # native mode: the "native" side runs with flagos off
        print("note: native mode times flagos against itself deactivated")
    print(f"machine: {machine()}")
    print(f"chip {info['chip']}, {info['mode']} mode; median of {args.repeat} runs of {args.number} calls; "
          f"{args.threads} thread(s)")
    print("bert-tiny: hidden 32, 2 layers, batch 4 x 32 tokens; bert-base: BERT-base layers "
          "(hidden 768, 12 heads, FFN 3072), 4 of them, batch 2 x 128 tokens; unet: the DDPM "
          "test UNet, 16x16")
    print(f"{'model':<14}{'native ms':>11}{'flagos ms':>11}{'ratio':>8}"
          + (f"{'floor':>8}" if floors else "") + ("   (floor: paired with native)" if floors else ""))
    figures = {}
    with torch.no_grad():
        for name, (native, routed) in cases.items():
            floor = floors.get(name)
            native(), routed()
            if floor is not None:
                floor()
            ns, fs, ls = [], [], []
            for _ in range(args.repeat):
                ns.append(timed(native, args.number))
                fs.append(timed(routed, args.number))
                if floor is not None:
                    ls.append(timed(floor, args.number))
            n, f = statistics.median(ns), statistics.median(fs)
            floor_ratio = statistics.median(b / a for a, b in zip(ns, ls)) if ls else None
            print(f"{name:<14}{n:>11.2f}{f:>11.2f}{f / n:>8.2f}"
                  + (f"{floor_ratio:>8.2f}" if ls else ""))
            figures[name] = {"native_ms": n, "flagos_ms": f, "ratio": f / n,
                             "ratios": sorted(b / a for a, b in zip(ns, fs)),
                             "floor_ratio": floor_ratio}
    write_json(args.json, "model_overhead", {"chip": info["chip"], "mode": info["mode"], "threads": args.threads,
                                             "repeat": args.repeat, "number": args.number,
                                             "models": figures})


if __name__ == "__main__":
    main()

"""Compiled-graph overhead: flagos / native time ratio of models under torch.compile.

    python benchmarks/compile_overhead.py [--chip cpu] [--repeat 15] [--number 20]
                                          [--compile-mode default|reduce-overhead|...]

Three small models with seeded random weights (no downloads), each compiled twice in the same
process: once over plain CPU tensors, once over flagos tensors. Inputs are on their device
before timing, so a call is the compiled graph alone: entering it (guards, unwrapping the
flagos inputs) and leaving it (wrapping the outputs, counting the call) is what flagos adds.
The two sides alternate, run by run, and the figures are medians. The script also prints what
Dynamo did on each side (graphs, recompilations, graph breaks), which must be the same, and
what the first call cost on each side: tracing and compiling the graph, each side with an empty
Inductor cache of its own (one compilation, so a single figure, not a median).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch._inductor.utils import fresh_cache

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import models  # noqa: E402
from _floor import traced_floor_module, traced_floor_tensor  # noqa: E402
from _timing import add_json_option, environment, write_json  # noqa: E402

import flagos  # noqa: E402


class LlamaBlock(torch.nn.Module):
    """One Llama decoder layer with its rotary embedding, as a model runs it."""

    def __init__(self, seed: int = 0):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64)
        config._attn_implementation = "sdpa"
        self.rotary = LlamaRotaryEmbedding(config)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return self.layer(x, position_embeddings=self.rotary(x, positions))


def cases(dev):
    """name -> (module factory, inputs on the CPU)."""
    ids, mask, _ = models.bert_batch()  # the tests' batch: 2 x 12 tokens
    return {
        "bert-tiny fwd": (models.bert, (), {"input_ids": ids, "attention_mask": mask}),
        "unet step": (lambda: models.ddpm_pipeline().unet.eval(),
                      (torch.randn(1, 3, 16, 16), torch.tensor([10])), {}),
        "llama block": (lambda: LlamaBlock().eval(), (torch.randn(1, 8, 64),), {}),
    }


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values()),
            "graph_breaks": sum(counters["graph_break"].values())}


def diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def timed(fn, args, kwargs, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn(*args, **kwargs)
    return (time.perf_counter() - start) / number * 1e3


def first_call(fn, args, kwargs) -> float:
    """Seconds of the first call (trace and compile), with an empty Inductor cache: neither
    side may load what the other compiled."""
    with fresh_cache():
        start = time.perf_counter()
        fn(*args, **kwargs)
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", default="cpu")
    p.add_argument("--repeat", type=int, default=31)
    p.add_argument("--number", type=int, default=10)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's intra-op threads (default 1: on a small shared machine, "
                        "threads waiting for a busy core swamp the per-call cost measured here)")
    p.add_argument("--compile-mode", default="default",
                   help="torch.compile's mode, for both sides (default, reduce-overhead, "
                        "max-autotune-no-cudagraphs, ...)")
    p.add_argument("--only", action="append", metavar="NAME",
                   help="time only this model (bert, unet, llama); repeatable")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the floor, a trivial traceable wrapper subclass compiled the "
                        "same way (default: on)")
    add_json_option(p)
    args = p.parse_args()

    os.environ.setdefault("FLAGOS_FALLBACK", "allow")
    torch.set_num_threads(args.threads)
    info = flagos.activate(args.chip, mode="device")
    dev = flagos.device()
    mode = None if args.compile_mode == "default" else args.compile_mode
    env = environment()
    print(f"machine: {env['machine']}; load average {env['load_average']}")
    print(f"chip {info['chip']}, device mode, torch.compile(mode={mode!r}); median of "
          f"{args.repeat} runs of {args.number} calls, native and flagos alternating")
    print("bert-tiny: hidden 32, 2 layers, batch 2 x 12 tokens; unet: the DDPM test UNet, 1 x 3 x "
          "16 x 16; llama block: one decoder layer (hidden 64, 4 heads, 2 kv heads), 1 x 8 tokens")
    print("ratio: of the medians; paired: the median of each run's flagos/native; floor: the "
          "paired ratio of a trivial traceable wrapper subclass; compile: the first call's "
          "seconds, native / flagos")
    print(f"{'model':<14}{'native ms':>11}{'flagos ms':>11}{'ratio':>8}{'paired':>8}"
          + (f"{'floor':>8}" if args.floor else "") + f"{'compile s':>14}   dynamo native | flagos")
    figures = {}
    with torch.no_grad():
        # Compilation's one-time imports and set-up, so the first model's native side does not pay them.
        first_call(torch.compile(lambda x: x * 2 + 1, mode=mode), (torch.ones(4),), {})
        for name, (make, inputs, kwargs) in cases(dev).items():
            if args.only and not any(o in name for o in args.only):
                continue
            native_net = torch.compile(make(), mode=mode)
            flagos_net = torch.compile(make().to(dev), mode=mode)
            f_inputs = tuple(t.to(dev) for t in inputs)
            f_kwargs = {k: v.to(dev) for k, v in kwargs.items()}
            before = dynamo_counts()
            native_compile = first_call(native_net, inputs, kwargs)
            for _ in range(2):  # the calls that settle (recompilations show here)
                native_net(*inputs, **kwargs)
            mid = dynamo_counts()
            flagos_compile = first_call(flagos_net, f_inputs, f_kwargs)
            for _ in range(2):
                flagos_net(*f_inputs, **f_kwargs)
            after = dynamo_counts()
            native_counts, flagos_counts = diff(mid, before), diff(after, mid)
            floor_net = None
            if args.floor:
                floor_net = torch.compile(traced_floor_module(make()), mode=mode)
                floor_inputs = tuple(traced_floor_tensor(t) for t in inputs)
                floor_kwargs = {k: traced_floor_tensor(v) for k, v in kwargs.items()}
                for _ in range(3):
                    floor_net(*floor_inputs, **floor_kwargs)
            settling = dynamo_counts()
            ns, fs, ls = [], [], []
            for _ in range(args.repeat):
                ns.append(timed(native_net, inputs, kwargs, args.number))
                fs.append(timed(flagos_net, f_inputs, f_kwargs, args.number))
                if floor_net is not None:
                    ls.append(timed(floor_net, floor_inputs, floor_kwargs, args.number))
            settled = diff(dynamo_counts(), settling)  # nothing may compile while timing
            n, f = statistics.median(ns), statistics.median(fs)
            paired = statistics.median(b / a for a, b in zip(ns, fs))
            floor_paired = statistics.median(b / a for a, b in zip(ns, ls)) if ls else None
            compile_text = f"{native_compile:.1f} / {flagos_compile:.1f}"
            print(f"{name:<14}{n:>11.3f}{f:>11.3f}{f / n:>8.2f}{paired:>8.2f}"
                  + (f"{floor_paired:>8.2f}" if ls else "") + f"{compile_text:>14}   "
                  f"{native_counts} | {flagos_counts}"
                  + (f"; while timing: {settled}" if any(settled.values()) else ""))
            figures[name] = {"native_ms": n, "flagos_ms": f, "ratio": f / n, "paired_ratio": paired,
                             "floor_ms": statistics.median(ls) if ls else None,
                             "floor_paired_ratio": floor_paired,
                             "ratios": sorted(b / a for a, b in zip(ns, fs)),
                             "compile_s": {"native": native_compile, "flagos": flagos_compile},
                             "dynamo_native": native_counts, "dynamo_flagos": flagos_counts,
                             "compiled_while_timing": settled}
    print(f"load average after: {list(os.getloadavg())}")
    write_json(args.json, "compile_overhead", {"chip": info["chip"], "compile_mode": args.compile_mode,
                                               "threads": args.threads,
                                               "repeat": args.repeat, "number": args.number,
                                               "models": figures})


if __name__ == "__main__":
    main()

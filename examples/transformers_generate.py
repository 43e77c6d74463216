"""A small GPT-2 on flagos: generate() and decode, then fp16 autocast training with GradScaler.

    python examples/transformers_generate.py [--device auto|cpu|sim|cuda|...] [--steps 3]

The model and its word-level tokenizer are built locally from a config with seeded random
weights (no downloads). Every result is compared with the same run on plain CPU.
"""
from __future__ import annotations

import argparse
import copy

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import flagos

WORDS = ("the a chip runs every model on one device and reports which operator fell back to "
         "host memory when kernels are missing").split()


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]",
                                   pad_token="[EOS]")


def build_model(vocab_size: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=1, eos_token_id=1, pad_token_id=1)
    return GPT2LMHeadModel(config).eval()


def generate(model, tokenizer, device) -> str:
    batch = tokenizer(["the chip runs"], return_tensors="pt").to(device)
    ids = model.generate(**batch, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(ids[0].tolist())


def train(model, tokenizer, device, steps: int) -> list[float]:
    """fp16 autocast with GradScaler; returns the losses."""
    model.train()
    torch.manual_seed(1)  # the same dropout masks on both sides (flagos draws from the host generator)
    kind = torch.device(device).type
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(kind, init_scale=2.0 ** 10)
    batch = tokenizer([" ".join(WORDS[:12]), " ".join(WORDS[6:18])], return_tensors="pt").to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(kind, dtype=torch.float16):
            loss = model(**batch, labels=batch["input_ids"]).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="chip (default: FLAGOS_DEVICE or auto)")
    parser.add_argument("--steps", type=int, default=3, help="fp16 training steps")
    args = parser.parse_args()

    info = flagos.activate(args.device)
    print(f"flagos {info['version']} on chip {info['chip']} ({info['mode']} mode), torch {info['torch']}")
    tokenizer = build_tokenizer()
    reference = build_model(len(tokenizer))
    model = copy.deepcopy(reference).to(flagos.device())

    text_cpu, text = generate(reference, tokenizer, "cpu"), generate(model, tokenizer, flagos.device())
    print(f"generated on {flagos.device()}: {text!r}")
    if text != text_cpu:
        raise SystemExit(f"flagos generated {text!r}, plain CPU {text_cpu!r}")

    flagos.reset_report()
    losses = train(model, tokenizer, flagos.device(), args.steps)
    ref_losses = train(reference, tokenizer, "cpu", args.steps)
    print("fp16 losses on flagos: " + ", ".join(f"{x:.4f}" for x in losses))
    print("fp16 losses on CPU:    " + ", ".join(f"{x:.4f}" for x in ref_losses))
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    print(f"max |loss difference| = {worst:.2e}")
    print(flagos.fallback_report())
    if worst > 1e-3:  # fp16 tolerance
        raise SystemExit(f"flagos training differs from plain CPU by {worst}")


if __name__ == "__main__":
    main()

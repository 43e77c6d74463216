"""What redirect_cuda costs per call: off, on, and the TorchFunctionMode it was chosen over.

    python benchmarks/redirect_overhead.py [--chip cpu] [--number 5000] [--repeat 7]

Three kinds of call on flagos tensors: an ordinary op (`a + b`: no device argument), a factory
with a device argument and `Tensor.to(device)`. Each is timed with the redirect off, with it
on ("cuda" spelled, so the argument is rewritten), and, for comparison, with the same
rewriting done by a TorchFunctionMode (which sees every torch call, ordinary ops included).
Medians of `repeat` runs of `number` calls, in µs per call. design.md §16.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(__file__))
from _timing import add_json_option, machine, median_us, write_json  # noqa: E402

import flagos  # noqa: E402
from flagos.integrations import _redirect  # noqa: E402


class RewritingMode(TorchFunctionMode):
    """The alternative: rewrite device arguments in a TorchFunctionMode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = _redirect._map(device)
        args = tuple(_redirect._map(a) if type(a) in (str, torch.device) else a for a in args)
        return func(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="cpu")
    parser.add_argument("--number", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=7)
    add_json_option(parser)
    args = parser.parse_args()
    flagos.activate(args.chip)
    dev = flagos.device()
    a, b = torch.randn(8, device=dev), torch.randn(8, device=dev)
    host = torch.randn(8)

    def calls(spelled):
        return {
            "a + b": lambda: a + b,
            "torch.randn(8, device=...)": lambda: torch.randn(8, device=spelled),
            "host.to(device)": lambda: host.to(spelled),
        }

    def time_all(spelled):
        return {k: median_us(fn, args.number, args.repeat) for k, fn in calls(spelled).items()}

    off = time_all(dev)
    flagos.activate(args.chip, redirect_cuda=True)
    on_native_name = time_all(dev)
    on_cuda_name = time_all("cuda")
    _redirect.uninstall()
    _redirect._target_type = "flagos"   # what install() set; the mode below uses it
    with RewritingMode():
        mode = time_all("cuda")
    print(f"# {machine()}; chip {args.chip}; µs per call (median of {args.repeat} x {args.number})")
    print(f"{'call':30s} {'off':>8s} {'on, flagos':>11s} {'on, cuda':>9s} {'mode, cuda':>11s}")
    for k in off:
        print(f"{k:30s} {off[k]:8.2f} {on_native_name[k]:11.2f} {on_cuda_name[k]:9.2f} {mode[k]:11.2f}")
    write_json(args.json, "redirect_overhead", {
        "chip": args.chip, "calls": {k: {"off_us": off[k], "on_flagos_us": on_native_name[k],
                                         "on_cuda_us": on_cuda_name[k], "mode_cuda_us": mode[k]}
                                     for k in off}})


if __name__ == "__main__":
    main()

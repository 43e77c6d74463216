"""Per-op dispatch overhead: median µs per op, native vs flagos, in one run.

    python benchmarks/dispatch_overhead.py [--chip cpu] [--mode device|native] [--number 2000] [--repeat 7]
                                           [--floor | --no-floor]

Small tensors, so the figure is the cost of routing an op, not of computing it; then ops of
realistic size (a UNet's conv2d, attention, group_norm), where the overhead is what a model pays.

The floor (on by default, `--no-floor` skips it) is the least any tensor-subclass device layer
pays, measured in the same run: a trivial wrapper subclass whose `__torch_dispatch__` is C
(`flagos._C.floor_dispatch`, a test-only entry): it unwraps `_payload`, calls the op
(`func._op`, as the router does) and wraps each tensor output with `_make_wrapper_subclass`
(layer_norm's aten op has three); no table, routes or checks. Its per-op figure is printed
beside flagos's; its median is taken over the one-output ops, as flagos's "same ops" figure,
and the layer_norm / add ratio is printed for both, since three wrappers cost the floor too.

The native side runs where the chip's payloads live: on the CPU for the cpu chip and C-ABI
chips, on the chip's own device for a torch-native accelerator (`--chip cuda`: plain CUDA
tensors, synchronized at the end of each run as the flagos side is), and the floor wraps
tensors there too.

On a C-ABI chip (sim, opencl) the time inside the adapter's kernels is counted by the adapter
object (`Adapter.kernel_times()`) and printed apart, per op call ("kernel µs"), with the
overhead less that time: the cost of the path to the kernel, not of sim's plain C loops. On an
asynchronous chip the kernel's own time is its launch; the queue's work is in the flagos time.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _floor import floor_available, floor_tensor  # noqa: E402
from _timing import add_json_option, machine, median_us, write_json  # noqa: E402

import flagos  # noqa: E402
from flagos.chips.adapter import AdapterChip  # noqa: E402
from flagos.core import _state  # noqa: E402

OPS = {
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "add_": lambda a, b: a.add_(b),  # in-place, as in optimizer steps
    "relu": lambda a, b: torch.relu(a),
    "view": lambda a, b: a.view(-1),
    "mm": lambda a, b: a @ b,
    "sum": lambda a, b: a.sum(),
    "softmax": lambda a, b: torch.softmax(a, -1),
    "layer_norm": lambda a, b: torch.nn.functional.layer_norm(a, (8,)),
}

# ops whose aten call has one tensor output (layer_norm's has three): the medians beside the floor
FLOOR_OPS = [name for name in OPS if name != "layer_norm"]


F = torch.nn.functional
# name -> (inputs, op): the shapes of a DDPM-cifar10-sized UNet's middle blocks
REALISTIC = {
    "conv2d 1x256x8x8": ((torch.randn(1, 256, 8, 8), torch.randn(256, 256, 3, 3)),
                         lambda x, w: F.conv2d(x, w, padding=1)),
    # three tensors, not one three times: the flagos side gets three payloads, and q = k = v in
    # the cache would flatter the native side by ~100 µs
    "sdpa 1x8x128x64": (tuple(torch.randn(1, 8, 128, 64) for _ in range(3)),
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v)),
    "group_norm 1x256x8x8": ((torch.randn(1, 256, 8, 8),), lambda x: F.group_norm(x, 32)),
}


def plain_device(chip_name: str) -> torch.device:
    """Where plain PyTorch runs the native side: the payload device of a torch-native chip
    whose payloads are not host tensors, else the CPU."""
    chip = flagos.chips.profile(chip_name) if chip_name in flagos.chips.known() else None
    if chip is not None and chip.torch_type and not chip.payload_is_host:
        return chip.torch_device(0)
    return torch.device("cpu")


def kernel_clock(chip):
    """Seconds spent inside the adapter's kernels so far (0 on a chip without an adapter)."""
    if not isinstance(chip, AdapterChip) or not hasattr(chip.adapter, "kernel_times"):
        return lambda: 0.0
    return lambda: sum(seconds for _, _, seconds in chip.adapter.kernel_times())


def _median(values):
    return sorted(values)[len(values) // 2]


def timed_calls(number: int, repeat: int) -> int:
    """The calls median_us makes: its warm-up and `repeat` runs of `number`."""
    return max(number // 10, 3) + number * repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", default="cpu")
    p.add_argument("--mode", default=None, choices=("device", "native"))
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the floor, a trivial C-dispatch wrapper (default: on)")
    add_json_option(p)
    args = p.parse_args()
    torch.set_num_threads(1)

    plain = plain_device(args.chip)
    plain_sync = None if plain.type == "cpu" else getattr(torch, plain.type).synchronize
    host = torch.randn(8, 8), torch.randn(8, 8)
    base = tuple(t.to(plain) for t in host)
    native = {name: median_us(lambda f=f: f(*base), args.number, args.repeat, plain_sync)
              for name, f in OPS.items()}
    floor = {}
    if args.floor and floor_available():
        wrapped = tuple(floor_tensor(t) for t in base)
        floor = {name: median_us(lambda f=f: f(*wrapped), args.number, args.repeat, plain_sync)
                 for name, f in OPS.items()}
    info = flagos.activate(args.chip, mode=args.mode)
    os.environ["FLAGOS_FALLBACK"] = "allow"
    dev = flagos.device()
    sync = getattr(torch, dev.type).synchronize  # torch.flagos (device mode) or the chip's module
    on_chip = tuple(t.to(dev) for t in host)
    kernel_seconds = kernel_clock(_state.active().chip)
    routed, kernel = {}, {}
    for name, f in OPS.items():
        before = kernel_seconds()
        routed[name] = median_us(lambda f=f: f(*on_chip), args.number, args.repeat, sync)
        kernel[name] = (kernel_seconds() - before) * 1e6 / timed_calls(args.number, args.repeat)
    real = {}
    for name, (inputs, f) in REALISTIC.items():
        moved = tuple(t.to(dev) for t in inputs)
        inputs = tuple(t.to(plain) for t in inputs)
        sides = {"native": (inputs, plain_sync), "flagos": (moved, sync)}
        if floor:
            sides["floor"] = (tuple(floor_tensor(t) for t in inputs), plain_sync)
        number = max(args.number // 20, 20)
        # interleaved: the sides alternate within each round, so a load change hits all of them,
        # and each overhead is the median of the rounds' own differences
        rounds = [{side: median_us(lambda f=f, xs=xs: f(*xs), number, 1, s)
                   for side, (xs, s) in sides.items()} for _ in range(args.repeat)]
        real[name] = {side: _median([r[side] for r in rounds]) for side in sides}
        for side in sides.keys() - {"native"}:
            real[name][side + "_overhead"] = _median([r[side] - r["native"] for r in rounds])

    print(f"machine: {machine()}")
    print(f"chip {info['chip']}, {info['mode']} mode; native on {plain.type}; 8x8 float32; "
          f"median of {args.repeat} x {args.number} calls")
    has_kernels = any(kernel.values())
    print(f"{'op':<12}{'native µs':>11}{'flagos µs':>11}{'overhead µs':>13}{'ratio':>8}"
          + (f"{'floor over µs':>15}" if floor else "")
          + (f"{'kernel µs':>11}{'overhead - kernel':>19}" if has_kernels else ""))
    for name in OPS:
        n, f = native[name], routed[name]
        fl = f"{floor[name] - n:>15.2f}" if name in floor else ("" if not floor else f"{'-':>15}")
        k = f"{kernel[name]:>11.2f}{f - n - kernel[name]:>19.2f}" if has_kernels else ""
        print(f"{name:<12}{n:>11.2f}{f:>11.2f}{f - n:>13.2f}{f / n:>8.2f}{fl}{k}")
    over = sorted(routed[k] - native[k] for k in OPS)
    print(f"median overhead per op: {over[len(over) // 2]:.2f} µs")
    if has_kernels:
        path = sorted(routed[k] - native[k] - kernel[k] for k in OPS)
        print(f"median overhead less the time inside the adapter's kernels: "
              f"{path[len(path) // 2]:.2f} µs")
    if floor:
        low = sorted(floor[k] - native[k] for k in FLOOR_OPS)
        same = sorted(routed[k] - native[k] for k in FLOOR_OPS)
        print(f"floor (trivial C-dispatch wrapper), median over {len(FLOOR_OPS)} one-output ops: "
              f"{low[len(low) // 2]:.2f} µs over native (flagos on the same ops: "
              f"{same[len(same) // 2]:.2f} µs)")
        ratio = {side: (t["layer_norm"] - native["layer_norm"]) / (t["add"] - native["add"])
                 for side, t in (("flagos", routed), ("floor", floor))}
        print(f"layer_norm / add overhead (three outputs against one): flagos {ratio['flagos']:.2f}, "
              f"floor {ratio['floor']:.2f}")
    print(f"\n{'realistic op':<22}{'native µs':>11}{'flagos µs':>11}{'overhead µs':>13}{'ratio':>8}"
          + (f"{'floor over µs':>15}" if floor else ""))
    for name, r in real.items():
        print(f"{name:<22}{r['native']:>11.1f}{r['flagos']:>11.1f}{r['flagos_overhead']:>13.1f}"
              f"{r['flagos'] / r['native']:>8.2f}"
              + (f"{r['floor_overhead']:>15.1f}" if floor else ""))
    print("(realistic ops: the overhead is the median of each round's difference, native, flagos "
          "and the floor interleaved)")
    write_json(args.json, "dispatch_overhead", {
        "chip": info["chip"], "mode": info["mode"], "native_device": plain.type, "number": args.number, "repeat": args.repeat,
        "small_ops": {name: {"native_us": native[name], "flagos_us": routed[name],
                             "floor_us": floor.get(name), "kernel_us": kernel[name]}
                      for name in OPS},
        "median_overhead_us": over[len(over) // 2],
        "median_overhead_less_kernel_us": sorted(routed[k] - native[k] - kernel[k]
                                                 for k in OPS)[len(OPS) // 2],
        "floor_median_overhead_us": (sorted(floor[k] - native[k] for k in FLOOR_OPS)[len(FLOOR_OPS) // 2]
                                     if floor else None),
        "realistic_ops": {name: {"native_us": r["native"], "flagos_us": r["flagos"],
                                 "overhead_us": r["flagos_overhead"],
                                 "floor_overhead_us": r.get("floor_overhead")}
                          for name, r in real.items()},
    })


if __name__ == "__main__":
    main()

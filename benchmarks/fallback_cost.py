"""Cost of the CPU fallback: its host round trip against the same work done by hand, in one run.

    python benchmarks/fallback_cost.py [--chip sim] [--repeat 9] [--json PATH]

For each size, `neg` is forced onto the fallback route, so one call moves the tensor to the
host, negates it there and moves the result back. The same work done by hand on the host, a
`copy_` in, the `neg`, a `copy_` out (memcpy-class copies into tensors that already exist), is
the ideal; efficiency = ideal time / fallback time (1.0: the fallback costs no more than two
copies and the op). The three are timed interleaved, one round after the other, so a load
change on the machine hits all of them; min / median / max over the rounds are printed. Every
figure is a ratio of positive times: nothing divides by a difference that could be <= 0.

Beside it, the ceiling any tensor-subclass device layer has here: the same work by hand with the
`neg` called through the floor (benchmarks/_floor.py, a trivial C-dispatch wrapper), so its
dispatch cost is in; ceiling = ideal / that time. A fallback cannot beat it, whatever its copies.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _floor import floor_available, floor_tensor  # noqa: E402
from _timing import add_json_option, machine, median_us, spread, write_json  # noqa: E402

import flagos  # noqa: E402

SIZES = {"64 KiB": 16 * 1024, "1 MiB": 256 * 1024, "16 MiB": 4 * 1024 * 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", default="sim")
    p.add_argument("--repeat", type=int, default=9, help="interleaved rounds (default 9)")
    add_json_option(p)
    args = p.parse_args()
    torch.set_num_threads(1)  # OpenMP threads spinning on a busy core would time the machine's load
    os.environ["FLAGOS_FALLBACK"] = "allow"
    info = flagos.activate(args.chip)
    dev = flagos.device()
    flagos.set_route("aten::neg", "fallback")
    print(f"machine: {machine()}")
    print(f"chip {info['chip']} ({info['mode']} mode); float32; {args.repeat} interleaved rounds")
    with_floor = floor_available()
    print(f"{'size':<8}{'copy MB/s':>11}{'ideal µs':>10}{'fallback µs':>13}"
          f"{'efficiency min / median / max':>32}" + (f"{'ceiling':>9}" if with_floor else ""))
    figures = {}
    for label, n in SIZES.items():
        number = max(3, 2_000_000 // n)
        src, staged, result = torch.randn(n), torch.empty(n), torch.empty(n)
        on_chip = src.to(dev)

        def by_hand(src=src, staged=staged, result=result):
            staged.copy_(src)
            result.copy_(torch.neg(staged))

        floor_staged = floor_tensor(staged)

        def through_floor(src=src, staged=staged, result=result, wrapped=floor_staged):
            staged.copy_(src)
            result.copy_(torch.neg(wrapped)._payload)

        copies, ideal, fallback, floor = [], [], [], []
        flagos.reset_report()
        for _ in range(args.repeat):
            copies.append(median_us(lambda s=src, d=staged: d.copy_(s), number, 1))
            ideal.append(median_us(by_hand, number, 1))
            fallback.append(median_us(lambda t=on_chip: torch.neg(t), number, 1))
            if with_floor:
                floor.append(median_us(through_floor, number, 1))
        row = flagos.fallback_report().op("aten::neg")
        calls = row["calls"]["fallback"]
        moved = (row["bytes_to_host"] + row["bytes_to_device"]) / calls  # bytes per call
        efficiency = spread([i / f for i, f in zip(ideal, fallback)])
        copy_mbs = src.nbytes / spread(copies)["median"]
        ceiling = spread([i / f for i, f in zip(ideal, floor)]) if floor else None
        figures[label] = {"bytes": src.nbytes, "bytes_moved_per_call": moved,
                          "host_copy_mb_s": copy_mbs, "ideal_us": spread(ideal),
                          "fallback_us": spread(fallback), "efficiency": efficiency,
                          "floor_us": spread(floor) if floor else None, "ceiling": ceiling}
        print(f"{label:<8}{copy_mbs:>11.0f}{spread(ideal)['median']:>10.1f}"
              f"{spread(fallback)['median']:>13.1f}"
              f"{efficiency['min']:>12.2f} / {efficiency['median']:.2f} / {efficiency['max']:.2f}"
              + (f"{ceiling['median']:>9.2f}" if ceiling else ""))
    print("ideal = host copy_ in + neg + copy_ out into existing tensors; efficiency = ideal / "
          "fallback time, per round" + ("; ceiling = ideal / the same with neg dispatched "
                                        "through the floor (median)" if with_floor else ""))
    write_json(args.json, "fallback_cost", {"chip": info["chip"], "mode": info["mode"],
                                            "repeat": args.repeat, "sizes": figures})


if __name__ == "__main__":
    main()

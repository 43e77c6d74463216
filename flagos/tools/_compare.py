"""Compare every module's outputs of one model on two chips, and name the first that diverges.

    flagos compare bert --chip sim --ref torch-cpu
    flagos compare my_model.py:build --chip sim --ref cpu --dtype float16 --upcast --json out.json

Both chips run the same model with the same weights and inputs; forward hooks record each
module's outputs, named by module path and call index ("encoder.layer.0.attention#0"). Per
module: cosine similarity, max absolute error, max relative error (|chip - ref| / |ref|, |ref|
floored at 1e-6) and RMSE. A module fails if cosine < 0.99 and max abs err > 1e-3, or
cosine < 0.9, or max abs err > 1, or NaN/inf appears on one side only (or the two runs disagree
on shapes or on which modules ran). The ref chip `torch-cpu` is plain PyTorch without flagos;
`--upcast` runs the reference in float64. Exit codes: 0 every module passed, 1 a module failed or
a chip could not run, 2 usage.
"""
from __future__ import annotations

import concurrent.futures
import math
import os
import sys
import tempfile

import torch

import flagos

from . import _childrun, _models
from ._common import format_table, non_negative_int, positive_int, write_json

THRESHOLDS = {"cosine": 0.99, "max_abs_err": 1e-3, "cosine_floor": 0.9, "max_abs_err_ceiling": 1.0}
_REL_FLOOR = 1e-6
ROOT = "(model)"


def add_arguments(parser) -> None:
    parser.add_argument("model", help="mlp, cnn, bert, unet, ddpm, or path/to/file.py:function")
    parser.add_argument("--chip", default="auto", help="the chip under test (default: auto)")
    parser.add_argument("--ref", default=_childrun.REFERENCE,
                        help="the reference chip (default: torch-cpu, plain PyTorch without "
                             "flagos; 'cpu' is flagos's cpu chip)")
    parser.add_argument("--upcast", action="store_true",
                        help="run the reference in float64")
    parser.add_argument("--dtype", default="float32",
                        help="dtype of the run on --chip (and on --ref without --upcast): "
                             "float32, float16, bfloat16, float64 (default float32)")
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs")
    parser.add_argument("--show", type=non_negative_int, default=20,
                        help="module rows to print, 0 for all (default 20: from the first "
                             "failure on, or the lowest cosines when all pass)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")


# ---- recording, inside the process that runs a chip ---------------------------------------

def _hook_every_module(model: torch.nn.Module, records: dict, order: list, types: dict):
    calls: dict[str, int] = {}
    handles = []
    for path, module in model.named_modules():
        name = path or ROOT

        def hook(mod, args, output, name=name):
            call = calls.get(name, 0)
            calls[name] = call + 1
            # a copy on the host: later in-place ops (ReLU(inplace=True)) must not change it
            tensors = [t.detach().to("cpu", copy=True) for t in _models.output_tensors(output)]
            if tensors:
                key = f"{name}#{call}"
                order.append(key)
                records[key] = tensors
                types[key] = type(mod).__name__
        handles.append(module.register_forward_hook(hook))
    return handles


def record(chip: str, out_path: str, model: str | None = None, pickled: str | None = None,
           batch: int = 1, seed: int = 0, dtype: str = "float32") -> dict:
    """Run the model once on `chip` with every module hooked; the outputs go to `out_path`
    (torch.save), what ran where comes back."""
    device = _childrun.device_for(chip)
    if pickled is not None:
        net, inputs = torch.load(pickled, weights_only=False)
        call = _models.call_module
    else:
        work = _models.load(model, batch, seed)
        net, inputs, call = work.model, work.inputs, work.call
    torch_dtype = _models.parse_dtype(dtype)
    net = _models.cast_model(net.eval(), device, torch_dtype)
    inputs = _models.move(inputs, device, torch_dtype)
    records, order, types = {}, [], {}
    handles = _hook_every_module(net, records, order, types)
    on_flagos = chip != _childrun.REFERENCE
    if on_flagos:
        flagos.reset_report()
    try:
        with torch.no_grad():
            call(net, inputs)
        _childrun.synchronize(chip)
    finally:
        for h in handles:
            h.remove()
    torch.save({"order": order, "records": records, "types": types}, out_path)
    run = {"chip": _childrun.chip_name(chip), "device": str(device), "dtype": dtype}
    if on_flagos:
        rows = flagos.fallback_report().rows
        run["fallback_ops"] = [r["op"] for r in rows if r["calls"]["fallback"]]
        run["override_ops"] = [r["op"] for r in rows if r["calls"]["override"]]
    return run


# ---- judging -----------------------------------------------------------------------------

def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    parts = [torch.view_as_real(t) if t.is_complex() else t for t in tensors]
    return torch.cat([p.reshape(-1).to(torch.float64) for p in parts])


def _number(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def judge(chip_out: list[torch.Tensor], ref_out: list[torch.Tensor]) -> dict:
    """Metrics and verdict for one module call's outputs."""
    shapes = [list(t.shape) for t in chip_out]
    ref_shapes = [list(t.shape) for t in ref_out]
    row = {"shapes": shapes, "cosine": None, "max_abs_err": None, "max_rel_err": None,
           "rmse": None, "nonfinite_chip": 0, "nonfinite_ref": 0}
    if shapes != ref_shapes:
        return {**row, "passed": False, "reason": f"shapes differ: {shapes} vs ref {ref_shapes}"}
    a, b = _flat(chip_out), _flat(ref_out)
    fin_a, fin_b = torch.isfinite(a), torch.isfinite(b)
    row["nonfinite_chip"], row["nonfinite_ref"] = int((~fin_a).sum()), int((~fin_b).sum())
    both = fin_a & fin_b
    a_f, b_f = a[both], b[both]
    diff = (a_f - b_f).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    norms = float(a_f.norm()) * float(b_f.norm())
    if norms > 0:
        cosine = max(-1.0, min(1.0, float((a_f * b_f).sum()) / norms))  # rounding past 1
    else:  # a zero vector: same only if both are zero
        cosine = 1.0 if max_abs == 0 else 0.0
    if diff.numel():
        max_rel = float((diff / b_f.abs().clamp_min(_REL_FLOOR)).max())
        rmse = float(diff.pow(2).mean().sqrt())
    else:
        max_rel = rmse = 0.0
    row.update(cosine=cosine, max_abs_err=max_abs, max_rel_err=max_rel, rmse=rmse)
    # NaN/inf in the same places with the same values on both sides is agreement
    one_sided = (fin_a != fin_b) | (~fin_a & ~fin_b & (a != b) & ~(a.isnan() & b.isnan()))
    t = THRESHOLDS
    if bool(one_sided.any()):
        where = "chip" if row["nonfinite_chip"] > row["nonfinite_ref"] else "ref"
        reason = f"NaN/inf on one side only (more on {where})"
    elif cosine < t["cosine_floor"]:
        reason = f"cosine {cosine:.4f} < {t['cosine_floor']}"
    elif max_abs > t["max_abs_err_ceiling"]:
        reason = f"max abs err {max_abs:.3g} > {t['max_abs_err_ceiling']}"
    elif cosine < t["cosine"] and max_abs > t["max_abs_err"]:
        reason = (f"cosine {cosine:.4f} < {t['cosine']} and max abs err {max_abs:.3g} > "
                  f"{t['max_abs_err']}")
    else:
        reason = None
    return {**row, "passed": reason is None, "reason": reason}


def _rows(chip_rec: dict, ref_rec: dict) -> list[dict]:
    """One row per module call, in the chip's execution order (then calls only the ref made)."""
    rows = []
    keys = chip_rec["order"] + [k for k in ref_rec["order"] if k not in chip_rec["records"]]
    for key in keys:
        name, _, call = key.rpartition("#")
        row = {"name": key, "module": name, "call": int(call),
               "type": chip_rec["types"].get(key) or ref_rec["types"].get(key)}
        if key not in ref_rec["records"]:
            row.update(passed=False, reason="ran on the chip only")
        elif key not in chip_rec["records"]:
            row.update(passed=False, reason="ran on the reference only")
        else:
            row.update(judge(chip_rec["records"][key], ref_rec["records"][key]))
        rows.append({k: _number(v) if isinstance(v, float) else v for k, v in row.items()})
    return rows


# ---- the whole comparison ----------------------------------------------------------------

def compare(model, inputs=None, chip: str = "auto", ref: str = _childrun.REFERENCE,
            upcast: bool = False, dtype: str = "float32", batch: int = 1, seed: int = 0) -> dict:
    """Run `model` on `chip` and `ref` and compare every module's outputs.

    model: an nn.Module (with `inputs`: a tensor, a tuple of positional or a dict of keyword
    arguments), or a workload name / "path.py:function" as on the command line. A chip other
    than the one active here runs in a child process, which receives the model by pickling
    (its class must be importable there). Returns the result dict ("passed", "first_failure",
    "modules", ...); raises ValueError for bad arguments and ChildError when a chip cannot run.
    """
    chip, ref = _childrun.check_chip(chip), _childrun.check_chip(ref)
    _models.parse_dtype(dtype)
    if batch < 1:
        raise ValueError(f"batch must be at least 1, not {batch}")
    with tempfile.TemporaryDirectory(prefix="flagos-compare-") as tmp:
        source = {}
        if isinstance(model, torch.nn.Module):
            if inputs is None:
                raise ValueError("compare(model, inputs): inputs are needed with a module "
                                 "(a tensor, a tuple of arguments or a dict of keyword arguments)")
            source["pickled"] = os.path.join(tmp, "model.pt")
            try:
                torch.save((model, inputs), source["pickled"])
            except Exception as e:
                raise ValueError(f"the model cannot be pickled for the other process ({e}); "
                                 f"define its class in an importable module, or pass "
                                 f"'path.py:function' instead") from e
            label = type(model).__name__
        elif isinstance(model, str):
            _models.check_spec(model)
            source.update(model=model, batch=batch, seed=seed)
            label = model
        else:
            raise ValueError(f"model must be an nn.Module or a workload name, not "
                             f"{type(model).__name__}")
        ref_dtype = "float64" if upcast else dtype
        sides = {"chip": (chip, dtype), "ref": (ref, ref_dtype)}

        def run_side(side):
            name, side_dtype = sides[side]
            return _childrun.call(name, f"{__name__}:record", dtype=side_dtype,
                                  out_path=os.path.join(tmp, f"{side}.pt"), **source)

        # Child processes run side by side (timing does not matter here); a side that runs
        # in this process stays on this thread.
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            pending = {side: pool.submit(run_side, side) for side in sides
                       if not _childrun.runs_here(sides[side][0])}
            runs = {side: run_side(side) for side in sides if side not in pending}
            runs.update({side: future.result() for side, future in pending.items()})
        recs = {side: torch.load(os.path.join(tmp, f"{side}.pt"), weights_only=True)
                for side in sides}
    rows = _rows(recs["chip"], recs["ref"])
    failed = [r for r in rows if not r["passed"]]
    return {"model": label, "chip": runs["chip"]["chip"], "ref": runs["ref"]["chip"],
            "dtype": dtype, "ref_dtype": ref_dtype, "upcast": upcast, "batch": batch,
            "seed": seed, "thresholds": THRESHOLDS, "passed": not failed and bool(rows),
            "compared": len(rows), "failed": len(failed),
            "first_failure": failed[0] if failed else None,
            "chip_run": runs["chip"], "ref_run": runs["ref"], "modules": rows}


# ---- output ------------------------------------------------------------------------------

def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _shown(rows: list[dict], show: int) -> list[dict]:
    if show <= 0 or len(rows) <= show:
        return rows
    first = next((i for i, r in enumerate(rows) if not r["passed"]), None)
    if first is not None:
        return rows[first:first + show]
    worst = sorted(range(len(rows)), key=lambda i: rows[i]["cosine"] if rows[i]["cosine"]
                   is not None else -2)[:show]
    return [rows[i] for i in sorted(worst)]


def format_result(data: dict, show: int = 20) -> str:
    rows = _shown(data["modules"], show)
    table = format_table(
        ["module", "type", "cosine", "max abs err", "max rel err", "rmse", "verdict"],
        [[r["name"], r["type"], _fmt(r.get("cosine"), ".6f"), _fmt(r.get("max_abs_err"), ".3g"),
          _fmt(r.get("max_rel_err"), ".3g"), _fmt(r.get("rmse"), ".3g"),
          "ok" if r["passed"] else f"FAIL: {r['reason']}"] for r in rows])
    ref = data["ref"] + (" (float64)" if data["upcast"] else "")
    lines = [f"compare {data['model']}: {data['chip']} ({data['dtype']}) vs {ref}", ""]
    if len(rows) < len(data["modules"]):
        what = "from the first failure" if data["failed"] else "with the lowest cosine"
        lines.append(f"{len(rows)} of {len(data['modules'])} module calls, {what} "
                     f"(--show 0 for all):")
    lines += [table, ""]
    for label, key in (("fell back to the CPU", "fallback_ops"),
                       ("ran an override", "override_ops")):
        ops = data["chip_run"].get(key)
        if ops:
            lines.append(f"ops that {label} on {data['chip']}: {', '.join(ops)}")
    lines.append(f"{data['compared']} module calls compared, {data['failed']} failed")
    first = data["first_failure"]
    if first is None:
        lines.append("PASS" if data["passed"] else "FAIL: no module produced a tensor")
    else:
        lines.append(f"FAIL: first failing module in execution order: {first['module']} "
                     f"({first['type']}, call {first['call']}): {first['reason']}")
    return "\n".join(lines)


def run(args) -> int:
    try:
        data = compare(args.model, chip=args.chip, ref=args.ref, upcast=args.upcast,
                       dtype=args.dtype, batch=args.batch, seed=args.seed)
    except ValueError as e:
        print(f"flagos compare: {e}", file=sys.stderr)
        return 2
    except _childrun.ChildError as e:
        print(f"flagos compare: {e}", file=sys.stderr)
        if args.json:
            write_json({"model": args.model, "passed": False, "error": str(e)}, args.json)
        return 1
    if args.json != "-":
        print(format_result(data, args.show))
    if args.json:
        write_json(data, args.json)
    return 0 if data["passed"] else 1

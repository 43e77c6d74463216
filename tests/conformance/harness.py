"""Run one OpInfo case on plain CPU and on the flagos device and compare.

A case is (op, variant, dtype, direction); direction is "fwd" (forward values), "inf" (the
forward under inference mode on both sides, inputs made outside it) or "bwd"
(forward then gradients of the inputs for a fixed, seeded grad_output). The outcome of a case is
the worst over its samples: crash > error > mismatch > stride > pass; "skip" when the case has
nothing to compare (random op, no differentiable output).

This module is imported by the worker processes (worker.py); it never activates flagos itself.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import types

import torch
from torch.utils import _pytree as pytree

try:
    import expecttest  # noqa: F401  (torch.testing._internal needs it only as a test base class)
except ImportError:
    _stub = types.ModuleType("expecttest")
    import unittest

    class TestCase(unittest.TestCase):
        pass

    _stub.TestCase = TestCase
    sys.modules["expecttest"] = _stub

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "complex64": torch.complex64, "int64": torch.int64}
BWD_DTYPES = ("float32", "complex64")
RANK = {"pass": 0, "skip": 0, "stride": 1, "mismatch": 2, "error": 3, "crash": 4}

# FlagGems' RESOLUTION table as rtol per result dtype; atol for fp32 as the
# issue asks. Complex results use their real dtype's; float64 results (a float32 op may return
# them) get the fp32 tolerances; integer and bool results must be exact.
TOL = {torch.float32: (1e-5, 1.3e-6), torch.complex64: (1e-5, 1.3e-6),
       torch.float64: (1e-5, 1.3e-6), torch.complex128: (1e-5, 1.3e-6),
       torch.float16: (1e-3, 1e-3), torch.complex32: (1e-3, 1e-3),
       torch.bfloat16: (1.6e-2, 1.6e-2)}

# Ops whose values are uninitialized memory: only dtype, shape and strides are compared.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                 "empty_permuted", "torch.empty", "nn.functional.feature_alpha_dropout"}

MAX_SAMPLES = int(os.environ.get("CONFORMANCE_SAMPLES", "4"))


def case_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


_OPS = None


def ops() -> dict:
    """op_db by case key (name[.variant]), in op_db order."""
    global _OPS
    if _OPS is None:
        from torch.testing._internal.common_methods_invocations import op_db
        _OPS = {case_key(op): op for op in op_db}
    return _OPS


def cases(op, dtypes=tuple(DTYPES), directions=("fwd", "bwd", "inf")):
    """(dtype, direction) pairs the op supports on CPU among the requested ones."""
    supported = op.supported_dtypes("cpu")
    for name in dtypes:
        if DTYPES[name] not in supported:
            continue
        if "fwd" in directions:
            yield name, "fwd"
        if "inf" in directions:
            yield name, "inf"
        if "bwd" in directions and name in BWD_DTYPES and op.supports_autograd:
            yield name, "bwd"


class Fail(Exception):
    def __init__(self, outcome, message):
        super().__init__(message)
        self.outcome = outcome


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# Ops whose samples build some tensor arguments on the CPU whatever the device under test
# (OpInfo writes `torch.tensor(...)` without a device): only their input moves.
CPU_ARGS = {"tensor_split"}


def _copy(v, dev):
    """v on dev with the same storage extent, offset and strides: a sample that reaches
    outside its view (as_strided.partial_views) or has overlapping strides stays the same."""
    if v.layout != torch.strided or v.is_conj() or v.is_neg():
        return v.detach().to(dev, copy=True)
    n = v.untyped_storage().nbytes() // v.element_size()
    if v.is_contiguous() and not v.storage_offset() and n == v.numel():
        return v.detach().to(dev, copy=True)
    whole = torch.empty(0, dtype=v.dtype).set_(v.untyped_storage(), 0, (n,), (1,))
    return whole.to(dev, copy=True).as_strided(v.shape, v.stride(), v.storage_offset())


def _to_device(tree, dev, memo, grad):
    """The sample's tensors on the flagos device (same aliasing, requires_grad kept for bwd);
    the sample's own device ("cpu", torch.device("cpu")) becomes the flagos device, as
    sample_inputs(device) would have written it."""
    def move(v):
        if isinstance(v, torch.Tensor):
            if id(v) not in memo:
                t = _copy(v, dev)
                if grad and v.requires_grad:
                    t = t.detach().requires_grad_()
                memo[id(v)] = t
            return memo[id(v)]
        if isinstance(v, torch.device) or (isinstance(v, str) and v == "cpu"):
            return dev
        return v
    return pytree.tree_map(move, tree)


def _clone(tree):
    return pytree.tree_map(lambda v: _copy(v, "cpu") if isinstance(v, torch.Tensor) else v, tree)


def _call(op, args, kwargs, seed):
    torch.manual_seed(seed)
    return op(args[0], *args[1:], **kwargs)


def _compare_leaf(i, got, want, on_device, values=True):
    """Raises Fail on the first difference of one output leaf."""
    where = f"output {i}"
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise Fail("mismatch", f"{where}: got {type(got).__name__}, expected Tensor")
        if on_device and want.device.type == "cpu" and got.device.type != "flagos":
            raise Fail("mismatch", f"{where}: on {got.device}, expected the flagos device")
        if got.dtype != want.dtype:
            raise Fail("mismatch", f"{where}: dtype {got.dtype}, expected {want.dtype}")
        if got.shape != want.shape:
            raise Fail("mismatch", f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if want.layout != torch.strided:
            return
        host = got.detach().cpu()
        if values:
            atol, rtol = TOL.get(want.dtype, (0, 0))
            try:
                torch.testing.assert_close(host, want.detach(), atol=atol, rtol=rtol, equal_nan=True,
                                           check_device=False, check_stride=False)
            except AssertionError as exc:
                lines = [s.strip() for s in str(exc).splitlines() if s.strip()]
                raise Fail("mismatch", f"{where}: " + "; ".join(lines[:3])) from None
        return host
    if isinstance(got, torch.Tensor):
        raise Fail("mismatch", f"{where}: got Tensor, expected {type(want).__name__}")
    if isinstance(want, float) and isinstance(got, float):
        if not (math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5)
                or (math.isnan(got) and math.isnan(want))):
            raise Fail("mismatch", f"{where}: {got!r}, expected {want!r}")
    elif got != want and not (isinstance(want, complex) and abs(got - want) <= 1e-5 * (1 + abs(want))):
        raise Fail("mismatch", f"{where}: {got!r}, expected {want!r}")
    return None


def _dense(t) -> bool:
    """Non-overlapping and dense: the dimensions, ordered by stride, tile memory exactly."""
    expected = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st != expected:
            return False
        expected *= n
    return True


def _check_strides(i, got, want):
    if (isinstance(want, torch.Tensor) and want.layout == torch.strided and want.numel() > 1
            and _dense(want)):
        # only dimensions longer than 1 have strides that mean something
        if any(n > 1 and a != b for n, a, b in zip(want.shape, got.stride(), want.stride())):
            raise Fail("stride", f"output {i}: strides {got.stride()}, expected {want.stride()} "
                       f"(shape {tuple(want.shape)})")


def _compare(got, want, on_device, values=True):
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    if len(got_leaves) != len(want_leaves):
        raise Fail("mismatch", f"{len(got_leaves)} outputs, expected {len(want_leaves)}")
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        _compare_leaf(i, g, w, on_device, values)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        _check_strides(i, g, w)


def _random(op, args) -> bool:
    """Whether the op draws random numbers (OpInfo reseeds random ops itself, so comparing two
    seeds cannot tell; the aten ops' tags can)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                seen.append(func)
            return func(*a, **(kw or {}))

    with torch.no_grad(), Spy():
        _call(op, *args, seed=1)
    return bool(seen)


def _diff_outputs(out, sample):
    outs = pytree.tree_leaves(sample.output_process_fn_grad(out))
    return [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]


def _grad_outputs(outs):
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in outs]


def _grads(op, sample, args, kwargs):
    out = _call(op, args, kwargs, seed=0)
    outs = _diff_outputs(out, sample)
    leaves = [t for t in pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or not leaves:
        return None
    gos = [g.to(o.device) for g, o in zip(_grad_outputs(outs), outs)]
    return list(torch.autograd.grad(outs, leaves, gos, allow_unused=True))


def run_sample(op, sample, direction, dev):
    """Compare one sample; returns None (pass), "skip:<why>", or raises Fail."""
    cpu_args = [sample.input, *sample.args]
    cpu_kwargs = dict(sample.kwargs)
    memo = {}
    if op.name in CPU_ARGS:
        dev_args, dev_kwargs = _to_device((cpu_args[:1], {}), dev, memo, grad=direction == "bwd")
        dev_args += cpu_args[1:]
        dev_kwargs = dict(cpu_kwargs)
    else:
        dev_args, dev_kwargs = _to_device((cpu_args, cpu_kwargs), dev, memo,
                                          grad=direction == "bwd")
    if "device" in dev_kwargs:
        dev_kwargs["device"] = dev
    backup = _clone((cpu_args, cpu_kwargs))
    # "inf": the forward under inference mode, both sides (tensors made outside it, as a
    # model's weights are): PyTorch then skips the autograd key, where it decomposes ops
    mode = torch.inference_mode if direction == "inf" else contextlib.nullcontext
    try:
        with mode():
            want = _call(op, cpu_args, cpu_kwargs, seed=0)
    except Exception as exc:  # a sample CPU refuses: flagos must refuse it as well
        try:
            with mode():
                _call(op, dev_args, dev_kwargs, seed=0)
        except Exception:
            return None
        raise Fail("mismatch", f"CPU raised {first_line(exc)}; flagos did not") from None
    values = op.name not in UNINITIALIZED
    if _random(op, backup):
        return "skip:random op (runs an aten op tagged nondeterministic_seeded)"
    if direction in ("fwd", "inf"):
        try:
            with mode():
                got = _call(op, dev_args, dev_kwargs, seed=0)
        except Exception as exc:
            raise Fail("error", first_line(exc)) from None
        _compare(got, want, on_device=True, values=values)
        return None
    want = _grads(op, sample, cpu_args, cpu_kwargs)
    if want is None:
        return "skip:no differentiable output"
    try:
        got = _grads(op, sample, dev_args, dev_kwargs)
    except Exception as exc:
        raise Fail("error", first_line(exc)) from None
    pairs = [(g, w) for g, w in zip(got, want)]
    for i, (g, w) in enumerate(pairs):
        if (g is None) != (w is None):
            raise Fail("mismatch", f"grad {i}: {'None' if g is None else 'Tensor'}, expected "
                       f"{'None' if w is None else 'Tensor'}")
    try:
        _compare([g for g, _ in pairs if g is not None], [w for _, w in pairs if w is not None],
                 on_device=True)
    except Fail as exc:
        raise Fail(exc.outcome, "grad " + str(exc)) from None
    return None


def run_case(key, dtype, direction, dev):
    """Outcome of one case: dict(outcome, message, samples)."""
    op = ops()[key]
    torch.manual_seed(0)
    worst, message, compared, skip = "pass", "", 0, ""
    try:
        samples = op.sample_inputs("cpu", DTYPES[dtype], requires_grad=direction == "bwd")
        for i, sample in enumerate(samples):
            if i >= MAX_SAMPLES:
                break
            try:
                verdict = run_sample(op, sample, direction, dev)
            except Fail as exc:
                if RANK[exc.outcome] > RANK[worst]:
                    worst, message = exc.outcome, f"sample {i}: {exc}"
                compared += 1
                continue
            except Exception as exc:  # the harness itself, e.g. a leaf it cannot move
                if RANK["error"] > RANK[worst]:
                    worst, message = "error", f"sample {i}: {first_line(exc)}"
                compared += 1
                continue
            if verdict and verdict.startswith("skip:"):
                skip = verdict[5:]
                if "random" in skip:
                    return {"outcome": "skip", "message": skip, "samples": compared}
                continue
            compared += 1
    except Exception as exc:  # sample generation failed
        return {"outcome": "skip", "message": f"no samples: {first_line(exc)}", "samples": 0}
    if compared == 0:
        return {"outcome": "skip", "message": skip or "no samples", "samples": 0}
    return {"outcome": worst, "message": message, "samples": compared}

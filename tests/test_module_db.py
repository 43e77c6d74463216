"""PyTorch's own module database (`module_db`, torch.testing._internal.common_modules: every
nn module PyTorch tests, with the constructor and forward inputs PyTorch picks) on the flagos
device against plain CPU, as PyTorch's `test_cpu_gpu_parity` compares a GPU with the CPU.

For each module, in float32 and float16 (FlagGems' tolerances), in training and eval mode, for each of its first samples: the module built on
the host under a seed and the same module built on the flagos device (`device=` where its
constructor takes one, else moved), given the CPU module's weights; forward on both, outputs
compared (values, dtype, shape and memory layout); then gradients of the inputs and parameters
for one seeded grad_output. Each sample runs four ways: as given, with non-contiguous inputs
on the flagos side, with 4-d and 5-d inputs and the modules in the channels-last layout on
both sides (PyTorch's `test_memory_format`), and the forward under `torch.inference_mode()` on
both sides (where PyTorch's composite ops reach the router whole). In float64, the gradients
of the squared first gradients (double backward, PyTorch's `test_gradgrad`) instead. Under
`torch.autocast` (bfloat16 and float16; float32 modules and inputs, as a user runs autocast),
outputs and gradients have CPU's dtypes, shapes and layouts, and CPU's values within the
autocast dtype's tolerance or, where they differ by more, are no further from the module's
float64 result than CPU's own are (a chip may round at other places; it may not be worse
than the CPU). Random modules (dropout inside a
Transformer, FractionalMaxPool) run under the same seed on both sides: flagos's generator
gives CPU's numbers. A sample that fails on plain CPU itself (module_db's samples are also
error cases for some dtypes) is not compared.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys

import pytest
import torch
from conftest import device_mode_only
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import harness  # noqa: E402,F401  (stands in for expecttest where it is missing)
from torch.testing._internal.common_modules import module_db  # noqa: E402

pytestmark = device_mode_only

SAMPLES = 3        # per module and mode: module_db's first ones (the ones PyTorch lists first)
# rtol, atol. float16's is wider than FlagGems' per-op 1e-3: a module chains several roundings,
# and where flagos runs an op another way than CPU's kernel (the fused LSTM/GRU cells PyTorch
# picks for every device but the CPU; a C-ABI chip's decompositions; CPU's own batch norm
# backward over a non-contiguous input, which sums in another order) they differ by a unit or
# two of float16, as a GPU's do.
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-7),
             torch.float16: (1e-2, 1e-2)}
VARIANTS = ("as given", "non-contiguous", "channels_last", "inference_mode")
# Under autocast: rtol and atol of the autocast dtype (torch.testing's rtol for it; a module
# chains several roundings, so its atol too), and how much further from float64's result than
# CPU's a value beyond them may be.
AUTOCAST_TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
NO_WORSE_THAN_CPU = 2.0
# Modules whose samples only run in float64 on CPU (their _random_samples are float64).
FLOAT64 = {"nn.FractionalMaxPool2d", "nn.FractionalMaxPool3d"}


def _device_copy(dev, memo):
    """Map a CPU tensor to its flagos copy, the same copy for the same tensor (a sample may pass
    one tensor twice, and its gradient is then the sum of both uses)."""
    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in memo:
            memo[id(x)] = x.detach().to(dev).requires_grad_(x.requires_grad)
        return memo[id(x)]
    return copy


def _non_contiguous(x):
    """The same values, every other element of a doubled last dimension (PyTorch's trick)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.numel() == 0:
        return x
    doubled = torch.repeat_interleave(x.detach(), 2, dim=-1)[..., ::2]
    return doubled.requires_grad_(x.requires_grad)


def _channels_last(x):
    """4-d and 5-d tensors in the channels-last layout (the same values)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
        return x
    layout = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return x.detach().contiguous(memory_format=layout).requires_grad_(x.requires_grad)


def _layout(t):
    return tuple(t.is_contiguous(memory_format=f) for f in
                 ((torch.contiguous_format, torch.channels_last) if t.dim() == 4 else
                  (torch.contiguous_format, torch.channels_last_3d) if t.dim() == 5 else
                  (torch.contiguous_format,)))


def _compare(expected, actual, what, dtype):
    rtol, atol = TOLERANCE[dtype]
    flat_e, flat_a = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    assert len(flat_e) == len(flat_a), what
    for e, a in zip(flat_e, flat_a):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.device.type == "flagos", (what, a)
            assert a.dtype == e.dtype and a.shape == e.shape, (what, a.dtype, a.shape, e.dtype, e.shape)
            assert _layout(a) == _layout(e), (what, "layout", a.stride(), e.stride())
            torch.testing.assert_close(a.cpu(), e, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"{what}: {m}")
        else:
            assert e == a or (e != e and a != a), (what, e, a)


def _build(info, args, kwargs, device):
    takes_device = "device" in inspect.signature(info.module_cls.__init__).parameters
    if device is not None and takes_device:
        return info.module_cls(*args, **{**kwargs, "device": device})
    module = info.module_cls(*args, **kwargs)
    return module if device is None else module.to(device)


def _differentiable(tree):
    return [t for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype.is_floating_point]


def _run_sample(info, sample, training, dtype, dev, variant):
    args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
    torch.manual_seed(0)
    host = _build(info, args, kwargs, None).train(training).to(dtype)
    memo = {}
    to_dev = _device_copy(dev, memo)
    on_dev = _build(info, pytree.tree_map(to_dev, args), pytree.tree_map(to_dev, kwargs), dev)
    on_dev.train(training).to(dtype)
    lazy = any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in host.parameters())
    if not lazy:  # a lazy module makes its weights at its first forward, under the seed below
        on_dev.load_state_dict(host.state_dict())
    fargs, fkwargs = sample.forward_input.args, sample.forward_input.kwargs
    if variant == "channels_last":  # on both sides: the outputs' layouts are compared too
        fargs, fkwargs = pytree.tree_map(_channels_last, (fargs, fkwargs))
        ranks = {p.dim() for p in host.parameters()} if not lazy else set()
        layout = torch.channels_last_3d if 5 in ranks else torch.channels_last if 4 in ranks else None
        if layout is not None and not lazy:
            host, on_dev = host.to(memory_format=layout), on_dev.to(memory_format=layout)
    dargs, dkwargs = pytree.tree_map(to_dev, (fargs, fkwargs))
    if variant == "non-contiguous":  # on the flagos side: the values are CPU's all the same
        dargs, dkwargs = pytree.tree_map(_non_contiguous, (dargs, dkwargs))
    # inference mode: PyTorch's composite ops skip their decomposition there and reach the
    # router whole (OP_DECOMPOSES); forward only, as nothing can be differentiated
    mode = torch.inference_mode if variant == "inference_mode" else contextlib.nullcontext
    torch.manual_seed(1)
    try:
        with mode():
            expected = host(*fargs, **fkwargs)
    except Exception:
        return "fails on CPU"
    torch.manual_seed(1)
    with mode():
        actual = on_dev(*dargs, **dkwargs)
    what = f"{info.name} {'train' if training else 'eval'} {sample.desc or 'sample'} {variant}"
    _compare(expected, actual, what + " forward", dtype)
    outs, douts = _differentiable(expected), _differentiable(actual)
    if not outs:
        return "compared"
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outs]
    inputs = _differentiable((fargs, fkwargs)) + list(host.parameters())
    dinputs = _differentiable((dargs, dkwargs)) + list(on_dev.parameters())
    try:
        want = torch.autograd.grad(outs, inputs, grads, allow_unused=True)
    except RuntimeError as error:  # CPU refuses this backward (NLLLoss over channels-last)
        with pytest.raises(RuntimeError, match=re.escape(str(error).splitlines()[0])):
            torch.autograd.grad(douts, dinputs, [g.to(dev) for g in grads], allow_unused=True)
        return "compared"
    got = torch.autograd.grad(douts, dinputs, [g.to(dev) for g in grads], allow_unused=True)
    if variant == "gradgrad":
        return _compare_second_gradients(outs, inputs, grads, douts, dinputs, dev, what, dtype)
    for i, (w, g) in enumerate(zip(want, got)):
        assert (w is None) == (g is None), f"{what}: gradient {i} is None on one side only"
        if w is not None:
            _compare(w, g, f"{what} gradient {i}", dtype)
    return "compared"


def _second(outs, inputs, grads):
    """Gradients of the squared first gradients (a gradient penalty's shape): None when the
    first gradients do not depend on the inputs."""
    first = torch.autograd.grad(outs, inputs, grads, allow_unused=True, create_graph=True)
    total = sum(f.square().sum() for f in first if f is not None and f.requires_grad)
    return torch.autograd.grad(total, inputs, allow_unused=True) if isinstance(total, torch.Tensor) else None


def _compare_second_gradients(outs, inputs, grads, douts, dinputs, dev, what, dtype):
    dgrads = [g.to(dev) for g in grads]
    try:
        want = _second(outs, inputs, grads)
    except RuntimeError as error:  # no double backward on CPU either
        with pytest.raises(RuntimeError, match=re.escape(str(error).splitlines()[0])):
            _second(douts, dinputs, dgrads)
        return "compared"
    got = _second(douts, dinputs, dgrads)
    assert (want is None) == (got is None), what
    for i, (w, g) in enumerate(zip(want or (), got or ())):
        assert (w is None) == (g is None), f"{what}: second gradient {i} is None on one side only"
        if w is not None:
            _compare(w, g, f"{what} second gradient {i}", dtype)
    return "compared"


def _float64(x):
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        return x
    return x.detach().double().requires_grad_(x.requires_grad)


def _with_gradients(module, args, kwargs, autocast_device, dtype, seed_grads):
    """(outputs, gradients of the differentiable inputs and parameters) of one forward under
    autocast (None: none) and one backward outside it, for grad_outputs seeded by seed_grads."""
    torch.manual_seed(1)
    with torch.autocast(autocast_device or "cpu", dtype=dtype, enabled=autocast_device is not None):
        outs = module(*args, **kwargs)
    differentiable = _differentiable(outs)
    inputs = _differentiable((args, kwargs)) + list(module.parameters())
    if not differentiable or not inputs:
        return outs, ()
    generator = torch.Generator().manual_seed(seed_grads)
    # the same values on every side: float32 numbers the autocast dtype holds exactly
    grads = [torch.randn(o.shape, generator=generator).to(dtype).to(o.dtype).to(o.device) for o in differentiable]
    return outs, torch.autograd.grad(differentiable, inputs, grads, allow_unused=True)


def _compare_under_autocast(expected, actual, float64_result, what, dtype):
    """actual (flagos) against expected (CPU, both under autocast): same dtypes, shapes and
    layouts; values within the autocast dtype's tolerance of CPU's, or else no further from
    the float64 result (float64_result(), run only then) than NO_WORSE_THAN_CPU times CPU's
    distance, plus the tolerance."""
    tolerance = AUTOCAST_TOLERANCE[dtype]
    flat_e, flat_a = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    assert len(flat_e) == len(flat_a), what
    for i, (e, a) in enumerate(zip(flat_e, flat_a)):
        if not isinstance(e, torch.Tensor):
            assert e == a or (e != e and a != a), (what, e, a)
            continue
        assert isinstance(a, torch.Tensor) and a.device.type == "flagos", (what, a)
        assert a.dtype == e.dtype and a.shape == e.shape, (what, a.dtype, a.shape, e.dtype, e.shape)
        assert _layout(a) == _layout(e), (what, "layout", a.stride(), e.stride())
        a = a.cpu()
        if not e.dtype.is_floating_point:
            assert torch.equal(a, e), what
            continue
        if torch.allclose(a, e, rtol=tolerance, atol=tolerance, equal_nan=True):
            continue
        r = pytree.tree_leaves(float64_result())[i].detach().double()
        cpu_error = (e.double() - r).abs().nan_to_num(0).max().item()
        flagos_error = (a.double() - r).abs().nan_to_num(0).max().item()
        bound = NO_WORSE_THAN_CPU * cpu_error + tolerance * (1 + r.abs().nan_to_num(0).max().item())
        assert flagos_error <= bound, (
            f"{what} {i}: flagos is {flagos_error:.3g} from the float64 result, CPU {cpu_error:.3g}")


def _run_under_autocast(info, sample, training, dev, dtype):
    args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
    torch.manual_seed(0)
    host = _build(info, args, kwargs, None).train(training)
    memo = {}
    to_dev = _device_copy(dev, memo)
    on_dev = _build(info, pytree.tree_map(to_dev, args), pytree.tree_map(to_dev, kwargs), dev).train(training)
    lazy = any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in host.parameters())
    if not lazy:  # a lazy module makes its weights at its first forward, under the same seed
        on_dev.load_state_dict(host.state_dict())
    fargs, fkwargs = sample.forward_input.args, sample.forward_input.kwargs
    dargs, dkwargs = pytree.tree_map(to_dev, (fargs, fkwargs))
    try:
        expected, want = _with_gradients(host, fargs, fkwargs, "cpu", dtype, 2)
    except Exception:
        return "fails on CPU"
    actual, got = _with_gradients(on_dev, dargs, dkwargs, "flagos", dtype, 2)

    def float64_result():
        if not hasattr(float64_result, "value"):
            reference = _build(info, pytree.tree_map(_float64, args), pytree.tree_map(_float64, kwargs),
                               None).train(training).double()
            reference.load_state_dict(host.state_dict())  # after host's forward: lazy ones have weights
            rargs, rkwargs = pytree.tree_map(_float64, (fargs, fkwargs))
            float64_result.value = _with_gradients(reference, rargs, rkwargs, None, dtype, 2)
        return float64_result.value

    what = f"{info.name} {'train' if training else 'eval'} {sample.desc or 'sample'} autocast {dtype}"
    _compare_under_autocast(expected, actual, lambda: float64_result()[0], what + " forward", dtype)
    assert len(want) == len(got), what
    for i, (w, g) in enumerate(zip(want, got)):
        assert (w is None) == (g is None), f"{what}: gradient {i} is None on one side only"
        if w is not None:
            _compare_under_autocast(w, g, lambda i=i: float64_result()[1][i], f"{what} gradient {i}", dtype)
    return "compared"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("info", module_db, ids=lambda info: info.name)
def test_module_under_autocast_matches_cpu(info, dtype, dev):
    if info.name in FLOAT64:
        pytest.skip(f"{info.name}'s samples are float64 only")
    outcomes = []
    for training in (True, False):
        samples = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                          training=training)
        for sample in [s for s in samples if s.forward_input is not None][:SAMPLES]:
            outcomes.append(_run_under_autocast(info, sample, training, dev, dtype))
    if "compared" not in outcomes:
        pytest.skip(f"{info.name}: no sample runs under CPU's autocast here ({sorted(set(outcomes))})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("info", module_db, ids=lambda info: info.name)
def test_module_matches_cpu(info, dtype, dev):
    if info.name in FLOAT64 and dtype != torch.float64:
        pytest.skip(f"{info.name}'s samples are float64 only")
    variants = ("gradgrad",) if dtype == torch.float64 else VARIANTS
    outcomes = []
    for training in (True, False):
        samples = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True,
                                          training=training)
        for sample in [s for s in samples if s.forward_input is not None][:SAMPLES]:
            for variant in variants:
                outcomes.append(_run_sample(info, sample, training, dtype, dev, variant))
    if dtype == torch.float16 and "compared" not in outcomes:
        pytest.skip(f"{info.name} has no float16 kernel on CPU")  # AvgPool3d, CTCLoss, ...
    assert "compared" in outcomes, f"{info.name}: no sample ran on CPU ({outcomes})"

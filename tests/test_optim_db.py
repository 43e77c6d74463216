"""PyTorch's own optimizer database (`optim_db`, torch.testing._internal.common_optimizers: every
optimizer with the configurations PyTorch tests) on the flagos device against plain CPU.

For each optimizer, each configuration PyTorch lists for the CPU, and each implementation it
supports (the default, `foreach=True`, `fused=True`): three steps on a small seeded model, the
same on the host and on flagos; the parameters and every tensor of the optimizer's state
(moments, step counts, LBFGS's history) compared. LBFGS runs in float64: its line search and
stopping tests turn a float32 rounding difference (a C-ABI chip's kernels sum in another order)
into another number of function evaluations, on any two devices.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import device_mode_only
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "conformance"))
import harness  # noqa: E402,F401  (stands in for expecttest where it is missing)
from torch.testing._internal.common_optimizers import optim_db  # noqa: E402

pytestmark = device_mode_only

STEPS = 3
SPARSE_ONLY = {"SparseAdam"}   # sparse gradients: flagos tensors are strided only
FLOAT64 = {"LBFGS"}


def _train(info, kwargs, device, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 2)).to(dtype).to(device)
    params = [p for p in model.parameters() if info.name != "Muon" or p.dim() == 2]  # Muon: matrices
    optimizer = info.optim_cls(params, **kwargs)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1), dtype=dtype).to(device)

    def closure():
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    for _ in range(STEPS):
        if info.step_requires_closure:
            optimizer.step(closure)
        else:
            closure()
            optimizer.step()
    state = [t for t in pytree.tree_leaves(optimizer.state_dict()["state"]) if isinstance(t, torch.Tensor)]
    return [p.detach() for p in model.parameters()], state


def _configurations(info):
    for config in info.optim_inputs_func(device="cpu"):
        for impl in (None, *(i for i in ("foreach", "fused") if i in info.supported_impls)):
            kwargs = dict(config.kwargs)
            if impl is not None:
                kwargs[impl] = True
            yield f"{config.desc}{', ' + impl if impl else ''}", kwargs


@pytest.mark.parametrize("info", [i for i in optim_db if i.name not in SPARSE_ONLY], ids=lambda i: i.name)
def test_optimizer_matches_cpu(info, dev):
    dtype = torch.float64 if info.name in FLOAT64 else torch.float32
    compared = 0
    for desc, kwargs in _configurations(info):
        try:
            want_params, want_state = _train(info, kwargs, "cpu", dtype)
        except (RuntimeError, ValueError):  # a configuration the CPU refuses (fused on some)
            continue
        got_params, got_state = _train(info, kwargs, dev, dtype)
        assert len(got_state) == len(want_state), desc
        for i, (got, want) in enumerate(zip(got_params + got_state, want_params + want_state)):
            where = f"{info.name} ({desc}): {'parameter' if i < len(want_params) else 'state'} {i}"
            assert got.dtype == want.dtype and got.shape == want.shape, where
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, where=where: f"{where}: {m}")
        compared += 1
    assert compared, f"{info.name}: no configuration ran on CPU"

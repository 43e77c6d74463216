"""Ops PyTorch runs whole on CPU and CUDA and decomposes for every other device.

A few aten ops have a CPU (and CUDA) kernel and, for other devices, only their
CompositeImplicitAutograd decomposition (`OPS`: the dispatcher's answer on PyTorch 2.9 to 2.14,
kept by a test, as reading it at activation costs some 40 ms). Under grad
mode that decomposition runs at the autograd key, above flagos, so the router sees its parts:
`silu_backward` in float16 then rounds each part to float16 where the CPU kernel computes in
float32, 1-2 units in the last place away from CPU. An AutogradPrivateUse1 kernel sends such an
op whole below autograd, to the router (the cpu chip runs CPU's own kernel; a C-ABI chip its
kernel or the decomposition, as it chooses), when no gradient of it is needed, and decomposes
it as PyTorch would when one is (a double backward through `silu`).
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..core._schema import op_overload

OPS = ("aten::mish_backward", "aten::native_channel_shuffle", "aten::silu_backward")
_lib = None


def _runs_whole_on_cpu_only(name: str) -> bool:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeImplicitAutograd") and has(name, "CPU")


def dispatcher_ops() -> list[str]:
    """aten ops with a CPU kernel whose other devices get their decomposition, as this
    PyTorch's dispatcher says (what OPS must hold)."""
    return sorted(name for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("aten::") and _runs_whole_on_cpu_only(name))


def _needs_gradient(args, kwargs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs)))


def _kernel(op):
    def whole_unless_differentiated(*args, **kwargs):
        if _needs_gradient(args, kwargs):
            return op.decompose(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)
    return whole_unless_differentiated


def register() -> None:
    """Once per process, with the flagos device's other registrations."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    for name in OPS:
        if not _runs_whole_on_cpu_only(name):  # another PyTorch gave it a kernel of its own
            continue
        _lib.impl(name.split("::", 1)[1], _kernel(op_overload(name)), "AutogradPrivateUse1")

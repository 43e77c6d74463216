"""Kernels that bridge PyTorch composites written for PrivateUse1 to payloads of another device.

Some of PyTorch's composite operators choose a branch by the device of their input, and a flagos
tensor is a PrivateUse1 tensor whatever its payload. `aten::group_norm` keeps a channels_last
input as it is on CPU and PrivateUse1 (`input.device().is_cpu() || input.device().is_privateuseone()`)
and makes it contiguous elsewhere, because the CUDA kernel of `native_group_norm` takes
contiguous inputs only (`TORCH_CHECK(X.is_contiguous(memory_format))` with Contiguous off the CPU).
So a Diffusers UNet whose attention hands a channels_last tensor to a GroupNorm fails on the cuda
chip unless the payload is made contiguous first. The forward and the backward get that here, as
override kernels of the chip, on torch-native chips whose payloads are not host tensors.

And on every torch-native chip, a payload holds its memory: PyTorch's "efficient zero tensors"
(forward-mode AD's missing tangents) are made as zeros (`efficient_zeros`).
"""
from __future__ import annotations

import torch

from ..core import _routes

_aten = torch.ops.aten


def _contiguous(t):
    return t if t.is_contiguous() else t.contiguous()


def group_norm(x, weight, bias, n, c, hw, group, eps):
    return _aten.native_group_norm.default(_contiguous(x), weight, bias, n, c, hw, group, eps)


def group_norm_backward(grad, x, mean, rstd, weight, n, c, hw, group, mask):
    return _aten.native_group_norm_backward.default(_contiguous(grad), _contiguous(x), mean, rstd,
                                                    weight, n, c, hw, group, mask)


def efficient_zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    # Forward-mode AD stands for a missing tangent with an "efficient zero tensor", which holds
    # no memory and is marked with PyTorch's ZeroTensor key. As a payload it would not be marked
    # on the wrapper (the key stays on the payload, whose data ops then read). Zeros that are
    # there serve the same values.
    return torch.zeros(size, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)


KERNELS = {"aten::native_group_norm": group_norm,
           "aten::native_group_norm_backward": group_norm_backward}
# for every torch-native chip, the cpu chip's host payloads included
PAYLOAD_KERNELS = {"aten::_efficientzerotensor": efficient_zeros}


def needed(chip) -> bool:
    """Torch-native chips whose payloads live on a device of their own (cuda, npu, ...)."""
    return getattr(chip, "torch_type", None) is not None and not chip.payload_is_host


def register(chip) -> None:
    """At device-mode activation (which lasts for the process)."""
    kernels = dict(KERNELS) if needed(chip) else {}
    if getattr(chip, "torch_type", None) is not None:
        kernels.update(PAYLOAD_KERNELS)
    for op, fn in kernels.items():
        _routes.register_kernel(op, fn, chip=chip.name)

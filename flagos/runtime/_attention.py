"""scaled_dot_product_attention on the flagos device picks the chip's fused kernel.

PyTorch chooses an attention backend by device type, and a PrivateUse1 device without a C++
choice function always gets the math decomposition (a dozen ops). flagos registers its own
autograd-level implementation for the flagos key: it asks the chip which backend PyTorch would
use for the payloads, and calls that op on the flagos tensors, so the router routes it (and
autograd records it) like any other op. Fused backends are wired for payloads on the CPU; every
other case, C-ABI chips included, keeps the math decomposition.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

from ._tensor import FlagosTensor

aten = torch.ops.aten
_FLASH = int(torch._C._SDPBackend.FLASH_ATTENTION)
_lib = None


def _payload(t):
    return t._payload if isinstance(t, FlagosTensor) else t


def _concrete(size):
    """A traced size as the int it stands for now (its hint); None where it has none."""
    return size if isinstance(size, int) else getattr(size.node, "hint", None)


def _backend_choice(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa):
    """PyTorch's CPU backend choice for these payloads; None where it cannot be asked. A payload
    that torch.compile traces has no data, and the choice function answers "math" for it
    whatever its shapes (its Meta kernel), where PyTorch's own CPU path asks the CPU choice with
    the same fake tensors. For those, uninitialised CPU tensors of the same sizes and strides
    (their memory is never touched) get the CPU answer."""
    payloads = (query, key, value, mask)
    kwargs = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    # A plain tensor holds data: its exact type answers without is_fake's walk (2 µs a tensor).
    if not any(type(p) is not torch.Tensor and is_fake(p) for p in payloads if p is not None):
        return aten._fused_sdp_choice(query, key, value, attn_mask=mask, **kwargs)
    with _disable_current_modes():
        stand_ins = []
        for p in payloads:
            sizes = None if p is None else [_concrete(n) for n in p.shape]
            strides = None if p is None else [_concrete(n) for n in p.stride()]
            if p is not None and (None in sizes or None in strides):
                return None
            stand_ins.append(None if p is None else
                             torch.empty_strided(sizes, strides, dtype=p.dtype, device="cpu"))
        return aten._fused_sdp_choice(*stand_ins[:3], attn_mask=stand_ins[3], **kwargs)


def _float_mask(mask, dtype):
    """PyTorch's own conversion of a boolean mask to an additive one."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    q = _payload(query)
    mask = _float_mask(attn_mask, query.dtype)
    if isinstance(q, torch.Tensor) and q.device.type == "cpu":
        choice = _backend_choice(q, _payload(key), _payload(value), _payload(mask), dropout_p,
                                 is_causal, scale, enable_gqa)
        # The CPU flash kernel takes grouped key/value heads as they are, as PyTorch calls it.
        if choice == _FLASH:
            return aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    return aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


def register() -> None:
    global _lib
    if _lib is None:
        _lib = torch.library.Library("aten", "IMPL")
        _lib.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradPrivateUse1")

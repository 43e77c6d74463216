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

from ._tensor import FlagosTensor

aten = torch.ops.aten
_FLASH = int(torch._C._SDPBackend.FLASH_ATTENTION)
_lib = None


def _payload(t):
    return t._payload if isinstance(t, FlagosTensor) else t


def _float_mask(mask, dtype):
    """PyTorch's own conversion of a boolean mask to an additive one."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    q = _payload(query)
    mask = _float_mask(attn_mask, query.dtype)
    if isinstance(q, torch.Tensor) and q.device.type == "cpu" and not enable_gqa:
        choice = aten._fused_sdp_choice(q, _payload(key), _payload(value), attn_mask=_payload(mask),
                                        dropout_p=dropout_p, is_causal=is_causal, scale=scale)
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

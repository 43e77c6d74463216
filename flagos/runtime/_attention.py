"""scaled_dot_product_attention on the flagos device picks the payload device's fused kernel.

PyTorch chooses an attention backend by device type, and a PrivateUse1 device without a C++
choice function always gets the math decomposition (a dozen ops, and an L x S attention matrix
in memory). flagos registers its own autograd-level implementation for the flagos key: it asks
the payload device which backend PyTorch would use for the payloads (`_fused_sdp_choice`), and
calls that backend's op on the flagos tensors, with the preparation PyTorch's own composite
(aten/src/ATen/native/transformers/attention.cpp) gives it, so the router routes the op (and
autograd records it, with the backend's own backward) like any other. On CPU payloads that is
the CPU flash kernel; on CUDA payloads flash, memory-efficient or cuDNN attention; on a device
that has no choice function (MPS, C-ABI chips' buffers) and for payloads being traced with no
data on an accelerator, the math decomposition.
"""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad
from torch.utils._python_dispatch import _disable_current_modes

from .. import _C
from ._tensor import FlagosTensor

aten = torch.ops.aten
# The CPU path's two ops through torch's own bindings: the same aten ops, 2 µs less a call than
# through torch.ops' objects (the accelerator backends stay on `aten`).
_cpu_choice = torch._fused_sdp_choice
_cpu_flash = torch._scaled_dot_product_flash_attention_for_cpu
_ATTENTION_OP = aten.scaled_dot_product_attention.default
_route = _C.dispatch_native  # the router's entry point, as a dispatch reaches it: (op, types, args, kwargs)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_level = torch._C._functorch.maybe_current_level
_PLAIN = torch.Tensor  # a payload with data (a traced one is a subclass: fake, functional)
_MATH, _FLASH, _EFFICIENT, _CUDNN, _OVERRIDEABLE = (
    int(getattr(torch._C._SDPBackend, name))
    for name in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "OVERRIDEABLE"))
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
    # A plain tensor holds data: its exact type answers without is_fake's walk (2 µs a tensor).
    payloads = (query, key, value, mask)
    if ((type(query) is _PLAIN and type(key) is _PLAIN and type(value) is _PLAIN
         and (mask is None or type(mask) is _PLAIN))
            or not any(type(p) is not _PLAIN and is_fake(p) for p in payloads if p is not None)):
        if _dispatch_modes() == 0:
            return _cpu_choice(query, key, value, mask, dropout_p, is_causal, scale=scale,
                               enable_gqa=enable_gqa)
        # PyTorch's composite asks its choice outside the dispatcher: a mode sees no such op
        with _disable_current_modes():
            return _cpu_choice(query, key, value, mask, dropout_p, is_causal, scale=scale,
                               enable_gqa=enable_gqa)
    kwargs = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    with _disable_current_modes():
        stand_ins = []
        for p in payloads:
            sizes = None if p is None else [_concrete(n) for n in p.shape]
            strides = None if p is None else [_concrete(n) for n in p.stride()]
            if p is not None and (None in sizes or None in strides):
                return None
            stand_ins.append(None if p is None else
                             torch.empty_strided(sizes, strides, dtype=p.dtype, device="cpu"))
        return _cpu_choice(*stand_ins[:3], attn_mask=stand_ins[3], **kwargs)


def _float_mask(mask, dtype, masked_value=float("-inf")):
    """PyTorch's own conversion of a boolean mask to an additive one (cuDNN's takes -65504
    where the others take -inf, as PyTorch does)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), masked_value)


def _needs_logsumexp(query, key, value) -> bool:
    """The fused kernels keep the log-sum-exp only for a backward that will need it."""
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)


def _pad_last_dim(t, multiple: int):
    """Flash attention needs a head dimension that is a multiple of 8: zeros on the right."""
    extra = t.shape[-1] % multiple
    return t if extra == 0 else torch.nn.functional.pad(t, [0, multiple - extra])


def _aligned_mask(mask, query, key):
    """Memory-efficient attention's bias: strides aligned to 8 elements (padded and sliced back
    where they are not), expanded to (batch, heads, L, S)."""
    aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
    if not aligned:
        size = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, [0, 8 - size % 8])[..., :size]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _flash(query, key, value, attn_mask, dropout_p, is_causal, scale):
    head = query.shape[-1]
    padded = [_pad_last_dim(t, 8) for t in (query, key, value)]
    # the scale of the head dimension before padding
    scale = 1.0 / math.sqrt(head) if scale is None else scale
    out = aten._scaled_dot_product_flash_attention(*padded, dropout_p, is_causal, False, scale=scale)[0]
    return out if out.shape[-1] == head else out[..., :head]


def _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale):
    mask = _float_mask(attn_mask, query.dtype)
    if mask is not None:
        mask = _aligned_mask(mask, query, key)
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, mask, _needs_logsumexp(query, key, value), dropout_p, is_causal,
        scale=scale)[0]


def _cudnn(query, key, value, attn_mask, dropout_p, is_causal, scale):
    mask = _float_mask(attn_mask, query.dtype, masked_value=-65504.0)
    return aten._scaled_dot_product_cudnn_attention(
        query, key, value, mask, _needs_logsumexp(query, key, value), dropout_p, is_causal, False,
        scale=scale)[0]


def _overrideable(query, key, value, attn_mask, dropout_p, is_causal, scale):
    return aten._scaled_dot_product_fused_attention_overrideable(
        query, key, value, _float_mask(attn_mask, query.dtype), dropout_p, is_causal, False,
        scale=scale)[0]


# The fused backends of an accelerator's payloads, by PyTorch's choice (the CPU's flash kernel
# has an op of its own, below).
_ACCELERATOR_BACKENDS = {_FLASH: _flash, _EFFICIENT: _efficient, _CUDNN: _cudnn,
                         _OVERRIDEABLE: _overrideable}


def _accelerator_choice(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa):
    """The payload device's own choice; math where the device has no choice function (a
    NotImplementedError from the op: MPS, ...) or where a payload is traced and has no data
    (the choice's Meta kernel answers math whatever the shapes)."""
    payloads = (query, key, value, mask)
    if any(type(p) is not torch.Tensor and is_fake(p) for p in payloads if p is not None):
        return _MATH
    try:
        return aten._fused_sdp_choice(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                      is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    except NotImplementedError:
        return _MATH


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    q = _payload(query)
    if type(q) is _PLAIN and _routable_as_it_is(query, key, value, attn_mask):
        # The payload device's own attention, its choice and fused kernel in one routed op
        # (not the two ops and three wrappers a backward needs), as under inference mode.
        kwargs = {} if scale is None and not enable_gqa else {"scale": scale, "enable_gqa": enable_gqa}
        return _route(_ATTENTION_OP, None, (query, key, value, attn_mask, dropout_p, is_causal), kwargs)
    if not isinstance(q, torch.Tensor):   # a C-ABI chip's buffer: no backend choice
        return _math(query, key, value, _float_mask(attn_mask, query.dtype), dropout_p,
                     is_causal, scale, enable_gqa)
    attention = _cpu_attention if q.is_cpu else _accelerator_attention
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _routable_as_it_is(query, key, value, mask) -> bool:
    """Whether the attention can go to the router whole, as under inference mode: only where
    nothing would act on the ops it is made of: no gradient to record, no forward-mode tangent,
    no dispatch mode or functorch transform (the profiler still sees its kernel, below it)."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or (mask is not None and mask.requires_grad)):
        return False
    return _dispatch_modes() == 0 and _functorch_level() is None and forward_ad._current_level < 0


def _cpu_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    mask = _float_mask(attn_mask, query.dtype)
    choice = _backend_choice(_payload(query), _payload(key), _payload(value), _payload(mask),
                             dropout_p, is_causal, scale, enable_gqa)
    # The CPU flash kernel takes grouped key/value heads as they are, as PyTorch calls it.
    if choice == _FLASH:
        return _cpu_flash(
            query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    return _math(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)


def _accelerator_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    payloads = [_payload(t) for t in (query, key, value)]
    if _needs_logsumexp(query, key, value):
        # the choice leaves out backends whose backward cannot take these inputs (flash with a
        # head dimension over 192 on sm86/89, ...): it reads requires_grad, which the wrappers
        # carry and their payloads do not
        payloads = [p.detach().requires_grad_(t.requires_grad)
                    for p, t in zip(payloads, (query, key, value))]
    choice = _accelerator_choice(*payloads, _payload(attn_mask), dropout_p, is_causal, scale,
                                 enable_gqa)
    fused = _ACCELERATOR_BACKENDS.get(choice)
    if fused is not None:
        return fused(query, key, value, attn_mask, dropout_p, is_causal, scale)
    return _math(query, key, value, _float_mask(attn_mask, query.dtype), dropout_p, is_causal,
                 scale, enable_gqa)


def _math(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa):
    return aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


def register() -> None:
    global _lib
    if _lib is None:
        _lib = torch.library.Library("aten", "IMPL")
        _lib.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradPrivateUse1")

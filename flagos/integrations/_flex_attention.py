"""FlexAttention (`torch.nn.attention.flex_attention`) over flagos tensors.

PyTorch runs flex_attention on a list of device types (cuda, cpu, xpu, hpu, mps) and, for a
tensor subclass, only where its two higher-order operators (the attention and its backward)
have a rule for that subclass. flagos answers both, in device mode, when PyTorch's modules are
imported (integrations/_libraries.py):

- the device check: a flagos tensor of a torch-native chip passes it as its payload's device
  passes it, with the same refusals (the cpu chip, like the CPU, has no backward). A C-ABI
  chip's tensor cannot be traced, and flex_attention traces its score and mask functions, so
  there the check refuses with the host run as the way out.
- the operators: under `torch.autocast("flagos")` query, key and value are cast to the
  autocast dtype first, as PyTorch does on the CPU and CUDA; then PyTorch's own eager implementation of each (`sdpa_dense`,
  `sdpa_dense_backward`) runs over the flagos tensors themselves, so every aten op in it is
  routed and counted, and the score and mask functions, with the tensors they capture, run on
  the flagos device as the user wrote them. (Running the operator on the payloads instead would
  meet the flagos device that Dynamo writes into the traced score and mask functions.)
"""
from __future__ import annotations

import torch
from torch.amp.autocast_mode import _cast as cast_for_autocast

from ..core import _state
from ..runtime._tensor import FlagosTensor

_AUTOCAST_KEY = torch._C.DispatchKey.AutocastPrivateUse1


def _autocast_rule(operator):
    """Under `torch.autocast("flagos")`: query, key and value in the autocast dtype, then the
    operator without autocast, as PyTorch's own rule for the CPU and CUDA does (the operator
    otherwise has no rule for the flagos autocast key and fails)."""
    def flex_attention_autocast_flagos(query, key, value, *rest):
        device_type = query.device.type
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (cast_for_autocast(t, device_type, dtype) for t in (query, key, value))
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_AUTOCAST_KEY)):
            return operator(query, key, value, *rest)

    return flex_attention_autocast_flagos


def register_operator_rules(module) -> None:
    """`torch._higher_order_ops.flex_attention`: its operators' rules for flagos tensors."""
    for operator, implementation in ((module.flex_attention, module.sdpa_dense),
                                     (module.flex_attention_backward, module.sdpa_dense_backward)):
        if FlagosTensor not in operator.python_key_table:
            operator.py_impl(FlagosTensor)(implementation)
    if _AUTOCAST_KEY not in module.flex_attention.py_kernels:
        module.flex_attention.py_impl(_AUTOCAST_KEY)(_autocast_rule(module.flex_attention))


def _stand_in(tensor: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """An empty tensor on the payload's device, with the flagos tensor's requires_grad: what
    PyTorch's device check reads."""
    return payload.new_empty(0).requires_grad_(tensor.requires_grad)


def check_devices_of_payloads(module) -> None:
    """`torch.nn.attention.flex_attention`: its device check asks the payloads' devices."""
    check = module._validate_device
    if getattr(check, "_flagos", False):
        return

    def _validate_device(query, key, value):
        if not isinstance(query, FlagosTensor):
            return check(query, key, value)
        payload = query._payload
        if not isinstance(payload, torch.Tensor):
            state = _state.active_or_none()
            chip = state.chip.name if state is not None else "?"
            raise NotImplementedError(
                f"flex_attention cannot run on chip '{chip}': it traces the score and mask "
                f"functions, and a C-ABI chip's tensors hold adapter buffers that cannot be "
                f"traced. Run it on the host and move the result back: "
                f"flex_attention(q.cpu(), k.cpu(), v.cpu(), block_mask=block_mask.to('cpu'), "
                f"...).to(q.device), or use scaled_dot_product_attention with an attn_mask.")
        return check(*(_stand_in(t, t._payload if isinstance(t, FlagosTensor) else t)
                       for t in (query, key, value)))

    _validate_device._flagos = True
    _validate_device.__doc__, _validate_device.__wrapped__ = check.__doc__, check
    module._validate_device = _validate_device

"""The floor of the mechanism, shared by the benchmarks that print it: a trivial wrapper
subclass whose `__torch_dispatch__` is C (`flagos._C.floor_dispatch`): it unwraps `_payload`,
calls the op (`func._op`, as the router does) and wraps each tensor output with
`_make_wrapper_subclass`. No table, routes or checks: what any tensor-subclass device layer
pays per op, measured in the same run as flagos's figures."""
from __future__ import annotations

import torch

from flagos import _C


class FloorTensor(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl
    # a flagos build from before the floor entry has none: the floor figures are then left out
    __torch_dispatch__ = classmethod(getattr(_C, "floor_dispatch", lambda *a: NotImplemented))


def floor_available() -> bool:
    return hasattr(_C, "floor_dispatch")


def floor_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` (a CPU tensor) behind the floor wrapper."""
    w = torch.Tensor._make_wrapper_subclass(FloorTensor, t.shape, strides=t.stride(),
                                            storage_offset=t.storage_offset(), dtype=t.dtype,
                                            device=t.device)
    w._payload = t
    return w

"""The floor of the mechanism, shared by the benchmarks that print it: a trivial wrapper
subclass whose `__torch_dispatch__` is C (`flagos._C.floor_dispatch`): it unwraps `_payload`,
calls the op (`func._op`, as the router does) and wraps each tensor output with
`_make_wrapper_subclass`. No table, routes or checks: what any tensor-subclass device layer
pays per op, measured in the same run as flagos's figures."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

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


def _behind(module: torch.nn.Module, wrap) -> torch.nn.Module:
    """`module` with every parameter and buffer wrapped by `wrap`."""
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            setattr(owner, name, torch.nn.Parameter(wrap(param.detach()), requires_grad=param.requires_grad))
        for name, buffer in list(owner.named_buffers(recurse=False)):
            owner._buffers[name] = wrap(buffer)
    return module


def floor_module(module: torch.nn.Module) -> torch.nn.Module:
    """`module` behind the floor wrapper: a whole model on the floor, for the model ratios
    (eager)."""
    return _behind(module, floor_tensor)


class TracedFloorTensor(torch.Tensor):
    """The floor under torch.compile: a trivial traceable wrapper subclass (`_payload` its one
    inner tensor, no metadata), its dispatch plain Python (a compiled graph never calls it; it
    runs while tracing only). What any wrapper-subclass device pays per compiled call is the
    subclass boundary: AOTAutograd unwrapping the inputs and wrapping the outputs."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t._payload if isinstance(t, TracedFloorTensor) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        # every tensor output (a fake one while tracing) comes out wrapped
        return tree_map(lambda t: traced_floor_tensor(t) if isinstance(t, torch.Tensor) else t, out)

    def __tensor_flatten__(self):
        return ["_payload"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return traced_floor_tensor(inner_tensors["_payload"])


def traced_floor_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` behind the traceable floor wrapper."""
    w = torch.Tensor._make_wrapper_subclass(TracedFloorTensor, t.shape, strides=t.stride(),
                                            storage_offset=t.storage_offset(), dtype=t.dtype,
                                            device=t.device, requires_grad=t.requires_grad)
    w._payload = t
    return w


def traced_floor_module(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with every parameter and buffer behind the traceable floor wrapper."""
    return _behind(module, traced_floor_tensor)

"""Lazy modules (`nn.LazyLinear`, `nn.LazyConv2d`, `nn.LazyBatchNorm1d`, ...) moved to flagos
before their first forward.

A lazy module holds `UninitializedParameter`s and `UninitializedBuffer`s: empty tensors that
remember their device and dtype until the first forward gives them a shape (`materialize`).
`module.to("cuda")` keeps them uninitialized because CUDA's `.data =` moves the object in place.
On flagos a moved tensor is a FlagosTensor (a wrapper subclass), so PyTorch's conversion of the
result back to the uninitialized class fails ("Creating a new Tensor subclass UninitializedBuffer
but the raw Tensor object is already associated to a python object of type FlagosTensor"), and
for a parameter the result is an initialized, empty FlagosTensor that the first forward never
materializes ("weight should have at least three dimensions").

Here a conversion of an uninitialized tensor whose result is a FlagosTensor gives an
uninitialized tensor on flagos: an object of `UninitializedParameterOnFlagos` or
`UninitializedBufferOnFlagos`, which is both the uninitialized class (lazy modules, `is_lazy`,
the "uninitialized" errors work as everywhere) and a FlagosTensor (its ops dispatch to flagos).
Materializing it leaves a plain FlagosTensor, a parameter marked `_is_param` as every flagos
parameter is. Moving one back to another device gives PyTorch's own uninitialized class.
"""
from __future__ import annotations

import torch
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin

from ..runtime._tensor import FlagosTensor

_BASE_TORCH_FUNCTION = UninitializedTensorMixin.__torch_function__
_installed = False


class UninitializedParameterOnFlagos(UninitializedParameter, FlagosTensor):
    """An uninitialized parameter whose memory is to be on flagos."""
    cls_to_become = FlagosTensor  # a flagos parameter is a FlagosTensor marked `_is_param`

    def __new__(cls, requires_grad=True, device=None, dtype=None):
        return _new_parameter(cls, requires_grad, device, dtype)

    def __reduce_ex__(self, proto):
        # Saved as PyTorch saves any uninitialized parameter: its class and requires_grad only.
        return (UninitializedParameter, (self.requires_grad,))


class UninitializedBufferOnFlagos(UninitializedBuffer, FlagosTensor):
    """An uninitialized buffer whose memory is to be on flagos."""
    cls_to_become = FlagosTensor

    def __new__(cls, requires_grad=False, device=None, dtype=None, persistent=True):
        return _new_buffer(cls, requires_grad, device, dtype, persistent)

    def __reduce_ex__(self, proto):
        return (UninitializedBuffer, (self.requires_grad,))


def _uninitialized(cls: type, requires_grad: bool, device, dtype) -> torch.Tensor:
    # PyTorch's constructor: an empty tensor made a subclass. A flagos tensor already has its
    # Python object, so it takes the class on flagos instead.
    data = torch.empty(0, device=device, dtype=dtype)
    if not isinstance(data, FlagosTensor):
        return torch.Tensor._make_subclass(_off_flagos(cls) if issubclass(cls, FlagosTensor) else cls,
                                           data, requires_grad)
    data.requires_grad_(requires_grad)
    data.__class__ = _on_flagos(cls)
    return data


def _new_parameter(cls, requires_grad=True, device=None, dtype=None):
    param = _uninitialized(cls, requires_grad, device, dtype)
    if isinstance(param, FlagosTensor):
        param._is_param = True
    return param


def _new_buffer(cls, requires_grad=False, device=None, dtype=None, persistent=True):
    buffer = _uninitialized(cls, requires_grad, device, dtype)
    buffer.persistent = persistent
    buffer._is_buffer = True
    return buffer


def _on_flagos(cls: type) -> type:
    return UninitializedParameterOnFlagos if issubclass(cls, torch.nn.Parameter) else UninitializedBufferOnFlagos


def _off_flagos(cls: type) -> type:
    return UninitializedParameter if issubclass(cls, torch.nn.Parameter) else UninitializedBuffer


# The conversions an uninitialized tensor allows, which can move it to or from flagos.
_CONVERSIONS = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.half, torch.Tensor.float,
                torch.Tensor.double, torch.Tensor.char, torch.Tensor.short, torch.Tensor.int, torch.Tensor.long}
# What module.to() does to a parameter it moves onto flagos besides converting it: it wraps the
# result in nn.Parameter (detach, requires_grad_) and swaps it with the old object (_use_count).
_MOVING = {torch.Tensor.detach, torch.Tensor.requires_grad_, torch.Tensor._use_count}


def _torch_function(cls, func, types, args=(), kwargs=None):
    first = args[0] if args else None
    on_flagos = isinstance(first, FlagosTensor)
    if not isinstance(first, UninitializedTensorMixin) or not (
            func in _CONVERSIONS or (on_flagos and func in _MOVING)):
        return _BASE_TORCH_FUNCTION.__func__(cls, func, types, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        source = first
        if on_flagos and func in _CONVERSIONS:
            # a plain alias: a chip's code reads `.shape`, which an uninitialized tensor refuses
            source = torch.Tensor.detach(first)
        result = func(source, *args[1:], **(kwargs or {}))
    if result is source:  # nothing to convert: the tensor itself, as on every device
        return first if func in _CONVERSIONS else result
    if not isinstance(result, torch.Tensor):
        return result
    if isinstance(result, FlagosTensor):
        result.__class__ = _on_flagos(cls)
        return result
    if on_flagos:  # leaving flagos: PyTorch's own class again
        return result.as_subclass(_off_flagos(cls))
    if issubclass(cls, torch.nn.Parameter):  # PyTorch hands a parameter's conversion back as is
        return result
    return result.as_subclass(cls)


def install() -> None:
    """Let uninitialized parameters and buffers move to and from flagos (once)."""
    global _installed
    if _installed:
        return
    UninitializedTensorMixin.__torch_function__ = classmethod(_torch_function)
    UninitializedParameter.__new__ = _new_parameter  # `device=flagos.device()` given to a lazy module
    UninitializedBuffer.__new__ = _new_buffer
    _installed = True

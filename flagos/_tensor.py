"""FlagosTensor: what a tensor on the flagos device is.

A traceable wrapper subclass: its device is `flagos:N`, it owns no memory, and
its `_payload` is the chip's own tensor (a CPU tensor on the cpu chip, a CUDA
tensor on the cuda chip). `__torch_dispatch__` is the C router, so every aten
op on it is routed, counted and rewrapped in C. Autograd, views and in-place
ops work at the wrapper level exactly as on any PyTorch device; torch.compile
sees through the wrapper with `__tensor_flatten__`.
"""
from __future__ import annotations

import copy

import torch

from . import _C


class FlagosTensor(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl
    __torch_dispatch__ = classmethod(_C.dispatch)

    # -- `.data = other`: PyTorch swaps the TensorImpl's metadata but not the Python object's
    # payload, which would keep the old values under the new shape.
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        torch._C.TensorBase.data.__set__(self, new)
        if isinstance(new, FlagosTensor):
            self._payload = new._payload

    # -- host views of the values, as on every PyTorch device -------------
    def tolist(self):
        return torch.Tensor.cpu(self).tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                            f"Tensor.cpu() to copy the tensor to host memory first.")
        return torch.Tensor.cpu(self.detach()).numpy()

    def __format__(self, spec):
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def untyped_storage(self):
        # The wrapper owns no memory; its payload's storage is the memory it views (a chip
        # storage with a valid data_ptr(), which safetensors and huggingface_hub read to find
        # tensors that share memory).
        # While torch.compile traces, the wrapper's own storage is what its fake tensors describe.
        payload = self._payload
        if isinstance(payload, torch.Tensor) and not torch.compiler.is_compiling():
            return payload.untyped_storage()
        return torch.Tensor.untyped_storage(self)

    def __deepcopy__(self, memo):
        # torch.Tensor.__deepcopy__ would deep-copy the payload object too (an adapter buffer
        # cannot be pickled, a chip tensor would be copied twice): clone once instead.
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone(memory_format=torch.preserve_format)
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for key, value in self.__dict__.items():
            if key != "_payload":
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    # -- torch.compile: one inner tensor, no extra metadata (flagos/_compile.py) --
    def __tensor_flatten__(self):
        from . import _compile
        return _compile.flatten(self)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return wrap(inner_tensors["_payload"])

    def _stable_hash_for_caching(self) -> str:
        return f"FlagosTensor({self.device})"

    # -- pickling: saved as a CPU copy, restored with map_location --------
    def __reduce_ex__(self, proto):
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad))

    def __repr__(self, *, tensor_contents=None):
        if tensor_contents is None:
            payload = self._payload
            if isinstance(payload, torch.Tensor):
                host = payload.detach().cpu()
            else:  # an adapter buffer: copy the view to the host through the router
                with torch.no_grad():
                    host = torch.Tensor.cpu(self)
            tensor_contents = torch._tensor_str._tensor_str(host, len("tensor("))
        text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        # Print like a tensor on any other device: tensor([...], device='flagos:0').
        prefix = type(self).__name__ + "("
        return "tensor(" + text[len(prefix):] if text.startswith(prefix) else text


def wrap(payload: torch.Tensor, index: int | None = None) -> FlagosTensor:
    """The flagos tensor whose payload is `payload` (no copy)."""
    from . import _runtime

    if index is None:
        index = max(payload.get_device(), 0)
    out = torch.Tensor._make_wrapper_subclass(
        FlagosTensor, payload.shape, strides=payload.stride(),
        storage_offset=payload.storage_offset(), dtype=payload.dtype,
        device=_runtime.flagos_device(index), requires_grad=payload.requires_grad,
        storage_size=_C.WRAPPER_STORAGE_BYTES)
    out._payload = payload
    # PyTorch's conjugate/negative fallbacks act on the wrapper's bits (see router.c).
    return copy_math_bits(payload, out)


def copy_math_bits(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst, given src's conjugate and negative bits (how to read the same bytes)."""
    if src.is_conj():
        torch._C._set_conj(dst, True)
    if src.is_neg():
        torch._C._set_neg(dst, True)
    return dst


def payload(tensor: torch.Tensor) -> torch.Tensor:
    """The chip's own tensor behind a flagos tensor (the tensor itself otherwise)."""
    return tensor._payload if isinstance(tensor, FlagosTensor) else tensor

"""`tensor.data = other` across flagos and the host, the step every offloading scheme takes.

Diffusers' group offloading moves a parameter with `param.data = param.data.to(onload_device)`
and back with `param.data = cpu_copy`; accelerate's hooks and user code do the same. PyTorch's
set_data refuses any pair that its shallow-copy compatibility list leaves out, and that list
names no PrivateUse1 device, so `cpu_param.data = flagos_tensor` raises "incompatible tensor
type" whatever a flagos tensor is made of. `torch.utils.swap_tensors` works, so while flagos owns
the device, `torch.Tensor.data` gets a setter that swaps for those pairs (see
`_tensor.take_memory_of`) and keeps PyTorch's own setter for every other pair. FlagosTensor has
its own `data` property for the reverse direction.

`module.to(device)` asks `torch._has_compatible_shallow_copy_type` whether it may move a
parameter with `.data =` (keeping the object) or must make a new Parameter. Moving onto flagos it
swaps the objects anyway (a flagos tensor is a traceable wrapper subclass); moving off flagos it
would make new ones, and an optimizer built earlier would go on stepping the old objects. With
the setter above the answer for flagos/host pairs is yes, so `model.cpu()` keeps its parameter
objects as it does between CPU and CUDA.

A scripted or traced module (`torch.jit.script`, `torch.jit.trace`) keeps its parameters in C++
slots, which a swap of Python objects does not reach: its `.to()` left them on the host. After
such a module's conversion the slots are given the swapped parameter objects again.

`module.to(dtype)`, `.half()` and `.float()` (Diffusers' layerwise casting runs them around
every forward) swap each parameter of a wrapper subclass with `torch.utils.swap_tensors`, which
refuses a parameter that a live autograd graph holds, or poisons the graph's AccumulateGrad node.
`torch.utils.swap_tensors` is therefore answered here for flagos tensors: two flagos leaves
exchange metadata and payload in place (`_tensor.exchange_in_place`, what `.data =` does on
CPU), and a flagos/host pair swaps objects with the graph kept valid
(`_tensor.swap_keeping_graph`). Every other pair gets PyTorch's own function.
"""
from __future__ import annotations

import torch

from ..runtime._tensor import (
    FlagosTensor,
    exchange_in_place,
    swap_keeping_graph,
    swappable,
    take_memory_of,
    take_payload_of,
)

_BASE_DATA = torch._C.TensorBase.data
_BASE_COMPATIBLE = torch._has_compatible_shallow_copy_type
_BASE_SWAP = torch.utils.swap_tensors
_BASE_SCRIPT_APPLY = torch.jit.ScriptModule._apply
_installed = False


def _set_data(self, new):
    if isinstance(new, FlagosTensor):
        # (a flagos tensor whose class overrides __torch_function__, an uninitialized parameter
        # on flagos, reaches this setter from its own; FlagosTensor's setter serves it)
        if isinstance(self, FlagosTensor):
            take_payload_of(self, new)
        else:
            take_memory_of(self, new)
    else:
        _BASE_DATA.__set__(self, new)


def _compatible(*args, **kwargs) -> bool:
    # (input, from_) as PyTorch's; taken as *args so Dynamo's polyfill for the original, which
    # it registers under this name when it loads, accepts this function's signature.
    tensor, other = (list(args) + list(kwargs.values()))[:2]
    if isinstance(tensor, FlagosTensor) != isinstance(other, FlagosTensor):
        # `.data =` swaps between them (see _set_data), live graph or not; a tensor with a weak
        # reference cannot be swapped and gets a new Parameter, PyTorch's way.
        return swappable(tensor) and swappable(other)
    if isinstance(tensor, FlagosTensor):
        # two dense tensors of one device, whatever their autograd keys (an inference tensor
        # and a normal one): PyTorch's answer for its dense devices, which PrivateUse1 is not
        # among (it would ask for equal dispatch keys)
        return tensor.layout == torch.strided and other.layout == torch.strided
    return _BASE_COMPATIBLE(*args, **kwargs)


def _swap_tensors(t1, t2):
    on_flagos = isinstance(t1, FlagosTensor), isinstance(t2, FlagosTensor)
    if all(on_flagos) and exchange_in_place(t1, t2):
        return None
    if on_flagos[0] != on_flagos[1]:
        return swap_keeping_graph(t1, t2)
    return _BASE_SWAP(t1, t2)


def _script_apply(self, fn, recurse=True):
    # The Python objects of the parameters in the C++ slots; a swap gives these objects the
    # converted tensors, and the slots keep the old ones unless they are given them again.
    before = dict(self._parameters.items())
    result = _BASE_SCRIPT_APPLY(self, fn, recurse)
    for name, param in before.items():
        if param is not None and self._c.getattr(name) is not param:
            self._c.setattr(name, param)
    return result


def install() -> None:
    """Give torch.Tensor the `.data` setter above, answer module.to()'s question, serve
    swap_tensors for flagos tensors and keep scripted modules' slots in step (once; device mode
    lasts for the process). The `.data` getter stays PyTorch's own descriptor."""
    global _installed
    if _installed:
        return
    torch.Tensor.data = property(_BASE_DATA.__get__, _set_data, doc=_BASE_DATA.__doc__)
    torch._has_compatible_shallow_copy_type = _compatible
    _swap_tensors.__doc__ = _BASE_SWAP.__doc__
    _swap_tensors.__wrapped__ = _BASE_SWAP
    torch.utils.swap_tensors = _swap_tensors
    torch.jit.ScriptModule._apply = _script_apply  # scripted and traced modules
    _installed = True

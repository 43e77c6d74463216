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
"""
from __future__ import annotations

import torch

from ._tensor import FlagosTensor, swappable, take_memory_of

_BASE_DATA = torch._C.TensorBase.data
_BASE_COMPATIBLE = torch._has_compatible_shallow_copy_type
_installed = False


def _set_data(self, new):
    if isinstance(new, FlagosTensor):
        take_memory_of(self, new)
    else:
        _BASE_DATA.__set__(self, new)


def _compatible(*args, **kwargs) -> bool:
    # (input, from_) as PyTorch's; taken as *args so Dynamo's polyfill for the original, which
    # it registers under this name when it loads, accepts this function's signature.
    tensor, other = (list(args) + list(kwargs.values()))[:2]
    if isinstance(tensor, FlagosTensor) != isinstance(other, FlagosTensor):
        # `.data =` swaps between them (see _set_data), which needs both objects to be free;
        # one still held (a live autograd graph) gets a new Parameter, as before.
        return swappable(tensor) and swappable(other)
    return _BASE_COMPATIBLE(*args, **kwargs)


def install() -> None:
    """Give torch.Tensor the `.data` setter above and answer module.to()'s question (once;
    device mode lasts for the process). The `.data` getter stays PyTorch's own descriptor."""
    global _installed
    if _installed:
        return
    torch.Tensor.data = property(_BASE_DATA.__get__, _set_data, doc=_BASE_DATA.__doc__)
    torch._has_compatible_shallow_copy_type = _compatible
    _installed = True

"""`tensor.data = other` across flagos and the host, the step every offloading scheme takes.

Diffusers' group offloading moves a parameter with `param.data = param.data.to(onload_device)`
and back with `param.data = cpu_copy`; accelerate's hooks and user code do the same. PyTorch's
set_data refuses any pair that its shallow-copy compatibility list leaves out, and that list
names no PrivateUse1 device, so `cpu_param.data = flagos_tensor` raises "incompatible tensor
type" whatever a flagos tensor is made of. `torch.utils.swap_tensors` works, so while flagos owns
the device, `torch.Tensor.data` gets a setter that swaps for those pairs (see
`_tensor.take_memory_of`) and keeps PyTorch's own setter for every other pair. FlagosTensor has
its own `data` property for the reverse direction.
"""
from __future__ import annotations

import torch

from ._tensor import FlagosTensor, take_memory_of

_BASE_DATA = torch._C.TensorBase.data
_installed = False


def _set_data(self, new):
    if isinstance(new, FlagosTensor):
        take_memory_of(self, new)
    else:
        _BASE_DATA.__set__(self, new)


def install() -> None:
    """Give torch.Tensor the `.data` setter above (once; device mode lasts for the process).
    The getter stays PyTorch's own descriptor."""
    global _installed
    if _installed:
        return
    torch.Tensor.data = property(_BASE_DATA.__get__, _set_data, doc=_BASE_DATA.__doc__)
    _installed = True

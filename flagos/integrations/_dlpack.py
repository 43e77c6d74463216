"""`torch.utils.dlpack.to_dlpack` and `from_dlpack` (and `torch.to_dlpack`/`torch.from_dlpack`)
for flagos tensors.

PyTorch's legacy exporter is a C function that reads the tensor it is given, not its
`__dlpack__`: for a flagos tensor it exported the wrapper, which owns no memory, as a device
PyTorch knows nothing of, and the tensor PyTorch imported from that capsule had no memory
either. Here a flagos tensor exports what its `__dlpack__` exports (its payload, the chip's own
memory; a C-ABI chip refuses with BufferError); every other tensor goes to PyTorch's function.

`from_dlpack(t, device=...)` of a C-ABI chip's tensor: PyTorch asks a producer on another
device than the one named for a capsule of its own memory and moves the import afterwards, which
a C-ABI chip cannot give (its memory is the adapter's). PyTorch itself can address that memory,
so the answer DLPack would give is made without a capsule: the tensor itself (detached) on its
own device, a copy when one is asked for or the device is another.
"""
from __future__ import annotations

import torch
import torch.utils.dlpack
from torch.utils.dlpack import DLDeviceType

from ..runtime._tensor import DLPACK_REQUIRES_GRAD, FlagosTensor

_installed = False


def _serving_to(native):
    def to_dlpack(tensor, *args, **kwargs):
        if isinstance(tensor, FlagosTensor):
            tensor = tensor.dlpack_source()
        return native(tensor, *args, **kwargs)

    to_dlpack.__doc__ = native.__doc__
    to_dlpack.__wrapped__ = native
    return to_dlpack


def _serving_from(native):
    # keyword arguments passed on as given: PyTorch versions before DLPack 1.0 take none
    def from_dlpack(ext_tensor, **kwargs):
        device = kwargs.get("device")
        if (device is not None and isinstance(ext_tensor, FlagosTensor)
                and ext_tensor.__dlpack_device__()[0] == DLDeviceType.kDLExtDev):
            return _import_without_capsule(ext_tensor, torch.device(device), kwargs.get("copy"))
        return native(ext_tensor, **kwargs)

    from_dlpack.__doc__ = native.__doc__
    from_dlpack.__wrapped__ = native
    return from_dlpack


def _import_without_capsule(tensor, device, copy):
    """PyTorch's from_dlpack for a source whose memory only PyTorch (through flagos) can
    address: its checks, in its order and words, and the tensor it would import."""
    source, target = tensor.__dlpack_device__(), torch._C._torchDeviceToDLDevice(device)
    if source != target and copy is False:
        raise ValueError(f"cannot move DLPack tensor from device {source} to {target} "
                         "without copying. Set copy=None or copy=True.")
    if tensor.requires_grad:
        raise BufferError(DLPACK_REQUIRES_GRAD)
    if source != target:
        return tensor.detach().to(device)
    return tensor.detach().clone() if copy else tensor.detach()


def install() -> None:
    """Serve to_dlpack and from_dlpack for flagos tensors (once; device mode lasts for the
    process)."""
    global _installed
    if _installed:
        return
    served_to = _serving_to(torch.utils.dlpack.to_dlpack)
    torch.utils.dlpack.to_dlpack = served_to
    torch.to_dlpack = served_to
    served_from = _serving_from(torch.utils.dlpack.from_dlpack)
    torch.utils.dlpack.from_dlpack = served_from
    torch.from_dlpack = served_from
    _installed = True

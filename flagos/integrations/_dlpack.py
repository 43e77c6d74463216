"""`torch.utils.dlpack.to_dlpack` (and `torch.to_dlpack`) for flagos tensors.

PyTorch's legacy exporter is a C function that reads the tensor it is given, not its
`__dlpack__`: for a flagos tensor it exported the wrapper, which owns no memory, as a device
PyTorch knows nothing of, and the tensor PyTorch imported from that capsule had no memory
either. Here a flagos tensor exports what its `__dlpack__` exports (its payload, the chip's own
memory; a C-ABI chip refuses with BufferError); every other tensor goes to PyTorch's function.
"""
from __future__ import annotations

import torch
import torch.utils.dlpack

from ..runtime._tensor import FlagosTensor

_installed = False


def _serving(native):
    def to_dlpack(tensor, *args, **kwargs):
        if isinstance(tensor, FlagosTensor):
            tensor = tensor.dlpack_source()
        return native(tensor, *args, **kwargs)

    to_dlpack.__doc__ = native.__doc__
    to_dlpack.__wrapped__ = native
    return to_dlpack


def install() -> None:
    """Serve to_dlpack for flagos tensors (once; device mode lasts for the process)."""
    global _installed
    if _installed:
        return
    served = _serving(torch.utils.dlpack.to_dlpack)
    torch.utils.dlpack.to_dlpack = served
    torch.to_dlpack = served
    _installed = True

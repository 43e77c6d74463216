"""Pinned host memory while flagos is the accelerator (`tensor.pin_memory()`, DataLoader's
`pin_memory=True`, then `.to(flagos.device(), non_blocking=True)`).

With flagos active, PyTorch asks the PrivateUse1 hooks for a pinned-memory allocator, which a
Python backend cannot provide. flagos answers `aten::_pin_memory` and `aten::is_pinned` for CPU
tensors instead: on a chip whose payload device has pinned memory (cuda, xpu) they use that
device's pinned allocator; on host chips (cpu, sim) page-locking buys nothing, so `pin_memory()`
returns a copy, as pinning does, and `is_pinned()` answers False. A request naming another
device goes to PyTorch's own kernel. A flagos tensor is device memory: `pin_memory()` of one
raises PyTorch's error for a CUDA tensor and `is_pinned()` answers False, as for CUDA (it was
copied to the host and back by the fallback, and came back a flagos tensor, unpinned).
"""
from __future__ import annotations

import torch

from ..core import _routes

_lib = None
_PIN = torch.ops.aten._pin_memory.default
_IS_PINNED = torch.ops.aten.is_pinned.default
_DEFAULT = "CompositeExplicitAutograd"


def register(chip) -> None:
    global _lib
    if _lib is not None:
        return
    pinned_device = None if chip.payload_is_host or not chip.torch_type else torch.device(chip.torch_type)

    def ours(device) -> bool:
        return device is None or torch.device(device).type == "flagos"

    def pin_memory(self, device=None):
        if not ours(device):
            return _PIN._op_dk(_DEFAULT, self, device)
        if pinned_device is not None:
            return _PIN._op_dk(_DEFAULT, self, pinned_device)
        return self.clone()

    def is_pinned(self, device=None):
        if not ours(device):
            return _IS_PINNED._op_dk(_DEFAULT, self, device)
        if pinned_device is not None:
            return _IS_PINNED._op_dk(_DEFAULT, self, pinned_device)
        return False

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_pin_memory", pin_memory, "CPU")
    lib.impl("is_pinned", is_pinned, "CPU")
    _lib = lib
    _routes.register_kernel("aten::_pin_memory", _refuse_pinning_device_memory, chip=chip.name)
    _routes.register_kernel("aten::is_pinned", _device_memory_is_not_pinned, chip=chip.name)


def _refuse_pinning_device_memory(self, device=None):
    name = torch.empty(0, dtype=self.dtype).type().replace("torch.", "torch.flagos.", 1)
    raise RuntimeError(f"cannot pin '{name}' only dense CPU tensors can be pinned")


def _device_memory_is_not_pinned(self, device=None):
    return False

"""Storages on the flagos device: the constructor refuses them instead of crashing.

PyTorch allocates a storage for a device through that device's C++ allocator, and a device
registered from Python has none: `torch.UntypedStorage(n, device="flagos")` (and through it
`TypedStorage(..., device=...)` and `storage.to("flagos")`) would dereference a null
allocator and kill the process (docs/design.md §8 has the upstream repro). flagos tensors own
no storage (their payload does), so the constructor raises an error that names what works.
"""
from __future__ import annotations

import torch

_storage_new = torch._C.StorageBase.__new__


def _names_flagos(device) -> bool:
    if isinstance(device, str):
        kind = device.split(":", 1)[0]
    elif isinstance(device, torch.device):
        kind = device.type
    else:
        return False  # an index or a bad value: PyTorch's own answer
    return kind in (torch._C._get_privateuse1_backend_name(), "privateuseone")


def _new(cls, *args, **kwargs):
    if _names_flagos(kwargs.get("device")):
        raise RuntimeError(
            f"a storage cannot be created on {kwargs['device']!s}: flagos tensors keep their "
            "memory in the chip's own storage, and PyTorch has no allocator for a device "
            "registered from Python. Make a tensor instead (torch.empty(n, dtype=torch.uint8, "
            "device='flagos')), or move tensors, not storages (tensor.to('flagos')).")
    return _storage_new(cls, *args, **kwargs)


def install() -> None:
    """Guard torch.UntypedStorage's constructor (at activation, device mode, which lasts for
    the life of the process)."""
    torch.UntypedStorage.__new__ = _new

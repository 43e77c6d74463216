"""`nn.DataParallel` over flagos devices.

DataParallel finds its devices through `torch.accelerator` (flagos's), runs the replicas with
its streams and autocast, and reduces gradients in Python; only its copies between devices
(`torch.nn.parallel.comm`: broadcast, scatter, gather) call functions of `torch._C` written for
CUDA, which a build without CUDA does not have: a model wrapped in DataParallel on flagos failed
with "module 'torch._C' has no attribute '_scatter'" (a CUDA-written script wraps its model
whenever `torch.cuda.device_count() > 1`, which the CUDA redirect answers for the chip). For
flagos tensors those four functions are served here with copies between flagos devices, as
CUDA's copy between GPUs (host tensors DataParallel sends to flagos devices too); every other
tensor keeps PyTorch's own function (or its AttributeError).
"""
from __future__ import annotations

import contextlib

import torch

from ..core import _state
from ..runtime._tensor import FlagosTensor

_NAMES = ("_broadcast", "_broadcast_coalesced", "_scatter", "_gather")
_installed = False


def _device(index: int) -> torch.device:
    return _state.device(index)


def _here(t: torch.Tensor, index: int) -> torch.Tensor:
    """t on flagos:index: t itself where it is there already, as CUDA's broadcast gives it."""
    return t if t.device == _device(index) else t.to(_device(index))


def broadcast(tensor, devices):
    return [_here(tensor, d) for d in devices]


def broadcast_coalesced(tensors, devices, buffer_size):
    return [[_here(t, d) for t in tensors] for d in devices]


def scatter(tensor, devices, chunk_sizes, dim, streams):
    if chunk_sizes is None:
        chunks = tensor.chunk(len(devices), dim)
    else:
        chunks = tensor.split(list(chunk_sizes), dim)
    out = []
    for i, (chunk, index) in enumerate(zip(chunks, devices)):
        stream = streams[i] if streams else None
        with stream if stream is not None else contextlib.nullcontext():  # the copy on its stream
            out.append(_here(chunk, index))
    return out


def gather(tensors, dim, destination):
    if destination == -1:
        target = torch.device("cpu")
    else:
        target = _device(torch.flagos.current_device() if destination is None else destination)
    return torch.cat([t.to(target) for t in tensors], dim)


def _on_flagos(first) -> bool:
    """The copy is between flagos devices: its tensors are flagos's, or host tensors that
    DataParallel sends to its devices, which are flagos's when flagos is the accelerator."""
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    if isinstance(first, FlagosTensor):
        return True
    return (isinstance(first, torch.Tensor) and first.device.type == "cpu"
            and torch._utils._get_available_device_type() == _state.device().type)


def _serve(name: str, for_flagos):
    base = getattr(torch._C, name, None)

    def serve(first, *args):
        if _on_flagos(first):
            return for_flagos(first, *args)
        if base is None:  # PyTorch's own answer on a build without CUDA
            raise AttributeError(f"module 'torch._C' has no attribute '{name}'")
        return base(first, *args)

    serve.__name__ = serve.__qualname__ = name
    serve.__wrapped__ = base
    return serve


def install() -> None:
    """Serve comm's copies for flagos tensors (once; device mode lasts for the process)."""
    global _installed
    if _installed:
        return
    for name, for_flagos in zip(_NAMES, (broadcast, broadcast_coalesced, scatter, gather)):
        setattr(torch._C, name, _serve(name, for_flagos))
    _installed = True

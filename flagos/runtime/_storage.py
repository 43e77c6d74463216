"""Storages and the flagos device: no storage lives on it, so the storage constructor refuses
one, and torch.load moves what a checkpoint restores for flagos onto it tensor by tensor.

PyTorch allocates a storage for a device through that device's C++ allocator, and a device
registered from Python has none: `torch.UntypedStorage(n, device="flagos")` (and through it
`TypedStorage(..., device=...)` and `storage.to("flagos")`) would dereference a null allocator
and kill the process (docs/design.md §8 has the upstream repro). flagos tensors own no storage
(their payload does), so the constructor raises an error that names what works.

For the same reason `torch.load(f, map_location="flagos")` cannot restore a host-saved storage
on flagos: the storage stays on the host (the deserializer registered here), is noted, and
when the load returns, every tensor over a noted storage is moved to the device its location
named, one copy per storage, so tensors that shared a storage in the file share one on flagos
(tied weights), with their strides, offsets, requires_grad and Parameter class.

torch.save writes a flagos tensor as PyTorch writes any tensor of a device without storages
(a host tensor and the device to rebuild it on, runtime/_tensor.py); while a torch.save runs,
the tensors over one flagos memory take their host tensors from one host copy of it, so the
file holds each memory once, as for CUDA (tied weights, a slice and its base).
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.utils._pytree as pytree

_storage_new = torch._C.StorageBase.__new__
_loading = threading.local()   # .noted: one {storage data_ptr: device} per torch.load running
_saving = threading.local()    # .copies: one {memory key: host copy} per torch.save running


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


# ---- torch.load ---------------------------------------------------------------------

def tag_storage(storage):
    return None  # no storage lives on flagos: a saved storage is tagged by PyTorch's own rules


def restore_storage(storage, location):
    """The registered deserializer for locations naming flagos (a string, or a torch.device
    from a map_location dict): the storage stays on the host, noted for the load that asked,
    which moves its tensors when it returns."""
    location = str(location)
    if not location.startswith(torch._C._get_privateuse1_backend_name()):
        return None
    stack = getattr(_loading, "noted", None)
    if stack:
        stack[-1][storage.data_ptr()] = torch.device(location)
    return storage


def _moved_view(moved: dict, t: torch.Tensor, device, pending: list | None = None) -> torch.Tensor:
    """Host tensor t as a view of its storage's one copy on `device` for the load running
    (`moved`: (storage data_ptr, device) -> its bytes there), so tensors that share a storage
    share the copy. With `pending`, the copy is only allocated now, and (copy, host bytes) noted
    to be filled once the bytes are read. Bytes that do not view as t's dtype: t alone."""
    storage = t.untyped_storage()
    if storage.nbytes() % t.element_size():
        return t.detach().to(device)
    key = (storage.data_ptr(), str(device))
    whole = moved.get(key)
    if whole is None:
        host = torch.empty(0, dtype=torch.uint8).set_(storage)
        if pending is None:
            whole = host.to(device)
        else:
            whole = torch.empty(host.shape, dtype=torch.uint8, device=device)
            pending.append((whole, host))
        moved[key] = whole
    return whole.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset()).detach()


def _mover(noted: dict):
    moved: dict = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t
        device = noted.get(t.untyped_storage().data_ptr())
        if device is None:
            return t  # a storage the map kept on the host
        out = _moved_view(moved, t, device)
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        else:
            out.requires_grad_(t.requires_grad)
        for name, value in vars(t).items():  # attributes the file restored (a Parameter's state)
            setattr(out, name, value)
        return out

    return move


def _move_noted(result, noted: dict):
    move = _mover(noted)

    def visit(leaf):
        if isinstance(leaf, torch.nn.Module):
            return leaf._apply(move)  # parameters, buffers and their tying, in place
        return move(leaf)

    return pytree.tree_map_only((torch.Tensor, torch.nn.Module), visit, result)


@contextlib.contextmanager
def _scope(local: threading.local, name: str):
    """A dict for the torch.load or torch.save running in this thread (one inside another,
    from an object's own reduce, gets its own)."""
    stack = getattr(local, name, None)
    if stack is None:
        stack = []
        setattr(local, name, stack)
    stack.append({})
    try:
        yield stack[-1]
    finally:
        stack.pop()


def _load(load):
    @functools.wraps(load)
    def load_onto_flagos(*args, **kwargs):
        with _scope(_loading, "noted") as noted, _scope(_loading, "asked") as asked:
            asked["map_location"] = kwargs["map_location"] if "map_location" in kwargs else (
                args[1] if len(args) > 1 else None)
            asked["moved"], asked["pending"] = {}, []  # see _moved_view
            result = load(*args, **kwargs)
        return _move_noted(result, noted) if noted else result
    load_onto_flagos.__flagos_load__ = load
    return load_onto_flagos


_BASE_REBUILD = torch._utils._rebuild_device_tensor_from_cpu_tensor
_BASE_LEGACY_LOAD = torch.serialization._legacy_load


def _restore_location(device: str):
    """Where the torch.load running puts a tensor saved for `device`, by PyTorch's rules
    (`_get_restore_location`). PyTorch hands the map_location to rebuilds in its zip format
    only; in the legacy format this load's own is used."""
    tls = torch.serialization._serialization_tls
    if tls.map_location is not None:
        return torch._utils._get_restore_location(device)
    tls.map_location = _loading.asked[-1]["map_location"]
    try:
        return torch._utils._get_restore_location(device)
    finally:
        tls.map_location = None


@functools.wraps(_BASE_REBUILD)
def _rebuild_device_tensor(data, dtype, device, requires_grad):
    # PyTorch's rebuild of a tensor saved as a host tensor (a flagos tensor's record) moves each
    # tensor on its own, so tensors that shared memory in the file no longer did; and in the
    # legacy format (`_use_new_zipfile_serialization=False`) it runs before the storage's bytes
    # are read (the values were whatever the memory held) and without the map_location. Inside
    # a torch.load, each host storage goes to flagos once and its tensors are views of it; in
    # the legacy format the copy waits for the bytes (_legacy_load below).
    asked = getattr(_loading, "asked", None)
    if not asked:
        return _BASE_REBUILD(data, dtype, device, requires_grad)
    load = asked[-1]
    location = _restore_location(device)
    if data.dtype != dtype or not _names_flagos(str(location)):
        tensor = data.to(dtype=dtype, device=location)  # on the host: the file's storage itself
    else:
        tensor = _moved_view(load["moved"], data, location, load["pending"] if load.get("legacy") else None)
    tensor.requires_grad = requires_grad
    return tensor


@functools.wraps(_BASE_LEGACY_LOAD)
def _legacy_load(*args, **kwargs):
    asked = getattr(_loading, "asked", None)
    if not asked:
        return _BASE_LEGACY_LOAD(*args, **kwargs)
    asked[-1]["legacy"] = True
    result = _BASE_LEGACY_LOAD(*args, **kwargs)
    with torch.no_grad():
        for whole, host in asked[-1]["pending"]:  # the bytes are read now
            whole.copy_(host)
    return result


# ---- torch.save ---------------------------------------------------------------------

def host_view_for_save(t: torch.Tensor) -> torch.Tensor | None:
    """t as a host tensor for torch.save: over t's own memory where that is host memory (the
    cpu chip), else over the one host copy of t's memory made for the torch.save running. None
    outside a torch.save, or where the memory holds no whole number of t's elements: then t
    alone is copied."""
    storage = t.untyped_storage()
    item = t.element_size()
    if storage.device.type != "cpu":
        stack = getattr(_saving, "copies", None)
        if not stack or storage.nbytes() % item:
            return None
        key = (str(t.device), storage.data_ptr())  # one memory: one data_ptr on one device
        copies = stack[-1]
        host = copies.get(key)
        if host is None:
            with torch.no_grad():
                whole = t.detach().as_strided((storage.nbytes() // item,), (1,), 0)
                host = copies[key] = whole.cpu()
        storage = host.untyped_storage()
    # (a view of one memory as another dtype: torch.save refuses it, as it does on CPU)
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())


def _save(save):
    @functools.wraps(save)
    def save_sharing_memory(*args, **kwargs):
        with _scope(_saving, "copies"):
            return save(*args, **kwargs)
    save_sharing_memory.__flagos_save__ = save
    return save_sharing_memory


# ---- a C-ABI chip's storages ----------------------------------------------------------

# What reads, writes or resizes a storage's memory. A C-ABI chip's tensor has a stand-in
# storage: a meta storage that names the adapter buffer (its handle as data_ptr(), its size as
# nbytes()), so tensors sharing a buffer are found by it, but it holds no memory, and PyTorch's
# answer to these was "Trying to resize storage that is not resizable" or a meta error.
_MEMORY_METHODS = ("cpu", "clone", "tolist", "copy_", "fill_", "resize_", "__getitem__", "__setitem__")


def _is_stand_in(storage) -> bool:
    """A C-ABI chip's stand-in: a meta storage with an address (a plain meta storage has none;
    a fake one, under torch.compile, has no address to ask for)."""
    try:
        return storage.device.type == "meta" and storage.data_ptr() != 0
    except RuntimeError:
        return False


def _stand_in_guard(name: str, method, typed: bool = False):
    """The storage method, whose failure on a stand-in is said in flagos's words; every other
    call and every other failure is PyTorch's, untouched (the check runs only after a failure)."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (RuntimeError, NotImplementedError):
            if not _is_stand_in(self._untyped_storage if typed else self):
                raise
        hint = ("free memory by deleting tensors (del, then gc.collect()) or with "
                "param.data = torch.empty(0, device=param.device); FSDP2, which resizes its "
                "parameters' storages, needs a torch-native chip"
                if name == "resize_" else
                "read and write the tensor instead (tensor.cpu(), tensor.copy_(...))")
        raise RuntimeError(
            f"storage.{name}(): this is the storage of a tensor on a C-ABI chip, which only "
            f"names the chip's buffer (data_ptr() and nbytes(), to find tensors that share "
            f"memory) and holds none of its memory: {hint}.")
    guarded.__flagos_storage__ = method
    return guarded


def install() -> None:
    """Guard torch.UntypedStorage's constructor and its memory methods on a C-ABI chip's
    stand-in storages, make torch.load move what it restores for flagos and torch.save write
    each flagos memory once (at activation, device mode, which lasts for the life of the
    process)."""
    if hasattr(torch.serialization.load, "__flagos_load__"):
        return
    torch.UntypedStorage.__new__ = _new
    for name in _MEMORY_METHODS:
        setattr(torch.UntypedStorage, name, _stand_in_guard(name, getattr(torch.UntypedStorage, name)))
        setattr(torch.TypedStorage, name, _stand_in_guard(name, getattr(torch.TypedStorage, name), typed=True))
    torch.serialization.register_package(5, tag_storage, restore_storage)
    torch.load = torch.serialization.load = _load(torch.serialization.load)
    torch._utils._rebuild_device_tensor_from_cpu_tensor = _rebuild_device_tensor
    torch.serialization._legacy_load = _legacy_load
    # (weights_only loads allow the rebuild functions they found at their first use)
    allowed = torch._weights_only_unpickler._get_allowed_globals
    if hasattr(allowed, "cache_clear"):
        allowed.cache_clear()
    torch.save = torch.serialization.save = _save(torch.serialization.save)

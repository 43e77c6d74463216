"""Claiming PyTorch's PrivateUse1 slot as the `flagos` device (device mode only).

Done once per process, on activation, never at import: PyTorch has one
PrivateUse1 slot and registrations cannot be undone.
"""
from __future__ import annotations

import torch

from .. import _C
from ..chips.adapter import DTYPE_NAMES, AdapterChip
from ..core import _routes, _state
from ..errors import ConfigError
from . import _attention, _generator, _guard_errors, _sequences, _storage, _streams, _whole_ops

NAME = "flagos"
_factory_lib = None  # keeps the PrivateUse1 fallback registered
_copy_lib = None


def device_mode_supported() -> bool:
    """PyTorch's Python PrivateUse1 hooks and device guard (`torch._C._acc`) arrived after 2.9;
    without a device guard, autograd on a PrivateUse1 tensor aborts the process."""
    return hasattr(torch._C, "_acc")


def _hook_classes():
    class Hooks(torch._C._acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return True

        def has_primary_context(self, device_index: int) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    class DeviceGuard(torch._C._acc.DeviceGuard):
        # PyTorch calls type_() also while an exception from backward unwinds with its Python
        # error pending; this one takes the error aside for backward() to raise (csrc/guard.c).
        type_ = _C.GuardDeviceType(torch._C._autograd.DeviceType.PrivateUse1,
                                   _guard_errors.keep)

    return Hooks, DeviceGuard


def slot_owner() -> str | None:
    """Name PrivateUse1 carries now, or None while nobody renamed it."""
    name = torch._C._get_privateuse1_backend_name()
    return None if name == "privateuseone" else name


def claim(device_module) -> None:
    """Rename PrivateUse1 to flagos and register what PyTorch expects of a backend."""
    owner = slot_owner()
    if owner != NAME:
        _register(owner, device_module)
    _install_runtime(device_module)


def _register(owner, device_module) -> None:
    global _factory_lib, _copy_lib
    if owner is not None:
        raise ConfigError(
            f"PyTorch's PrivateUse1 device slot is already taken by '{owner}' (a vendor "
            f"plugin such as torch_{owner}); flagos cannot add the 'flagos' device next to it. "
            f"Run flagos in native mode on that chip instead: "
            f"flagos.activate('{owner}', mode='native') or FLAGOS_MODE=native.")
    if not device_mode_supported():
        raise ConfigError(
            f"device mode needs PyTorch's Python device guard (torch._C._acc), which PyTorch "
            f"{torch.__version__} does not have (it came after 2.9). Use mode='native' "
            f"(FLAGOS_MODE=native), or upgrade PyTorch.")
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    hooks, guard = _hook_classes()
    _setup_privateuseone_for_python_backend(
        rename=NAME, backend_module=device_module, hook=hooks(), device_guard=guard())
    # Ops that reach the flagos key without a flagos tensor argument are factories
    # (empty, empty_strided, ...): route them through the same C router.
    _factory_lib = torch.library.Library("_", "IMPL")
    _factory_lib.fallback(_C.dispatch_factory, dispatch_key="PrivateUse1", with_keyset=False)
    # torch.tensor(data, device="flagos") copies with the Python key excluded, so the
    # copy reaches aten::_copy_from on the flagos key; a boxed Python fallback cannot
    # serve it there, a registered kernel can.
    _copy_lib = torch.library.Library("aten", "IMPL")
    _copy_lib.impl("_copy_from", _copy_from, "PrivateUse1")
    # torch.tensor([a, b]) of flagos scalars reads each with item() under the same exclusion
    # (PyTorch's internal assert "func != nullptr" in the fallback's stead).
    _copy_lib.impl("_local_scalar_dense", _local_scalar_dense, "PrivateUse1")
    # A sparse tensor moved to flagos lands on the sparse flagos keys: say so instead of
    # failing deep inside the sparse kernels.
    for key in ("SparsePrivateUse1", "SparseCsrPrivateUse1"):
        _factory_lib.fallback(_sparse_unsupported, dispatch_key=key, with_keyset=False)
    _factory_lib.fallback(_nested_unsupported, dispatch_key="NestedTensorPrivateUse1", with_keyset=False)
    _factory_lib.fallback(_quantized_unsupported, dispatch_key="QuantizedPrivateUse1", with_keyset=False)
    _attention.register()
    _sequences.register_autograd()
    _whole_ops.register()


def _sparse_unsupported(op, *args, **kwargs):
    raise RuntimeError(f"{op}: sparse tensors are not supported on flagos; keep them on the "
                       f"CPU, or move a dense copy (.to_dense().to(flagos.device())). A layer "
                       f"made with sparse=True (nn.Embedding, nn.EmbeddingBag) makes sparse "
                       f"gradients: make it with sparse=False.")


def _nested_unsupported(op, *args, **kwargs):
    raise RuntimeError(f"{op}: nested tensors of the strided layout are not supported on flagos "
                       f"(jagged ones, layout=torch.jagged, are); keep them on the CPU, or move "
                       f"their pieces (nested.unbind()), a padded copy (nested.to_padded_tensor(0.0)) "
                       f"or a jagged one (torch.nested.as_nested_tensor(pieces, layout=torch.jagged)).")


def _quantized_unsupported(op, *args, **kwargs):
    raise RuntimeError(f"{op}: a quantized tensor cannot be moved to flagos; move the float "
                       f"tensor and quantize it there (a torch-native chip holds the payload "
                       f"device's quantized tensors), or dequantize() it first.")


def _copy_from(src, dst, non_blocking=False):
    return _C.dispatch_factory(torch.ops.aten.copy_.default, dst, src, non_blocking)


def _local_scalar_dense(t):
    return _C.dispatch_factory(torch.ops.aten._local_scalar_dense.default, t)


# ---- what a Python backend cannot register: generators, streams, torch.accelerator ----------

_saved_accelerator: dict[str, object] = {}


def _accelerator_functions(dm) -> dict:
    """PyTorch's torch.accelerator reads these torch._C functions at each call; for a Python
    backend they raise (synchronize, device capability) or hit an internal assert (every
    memory statistic: the flagos allocator is not a c10 DeviceAllocator)."""

    def exchange_device(index: int) -> int:
        previous = dm.current_device()
        if index >= 0 and index != previous:
            dm.set_device(index)
        return previous

    def set_device_index(index: int) -> None:
        if index >= 0:  # -1 means "no device", as on CUDA
            dm.set_device(index)

    def device_stats(index: int) -> dict:
        stats = {}
        for key, value in dm.memory_stats(index).items():
            group, pool, stat = key.split(".")
            stats.setdefault(group, {}).setdefault(pool, {})[stat] = value
        return stats

    def device_capability(index: int) -> dict:
        # The dtypes a flagos tensor can hold: every adapter dtype on an adapter chip (what
        # the chip cannot compute in falls back), the payload device's own on the others.
        chip = _state.active().chip
        names = DTYPE_NAMES if isinstance(chip, AdapterChip) else chip.native_dtypes
        return {"supported_dtypes": {getattr(torch, n) for n in names}}

    return {
        "_accelerator_synchronizeDevice": lambda index: dm.synchronize(index),
        "_accelerator_getDeviceIndex": dm.current_device,
        "_accelerator_setDeviceIndex": set_device_index,
        "_accelerator_exchangeDevice": exchange_device,
        "_accelerator_maybeExchangeDevice": exchange_device,
        "_accelerator_getStream": lambda index: _streams.current_stream(index),
        "_accelerator_setStream": _streams.set_stream,
        "_accelerator_getDeviceCapability": device_capability,
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_emptyCache": dm.empty_cache,
        "_accelerator_emptyHostCache": lambda: None,  # flagos keeps no pinned-memory cache
        "_accelerator_getDeviceStats": device_stats,
        "_accelerator_resetPeakStats": lambda index: dm.reset_peak_memory_stats(index),
        "_accelerator_resetAccumulatedStats": lambda index: None,  # no accumulated counters
        "_accelerator_getMemoryInfo": lambda index: dm.mem_get_info(index),
    }


def _install_runtime(device_module) -> None:
    """torch.Generator, torch.Stream and torch.Event for the flagos device, and the
    torch.accelerator API."""
    _generator.install()
    _streams.install()
    _storage.install()
    _routes.register_kernel("aten::record_stream", _record_stream)
    if _saved_accelerator:
        return
    for name, fn in _accelerator_functions(device_module).items():
        if hasattr(torch._C, name):  # an older PyTorch has fewer of them
            _saved_accelerator[name] = getattr(torch._C, name)
            setattr(torch._C, name, fn)


def release() -> None:
    """Undo _install_runtime (deactivation): PyTorch's own functions come back."""
    _generator.uninstall()
    _streams.uninstall()
    _routes.unregister_kernel("aten::record_stream")
    for name, fn in _saved_accelerator.items():
        setattr(torch._C, name, fn)
    _saved_accelerator.clear()


def _record_stream(tensor, stream) -> None:
    _streams.record_stream(tensor, stream)

"""The torch-native chips flagos knows, and the order `auto` tries them in.

Vendor plugins come before cuda: CUDA-migration shims shipped by some vendors
make `torch.cuda.is_available()` answer for their chip.
"""
from __future__ import annotations

import importlib

from .adapter import AdapterChip, discovered_names
from .base import DeviceInfo, TorchChip

VENDOR_PLUGINS = ("npu", "mlu", "musa")
BUILT_IN = ("cuda", "xpu", "mps", "cpu")
# Built-in C-ABI chips that `auto` tries after PyTorch's accelerators and before cpu; each
# says itself whether `auto` may pick it (opencl: only for a device that is not a CPU).
PORTABLE = ("opencl",)
EMULATED = ("sim",)  # never picked by "auto": it is for tests and for adapter authors


def auto_order() -> tuple[str, ...]:
    """Vendor plugins, then adapters found on FLAGOS_ADAPTER_PATH, then PyTorch's own
    accelerators, then opencl, then cpu."""
    adapters = tuple(n for n in discovered_names()
                     if n not in VENDOR_PLUGINS + BUILT_IN + PORTABLE + EMULATED)
    return VENDOR_PLUGINS + adapters + BUILT_IN[:-1] + PORTABLE + BUILT_IN[-1:]


def known() -> tuple[str, ...]:
    return auto_order() + EMULATED


_profiles: dict = {}


def profile(name: str):
    """The profile of a chip (imported lazily: nothing runs at `import flagos`)."""
    if name not in _profiles:
        try:
            _profiles[name] = importlib.import_module(f"{__name__}.{name}").CHIP
        except ModuleNotFoundError:
            _profiles[name] = AdapterChip(name)  # an adapter found on FLAGOS_ADAPTER_PATH
    return _profiles[name]


__all__ = ["auto_order", "known", "DeviceInfo", "TorchChip", "profile"]

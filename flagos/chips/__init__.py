"""The torch-native chips flagos knows, and the order `auto` tries them in.

Vendor plugins come before cuda: CUDA-migration shims shipped by some vendors
make `torch.cuda.is_available()` answer for their chip.
"""
from __future__ import annotations

import importlib

from .base import DeviceInfo, TorchChip

AUTO_ORDER = ("npu", "mlu", "musa", "cuda", "xpu", "mps", "cpu")
KNOWN = AUTO_ORDER


def profile(name: str) -> TorchChip:
    """The profile of a known chip (imported lazily: nothing runs at `import flagos`)."""
    return importlib.import_module(f"{__name__}.{name}").CHIP


__all__ = ["AUTO_ORDER", "KNOWN", "DeviceInfo", "TorchChip", "profile"]

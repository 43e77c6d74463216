"""flagos: one PyTorch device for every AI chip.

    import flagos
    flagos.activate()                       # or FLAGOS_DEVICE=auto, no code at all
    model.to(flagos.device())               # flagos:0 (or the chip's own device in native mode)
    print(flagos.fallback_report())         # which aten ops ran where

Importing flagos changes nothing in torch; `activate()` does. The public names are loaded on
first use, so the `torch.backends` autoload entry point costs `import torch` almost nothing
when FLAGOS_DEVICE is not set.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# torch first: with FLAGOS_DEVICE set, importing torch runs flagos's autoload, which must find
# this package importable whichever of `import flagos` and `import torch` a script does first.
import torch  # noqa: F401

_EXPORTS = {
    "activate": "_activation", "deactivate": "_activation", "list_devices": "_activation",
    "device": "core._state", "info": "core._state", "TESTED_TORCH": "core._state",
    "fallback_report": "report._report", "reset_report": "report._report",
    "track": "report._report", "Report": "report._report",
    "supports_dtype": "core._precision", "preferred_dtype": "core._precision",
    "routes": "core._routes", "route_of": "core._routes", "set_route": "core._routes",
    "register_kernel": "core._routes", "unregister_kernel": "core._routes",
    "FlagosTensor": "runtime._tensor", "DeviceInfo": "chips.base",
    "ConfigError": "errors", "ChipNotFoundError": "errors", "DeviceError": "errors",
    "DeviceMismatchError": "errors", "FallbackError": "errors", "FallbackWarning": "errors",
    "AdapterError": "errors", "NoEngineQueueError": "errors", "DowncastWarning": "errors",
    "AcceleratorBackwardError": "errors",
    "compare": "tools._compare", "dist_backend": "integrations._distributed",
}

__all__ = sorted([*_EXPORTS, "errors", "__version__"])


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        if name in ("errors", "chips", "metrics", "parallel"):
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'flagos' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    # ruff: noqa: F401
    from . import errors
    from ._activation import activate, deactivate, list_devices
    from .chips.base import DeviceInfo
    from .core._precision import preferred_dtype, supports_dtype
    from .core._routes import register_kernel, route_of, routes, set_route, unregister_kernel
    from .core._state import TESTED_TORCH, device, info
    from .errors import (
        AdapterError,
        ChipNotFoundError,
        ConfigError,
        DeviceError,
        DeviceMismatchError,
        DowncastWarning,
        FallbackError,
        FallbackWarning,
        NoEngineQueueError,
    )
    from .integrations._distributed import dist_backend
    from .report._report import Report, fallback_report, reset_report, track
    from .runtime._tensor import FlagosTensor

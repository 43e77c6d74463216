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
    "activate": "_runtime", "deactivate": "_runtime", "device": "_runtime",
    "list_devices": "_runtime", "info": "_runtime", "TESTED_TORCH": "_runtime",
    "fallback_report": "_report", "reset_report": "_report", "track": "_report", "Report": "_report",
    "routes": "_routes", "route_of": "_routes", "set_route": "_routes",
    "register_kernel": "_routes", "unregister_kernel": "_routes",
    "FlagosTensor": "_tensor", "DeviceInfo": "chips.base",
    "ConfigError": "errors", "ChipNotFoundError": "errors", "DeviceError": "errors",
    "DeviceMismatchError": "errors", "FallbackError": "errors", "FallbackWarning": "errors",
    "AdapterError": "errors", "NoEngineQueueError": "errors",
    "compare": "tools._compare",
}

__all__ = sorted([*_EXPORTS, "errors", "__version__"])


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        if name in ("errors", "chips", "metrics"):
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
    from ._report import Report, fallback_report, reset_report, track
    from ._routes import register_kernel, route_of, routes, set_route, unregister_kernel
    from ._runtime import TESTED_TORCH, activate, deactivate, device, info, list_devices
    from ._tensor import FlagosTensor
    from .chips.base import DeviceInfo
    from .errors import (AdapterError, ChipNotFoundError, ConfigError, DeviceError,
                         DeviceMismatchError, FallbackError, FallbackWarning,
                         NoEngineQueueError)

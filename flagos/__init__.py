"""flagos: one PyTorch device for every AI chip.

    import flagos
    flagos.activate()                       # or FLAGOS_DEVICE=auto, no code at all
    model.to(flagos.device())               # flagos:0 (or the chip's own device in native mode)
    print(flagos.fallback_report())         # which aten ops ran where

Importing flagos changes nothing in torch; `activate()` does.
"""
from . import errors
from ._report import Report, fallback_report, reset_report, track
from ._routes import register_kernel, route_of, routes, set_route, unregister_kernel
from ._runtime import (TESTED_TORCH, __version__, activate, deactivate, device, info,
                       list_devices)
from ._tensor import FlagosTensor
from .chips.base import DeviceInfo
from .errors import (ChipNotFoundError, ConfigError, DeviceError, DeviceMismatchError,
                     FallbackError, FallbackWarning)

__all__ = [
    "activate", "deactivate", "device", "list_devices", "info",
    "fallback_report", "reset_report", "track", "Report",
    "routes", "route_of", "set_route", "register_kernel", "unregister_kernel",
    "FlagosTensor", "DeviceInfo", "errors", "ConfigError", "ChipNotFoundError", "DeviceError",
    "DeviceMismatchError", "FallbackError", "FallbackWarning", "TESTED_TORCH", "__version__",
]

"""C-ABI chips: adapters loaded from shared libraries (`libflagos_<chip>_adapter.so`).

Libraries are looked up on FLAGOS_ADAPTER_PATH (folders, os.pathsep-separated), then in the
installed package's `flagos/adapters/`. Loading checks the ABI (csrc/include/flagos/adapter.h);
a library that cannot be used raises flagos.AdapterError naming the file and the reason, and
`auto` moves on to the next chip.
"""
from __future__ import annotations

import glob
import logging
import os
import re

import torch

from .. import _C
from ..core import _env
from ..errors import AdapterError, DeviceError
from .base import HostGenerator

log = logging.getLogger("flagos")

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "adapters")
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
               "uint8", "bool")
_loaded: dict[str, object] = {}
_errors_ready = False


def search_path() -> list[str]:
    extra = [d for d in _env.get("FLAGOS_ADAPTER_PATH").split(os.pathsep) if d]
    return extra + [PACKAGE_DIR]


def find_library(name: str) -> str | None:
    for folder in search_path():
        for filename in (f"libflagos_{name}_adapter.so", f"libflagos_{name}.so"):
            path = os.path.join(folder, filename)
            if os.path.isfile(path):
                return path
    return None


def discovered_names() -> list[str]:
    """Adapters on FLAGOS_ADAPTER_PATH (the package's own are listed by name in chips.KNOWN)."""
    names = []
    for folder in [d for d in _env.get("FLAGOS_ADAPTER_PATH").split(os.pathsep) if d]:
        for path in sorted(glob.glob(os.path.join(folder, "libflagos_*.so"))):
            m = re.fullmatch(r"libflagos_(\w+?)(?:_adapter)?\.so", os.path.basename(path))
            if m and m.group(1) not in names:
                names.append(m.group(1))
    return names


def load(path: str):
    """The Adapter for a library path, loaded once per process."""
    global _errors_ready
    if not _errors_ready:
        _C.set_error_types(AdapterError, torch.OutOfMemoryError, DeviceError)
        _errors_ready = True
    adapter = _loaded.get(path)
    if adapter is None:
        adapter = _loaded[path] = _C.load_adapter(path)
    return adapter


class AdapterChip(HostGenerator):
    """A chip reached through a C-ABI adapter; its tensors' payloads are adapter buffers."""

    plugin = None
    owns_privateuse1 = False
    payload_is_host = False
    torch_type = None
    collective_backend = "gloo"
    install = ""  # how to get the library and a device, for `flagos diagnose`
    fork_safe = True  # a forked child may use the library loaded before the fork

    def __init__(self, name: str, vendor: str = ""):
        self.name = name
        self._vendor = vendor
        self._adapter = None

    # -- loading ---------------------------------------------------------
    @property
    def adapter(self):
        if self._adapter is None:
            path = find_library(self.name)
            if path is None:
                raise AdapterError(
                    f"no adapter library for chip {self.name!r}: looked for "
                    f"libflagos_{self.name}_adapter.so in {', '.join(search_path())}; "
                    f"set FLAGOS_ADAPTER_PATH to the folder that holds it")
            self._adapter = load(path)
        return self._adapter

    def detect(self) -> bool:
        try:
            return self.adapter.device_count() > 0
        except (AdapterError, DeviceError) as e:
            log.warning("flagos: chip %s skipped: %s", self.name, e)
            return False

    def picked_by_auto(self) -> bool:
        """Whether `auto` takes this chip when it gets to it: when it has a device."""
        return self.detect()

    @property
    def vendor(self) -> str:
        return self._vendor or (self._adapter.vendor if self._adapter else "")

    @property
    def native_dtypes(self) -> tuple[str, ...]:
        mask = self.adapter.props(0)["native_dtypes"]
        return tuple(n for i, n in enumerate(DTYPE_NAMES) if mask >> i & 1)

    def architecture(self) -> str:
        """The adapter's own name and the adapter ABI it was built for ("sim-abi1.2"): what
        flagos knows of the code behind it."""
        major, minor = self.adapter.abi
        return f"{self.adapter.name or self.name}-abi{major}.{minor}"

    # -- devices ---------------------------------------------------------
    def device_count(self) -> int:
        return self.adapter.device_count()

    def torch_device(self, index: int) -> torch.device:
        return torch.device("cpu")  # payloads are buffers, not torch tensors

    def device_name(self, index: int) -> str:
        return self.adapter.props(index)["name"]

    def total_memory(self, index: int) -> int:
        return self.adapter.props(index)["total_memory"]

    def set_device(self, index: int) -> None:
        pass

    def synchronize(self, index=None) -> None:
        for i in range(self.device_count()) if index is None else (index,):
            self.adapter.synchronize(i)

    # -- memory ----------------------------------------------------------
    def memory_allocated(self, index: int) -> int:
        return self.adapter.memory_info(index)["allocated"]

    def max_memory_allocated(self, index: int) -> int:
        return self.adapter.memory_info(index)["peak_allocated"]

    def memory_reserved(self, index: int) -> int:
        return self.adapter.memory_info(index)["reserved"]

    def reset_peak_memory_stats(self, index: int) -> None:
        self.adapter.reset_peak(index)

    def empty_cache(self) -> None:
        for i in range(self.device_count()):
            self.adapter.empty_cache(i)

    def mem_get_info(self, index: int) -> tuple[int, int]:
        info = self.adapter.memory_info(index)
        return info["free"], info["total"]

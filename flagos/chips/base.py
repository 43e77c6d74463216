"""The chip interface the rest of flagos sees.

A chip profile answers: is the chip here (without initializing it where the
vendor allows), how many devices, what they are, and how to reach the
vendor's memory, RNG and synchronize functions. The router never sees a
profile; it only gets the chip's torch devices.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """One device of one chip, as `flagos.list_devices()` shows it."""
    chip: str
    index: int
    name: str
    total_memory: int
    native_dtypes: tuple[str, ...]
    mode: str
    available: bool
    vendor: str = ""
    collective_backend: str = ""


_COMMON_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                  "uint8", "bool")


def torch_module(torch_type: str):
    """PyTorch's own `torch.<torch_type>` module: the one in sys.modules, so a replaced
    attribute (flagos's CUDA redirect, integrations/_redirect.py) never answers for detection."""
    return sys.modules.get(f"torch.{torch_type}") or getattr(torch, torch_type, None)


@dataclass
class TorchChip:
    """A chip with its own PyTorch device type, driven through `torch.<module>`.

    Vendor plugins (torch_npu, torch_mlu, torch_musa, ...) mirror the
    `torch.cuda` API, so one implementation serves them all; a profile only
    states names, the plugin to import and the facts that differ.
    """
    name: str
    torch_type: str
    vendor: str
    collective_backend: str
    plugin: str | None = None             # module that registers the device with torch
    owns_privateuse1: bool = False        # its plugin takes PyTorch's PrivateUse1 slot
    native_dtypes: tuple[str, ...] = _COMMON_DTYPES + ("float64",)
    oom_patterns: tuple[str, ...] = ("out of memory",)
    extra: dict = field(default_factory=dict)
    install: str = ""                     # what a user installs to get the chip

    def why_unavailable(self) -> str:
        """Why detect() says no, in words: the plugin is missing or broken, or no device."""
        if self.plugin:
            if importlib.util.find_spec(self.plugin) is None:
                return f"{self.plugin} is not installed"
            try:
                importlib.import_module(self.plugin)
            except Exception as e:  # a broken vendor package: say how it breaks
                return f"{self.plugin} is installed but fails to import ({type(e).__name__}: {e})"
        return f"torch.{self.torch_type}.is_available() is False (no device, or no driver)"

    # -- detection -------------------------------------------------------
    def _module(self):
        return torch_module(self.torch_type)

    def detect(self) -> bool:
        """True when the chip can run here; never raises (a broken plugin means 'no')."""
        try:
            if self.plugin:
                if importlib.util.find_spec(self.plugin) is None:
                    return False
                importlib.import_module(self.plugin)
            mod = self._module()
            return bool(mod is not None and mod.is_available())
        except Exception:  # a broken vendor package must never break flagos
            return False

    def picked_by_auto(self) -> bool:
        """Whether `auto` takes this chip when it gets to it: when it is here."""
        return self.detect()

    # -- devices ---------------------------------------------------------
    def device_count(self) -> int:
        return int(self._module().device_count())

    def torch_device(self, index: int) -> torch.device:
        return torch.device(self.torch_type, index)

    def device_name(self, index: int) -> str:
        mod = self._module()
        fn = getattr(mod, "get_device_name", None)
        return fn(index) if fn else f"{self.torch_type}:{index}"

    def total_memory(self, index: int) -> int:
        mod = self._module()
        try:
            return int(mod.get_device_properties(index).total_memory)
        except Exception:
            free_total = self.mem_get_info(index)
            return free_total[1]

    def set_device(self, index: int) -> None:
        self._module().set_device(index)

    def synchronize(self, index: int | None = None) -> None:
        self._module().synchronize(index)

    def architecture(self) -> str | None:
        """What code compiled for this chip's devices depends on, for the name of its cache
        folder (integrations/_caches.py): the device's compute capability where the chip's
        module reports one (`get_device_capability`), "unknown" where nothing is known. None
        while the answer would initialize the runtime (see CudaChip)."""
        fn = getattr(self._module(), "get_device_capability", None)
        if fn is None:
            return "unknown"
        try:
            found = {_capability_text(fn(i)) for i in range(self.device_count())}
        except Exception:  # a vendor module that does not answer like torch.cuda's
            return "unknown"
        return "+".join(sorted(found)) or "unknown"

    # -- memory ----------------------------------------------------------
    def _mem(self, fn: str, index: int, default=0):
        f = getattr(self._module(), fn, None)
        return f(index) if f else default

    def memory_allocated(self, index: int) -> int:
        return int(self._mem("memory_allocated", index))

    def max_memory_allocated(self, index: int) -> int:
        return int(self._mem("max_memory_allocated", index))

    def memory_reserved(self, index: int) -> int:
        return int(self._mem("memory_reserved", index))

    def reset_peak_memory_stats(self, index: int) -> None:
        self._mem("reset_peak_memory_stats", index, None)

    def empty_cache(self) -> None:
        f = getattr(self._module(), "empty_cache", None)
        if f:
            f()

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return tuple(int(x) for x in self._module().mem_get_info(index))

    # -- RNG -------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._module().manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._module().manual_seed_all(seed)

    def get_rng_state(self, index: int) -> torch.Tensor:
        return self._module().get_rng_state(index)

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        self._module().set_rng_state(state, index)

    def seed(self) -> None:
        self._module().seed()

    def seed_all(self) -> None:
        self._module().seed_all()

    def initial_seed(self) -> int:
        return int(self._module().initial_seed())

    # -- errors ----------------------------------------------------------
    def is_out_of_memory(self, exc: BaseException) -> bool:
        text = str(exc).lower()
        return isinstance(exc, torch.OutOfMemoryError) or any(p in text for p in self.oom_patterns)

    @property
    def payload_is_host(self) -> bool:
        return self.torch_type == "cpu"


def _capability_text(capability) -> str:
    """(9, 0) -> "sm90"; any other answer as text."""
    if isinstance(capability, tuple) and len(capability) == 2:
        return f"sm{capability[0]}{capability[1]}"
    return str(capability)


class HostGenerator:
    """RNG of chips whose random ops run on the host: PyTorch's default CPU generator, used
    directly (torch.manual_seed would call back into torch.flagos)."""

    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def get_rng_state(self, index: int) -> torch.Tensor:
        return torch.default_generator.get_state()

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        torch.default_generator.set_state(state)

    def seed(self) -> None:
        torch.default_generator.seed()

    def seed_all(self) -> None:
        torch.default_generator.seed()

    def initial_seed(self) -> int:
        return torch.default_generator.initial_seed()


def host_memory() -> tuple[int, int]:
    """(free, total) bytes of host memory, from the OS."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info.get("MemFree", 0)), info.get("MemTotal", 0)
    except OSError:
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        size = os.sysconf("SC_PAGE_SIZE") if pages else 0
        return pages * size, pages * size

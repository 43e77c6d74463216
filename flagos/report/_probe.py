"""What is on this machine: every chip flagos knows with its status and the reason, the adapter
search path, and every device of every available chip. Shared by diagnose, devices, top and
metrics.

Nothing here activates flagos: chips are asked through their profiles (which never initialize
a device where the vendor allows it) and adapters through their loaded libraries, so probing
works in any process, active or not, and changes nothing in torch.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import platform
import sys
import threading
import time

import torch

from .. import __version__, chips
from ..chips.adapter import DTYPE_NAMES, PACKAGE_DIR, AdapterChip, find_library, load
from ..chips.base import torch_module
from ..core import _env, _state
from ..errors import AdapterError, DeviceError
from ..runtime._registration import device_mode_supported

AVAILABLE, UNAVAILABLE, BROKEN = "available", "unavailable", "broken"

# Vendor variables that change which devices a chip shows or how its libraries load; diagnose
# prints the ones that are set, since they explain most "device not found" reports.
VENDOR_ENV_VARS = (
    "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF", "ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES",
    "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "MLU_VISIBLE_DEVICES", "NEUWARE_HOME",
    "MUSA_VISIBLE_DEVICES", "MUSA_HOME", "ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR",
    "PYTORCH_ENABLE_MPS_FALLBACK", "TORCH_DEVICE_BACKEND_AUTOLOAD", "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS",
)


# ---- versions and environment --------------------------------------------------------

def versions() -> dict:
    return {
        "flagos": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "machine": platform.machine(),
    }


def environment() -> dict:
    """FLAGOS_* variables and the vendor variables above that are set, name -> value."""
    flagos_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLAGOS_")}
    vendor_vars = {k: os.environ[k] for k in VENDOR_ENV_VARS if k in os.environ}
    return {**flagos_vars, **vendor_vars}


def config_problems() -> list[str]:
    """Runtime variables whose values flagos would refuse at activation."""
    problems = []
    for var in _env.ENV_VARS:
        try:
            _env.get(var.name)
        except Exception as e:  # ConfigError: the message names the valid values
            problems.append(str(e))
    return problems


def adapter_search_path() -> list[dict]:
    """The folders adapters are looked up in, in order, with the libraries each holds."""
    extra = [d for d in _env.get("FLAGOS_ADAPTER_PATH").split(os.pathsep) if d]
    folders = [(d, "FLAGOS_ADAPTER_PATH") for d in extra] + [(PACKAGE_DIR, "package")]
    out = []
    for folder, source in folders:
        exists = os.path.isdir(folder)
        libraries = sorted(n for n in os.listdir(folder)
                           if n.startswith("libflagos_") and n.endswith(".so")) if exists else []
        out.append({"folder": folder, "source": source, "exists": exists, "libraries": libraries})
    return out


# ---- chip status ---------------------------------------------------------------------

def natural_mode(profile) -> str:
    """The mode `activate()` picks for the chip when FLAGOS_MODE is not set."""
    if getattr(profile, "owns_privateuse1", False):
        return "native"
    if isinstance(profile, AdapterChip) or device_mode_supported():
        return "device"
    return "native"


def _status(profile, kind: str, status: str, problem: str = "", reason: str = "",
            device_count: int = 0, versions_: dict | None = None, source: str = "") -> dict:
    return {"chip": profile.name, "kind": kind, "status": status, "problem": problem,
            "reason": reason, "vendor": _vendor(profile), "device_count": device_count,
            "mode": natural_mode(profile), "versions": versions_ or {}, "source": source}


def _vendor(profile) -> str:
    try:
        return profile.vendor or ""
    except Exception:
        return ""


def _load_failure(text: str) -> tuple[str, str]:
    """(problem, reason) for an adapter library that cannot be used, from the loader's message."""
    rules = (
        ("adapter ABI", "abi_mismatch", "ABI mismatch"),
        ("cannot open shared object file", "driver_missing",
         "driver missing (a library the adapter needs is not installed)"),
        ("undefined symbol", "missing_symbol", "missing symbol"),
        ("exports no", "not_an_adapter", "not a flagos adapter"),
        ("entry point", "missing_entry_point", "missing entry point"),
        ("init() failed", "init_failed", "init failed"),
    )
    for needle, problem, label in rules:
        if needle in text:
            return problem, f"{label}: {text}"
    return "load_error", f"load error: {text}"


def _adapter_status(profile: AdapterChip) -> dict:
    path = find_library(profile.name)
    if path is None:
        folders = ", ".join(e["folder"] for e in adapter_search_path())
        return _status(profile, "adapter", UNAVAILABLE, "library_missing",
                       f"library missing: no libflagos_{profile.name}_adapter.so in {folders}"
                       + (f"; {profile.install}" if profile.install else ""))
    try:
        adapter = load(path)
        count = adapter.device_count()
    except AdapterError as e:
        problem, reason = _load_failure(str(e))
        return _status(profile, "adapter", BROKEN, problem, reason, source=path)
    except DeviceError as e:
        return _status(profile, "adapter", BROKEN, "device_error", f"device error: {e}", source=path)
    major, minor = adapter.abi
    found = {"adapter_abi": f"{major}.{minor}"}
    if count < 1:
        return _status(profile, "adapter", UNAVAILABLE, "no_devices", "no devices: the adapter "
                       "reports 0 devices" + (f"; {profile.install}" if profile.install else ""),
                       versions_=found, source=path)
    return _status(profile, "adapter", AVAILABLE, device_count=count, versions_=found, source=path)


def _import_failure(plugin: str, e: BaseException) -> tuple[str, str]:
    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if "undefined symbol" in text or "incompatible" in text.lower():
        return "abi_mismatch", (f"ABI mismatch: {plugin} was built for another PyTorch than "
                                f"{torch.__version__} ({text}); install the {plugin} release "
                                f"made for this PyTorch")
    if "cannot open shared object file" in text or "libascend" in text.lower():
        return "driver_missing", (f"driver missing: {plugin} cannot load a vendor library "
                                  f"({text}); install the vendor driver/toolkit and source its "
                                  f"environment script")
    return "load_error", f"load error: import {plugin} failed ({text})"


def _torch_versions(profile) -> dict:
    found = {}
    if profile.plugin:
        mod = sys.modules.get(profile.plugin)
        found[profile.plugin] = getattr(mod, "__version__", "unknown")
    if profile.name == "cuda":
        if torch.version.cuda:
            found["cuda_runtime"] = torch.version.cuda
        if getattr(torch.version, "hip", None):
            found["hip"] = torch.version.hip
        try:
            found["cudnn"] = str(torch.backends.cudnn.version())
        except Exception:
            pass
        driver = _nvidia_driver_version()
        if driver:
            found["driver"] = driver
    if profile.name == "xpu" and getattr(torch.version, "xpu", None):
        found["xpu"] = torch.version.xpu
    if profile.name == "cpu":
        found["threads"] = str(torch.get_num_threads())
        found["simd"] = torch.backends.cpu.get_cpu_capability()
    return found


@functools.cache
def _nvidia_driver_version() -> str:
    try:
        import pynvml
        pynvml.nvmlInit()
        value = pynvml.nvmlSystemGetDriverVersion()
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # pynvml is optional and the driver may be absent
        return ""


def _not_built_reason(profile) -> str:
    """Why a PyTorch-native chip cannot exist in this PyTorch build at all ('' if it can)."""
    if profile.name == "cuda" and not torch.version.cuda and not getattr(torch.version, "hip", None):
        return f"this PyTorch ({torch.__version__}) is built without CUDA or ROCm"
    if profile.name == "mps" and not torch.backends.mps.is_built():
        return f"this PyTorch ({torch.__version__}) is built without MPS (macOS builds only)"
    xpu_compiled = getattr(getattr(torch, "xpu", None), "_is_compiled", lambda: False)
    if profile.name == "xpu" and not getattr(torch.version, "xpu", None) and not xpu_compiled():
        return f"this PyTorch ({torch.__version__}) is built without XPU"
    return ""


def _torch_status(profile) -> dict:
    if profile.plugin:
        if importlib.util.find_spec(profile.plugin) is None:
            return _status(profile, "torch", UNAVAILABLE, "package_missing",
                           f"package missing: {profile.plugin} is not installed",
                           source=profile.plugin)
        try:
            importlib.import_module(profile.plugin)
        except Exception as e:  # a broken vendor package is a finding, never a crash
            problem, reason = _import_failure(profile.plugin, e)
            return _status(profile, "torch", BROKEN, problem, reason, source=profile.plugin)
    source = profile.plugin or f"torch.{profile.torch_type}"
    not_built = _not_built_reason(profile)
    if not_built:
        return _status(profile, "torch", UNAVAILABLE, "not_built", f"not built: {not_built}",
                       source=source)
    module = torch_module(profile.torch_type)
    if module is None:
        return _status(profile, "torch", UNAVAILABLE, "not_built",
                       f"not built: this PyTorch has no torch.{profile.torch_type}", source=source)
    try:
        present = profile.name == "cpu" or bool(module.is_available())
        count = profile.device_count() if present else 0
    except Exception as e:
        return _status(profile, "torch", BROKEN, "load_error",
                       f"load error: torch.{profile.torch_type} failed ({type(e).__name__}: {e})",
                       source=source)
    found = _torch_versions(profile)
    if not present:
        return _status(profile, "torch", UNAVAILABLE, "driver_missing",
                       f"driver missing or no device: torch.{profile.torch_type}.is_available() "
                       f"is False", versions_=found, source=source)
    if count < 1:
        return _status(profile, "torch", UNAVAILABLE, "no_devices", "no devices",
                       versions_=found, source=source)
    return _status(profile, "torch", AVAILABLE, device_count=count, versions_=found, source=source)


def chip_status(name: str) -> dict:
    """One chip's status: {"chip", "kind", "status", "problem", "reason", "vendor",
    "device_count", "mode", "versions", "source"}; status is available, unavailable or broken."""
    profile = chips.profile(name)
    if isinstance(profile, AdapterChip):
        return _adapter_status(profile)
    return _torch_status(profile)


def chip_statuses(names: list[str] | None = None) -> list[dict]:
    """The status of every chip flagos knows (or of `names`), in `auto`'s order."""
    return [chip_status(n) for n in (chips.known() if names is None else names)]


def known_chips() -> tuple[str, ...]:
    return chips.known()


# ---- devices -------------------------------------------------------------------------

def _active_mode(chip: str) -> str | None:
    state = _state.active_or_none()
    return state.mode if state is not None and state.chip.name == chip else None


def _native_dtypes(profile, index: int) -> list[str]:
    if isinstance(profile, AdapterChip):
        mask = profile.adapter.props(index)["native_dtypes"]
        return [n for i, n in enumerate(DTYPE_NAMES) if mask >> i & 1]
    return list(profile.native_dtypes)


def _memory(profile, index: int) -> tuple[int, int]:
    """(used, total) bytes of the whole device, as nvidia-smi counts them: total - free."""
    try:
        free, total = profile.mem_get_info(index)
    except (AttributeError, NotImplementedError):  # no device-wide query (mps): this process's
        return int(profile.memory_reserved(index)), int(profile.total_memory(index))
    return int(total) - int(free), int(total)


def device_row(profile, index: int, mode: str, utilization: bool = False) -> dict:
    """One device: chip, index, name, vendor, memory used/total (bytes), native dtypes, mode, status
    ("ok" or "error: ..."), and utilization (0..1, None where the chip does not expose it)."""
    row = {"chip": profile.name, "index": index, "name": None, "vendor": "", "memory_used": None,
           "memory_total": None, "native_dtypes": [], "mode": mode, "status": "ok"}
    if utilization:
        row["utilization"] = None
    try:
        row["name"] = profile.device_name(index)
        row["vendor"] = profile.vendor  # after the name: the cuda chip reads its vendor from it
        row["memory_used"], row["memory_total"] = _memory(profile, index)
        row["native_dtypes"] = _native_dtypes(profile, index)
        if utilization:
            row["utilization"] = device_utilization(profile, index)
    except Exception as e:  # a failed device is a row that says why, not a crash
        row["status"] = f"error: {type(e).__name__}: {e}"
    return row


def device_rows(statuses: list[dict] | None = None, utilization: bool = False) -> list[dict]:
    """One row per device of every available chip (of `statuses`, default: every chip)."""
    rows = []
    for status in statuses if statuses is not None else chip_statuses():
        if status["status"] != AVAILABLE:
            continue
        profile = chips.profile(status["chip"])
        mode = _active_mode(profile.name) or status["mode"]
        rows += [device_row(profile, i, mode, utilization) for i in range(status["device_count"])]
    return rows


# ---- utilization -----------------------------------------------------------------------

_cpu_sample: tuple[int, int] | None = None
_cpu_ratio = 0.0
_cpu_lock = threading.Lock()  # an exporter answers scrapes from several threads


def _read_cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_utilization() -> float | None:
    """Busy share of the host CPUs since the previous call (the first call samples 0.1 s)."""
    global _cpu_sample, _cpu_ratio
    with _cpu_lock:
        if _cpu_sample is None:
            _cpu_sample = _read_cpu_times()
            time.sleep(0.1)
        now = _read_cpu_times()
        if now is None or _cpu_sample is None:
            return None
        busy, total = now[0] - _cpu_sample[0], now[1] - _cpu_sample[1]
        if total > 0:  # else asked again within one clock tick: the last answer stands
            _cpu_sample, _cpu_ratio = now, round(busy / total, 4)
        return _cpu_ratio


def device_utilization(profile, index: int) -> float | None:
    """0..1 where the chip exposes it (the host for cpu; torch.<chip>.utilization, which needs
    the vendor's management library, for GPUs and NPUs); None elsewhere (sim, adapters)."""
    if profile.name == "cpu":
        return cpu_utilization()
    if isinstance(profile, AdapterChip):
        return None
    query = getattr(torch_module(profile.torch_type), "utilization", None)
    if query is None:
        return None
    try:
        return float(query(index)) / 100.0
    except Exception:  # no management library (pynvml, ...): not exposed
        return None

"""Every environment variable flagos reads, in one table.

docs/environment.md documents exactly these (tests/test_env_docs.py fails when
the two disagree). Values are read when used, never cached at import, so a
test or a launcher can set them late.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    summary: str
    choices: tuple[str, ...] = ()


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("FLAGOS_DEVICE", "", "chip to activate at `import torch` (autoload) or by "
           "`activate()` with no argument: auto, cpu, cuda, npu, ..., or a vendor name (ascend, hygon, "
           "...: docs/chips.md); unset: autoload does nothing"),
    EnvVar("FLAGOS_DEVICE_BACKEND", "", "alias of FLAGOS_DEVICE (the name FlagOS users know); "
           "FLAGOS_DEVICE wins when both are set"),
    EnvVar("FLAGOS_MODE", "", "device (flagos owns PrivateUse1) or native (the chip keeps its own "
           "device type); unset: native for chips whose plugin owns PrivateUse1, device otherwise",
           ("device", "native")),
    EnvVar("FLAGOS_REDIRECT_CUDA", "0", "1: code written for CUDA runs on the active chip "
           "(\"cuda\" device arguments, `.cuda()`, `torch.cuda.*`, autocast, GradScaler, "
           "init_process_group(\"nccl\")); the same as `activate(redirect_cuda=True)`",
           ("0", "1", "true", "false", "yes", "no", "on", "off")),
    EnvVar("FLAGOS_ADAPTER_PATH", "", "folders (os.pathsep-separated) searched for chip adapter "
           "libraries `libflagos_<chip>_adapter.so` before the package's own"),
    EnvVar("FLAGOS_COVERAGE_PATH", "", "folders (os.pathsep-separated) searched for coverage "
           "files `<chip>.json` (`flagos analyze --target`) before the package's own"),
    EnvVar("FLAGOS_FALLBACK", "warn", "what a CPU fallback does: allow (silently), warn (once per "
           "op) or error (raise before running the op)", ("allow", "warn", "error")),
    EnvVar("FLAGOS_FALLBACK_STAGING", "256M", "bytes of host staging buffers the CPU fallback "
           "keeps between calls (K, M, G suffixes; 0 keeps none); torch.flagos.empty_cache() "
           "frees them"),
    EnvVar("FLAGOS_DTYPE_POLICY", "strict", "what bfloat16 work does on a chip whose bfloat16 is "
           "not native: strict (runs as asked; ops the chip lacks fall back) or downcast (runs in "
           "float16, float32 where float16 is not native either); the same as "
           "`activate(dtype_policy=...)`", ("strict", "downcast")),
    EnvVar("FLAGOS_ROUTE", "", "forced routes, comma-separated `op=route` pairs, e.g. "
           "`aten::mm=fallback,aten::softmax=native`; routes: auto, override, native, fallback, error"),
    EnvVar("FLAGOS_REPORT", "", "path where the fallback report is written as JSON at process exit"),
    EnvVar("FLAGOS_CACHE_DIR", "", "folder holding one cache folder per chip, vendor and device "
           "architecture, where activation points Inductor's and Triton's caches unless "
           "TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR are set; unset: $XDG_CACHE_HOME/flagos or "
           "~/.cache/flagos"),
    EnvVar("FLAGOS_LOG_LEVEL", "warning", "level of the `flagos` logger",
           ("debug", "info", "warning", "error", "critical")),
)

_BY_NAME = {v.name: v for v in ENV_VARS}


def get(name: str) -> str:
    """The variable's value (stripped), or its default; checked against its choices."""
    var = _BY_NAME[name]
    raw = os.environ.get(name)
    value = var.default if raw is None else raw.strip()
    if var.choices and value and value.lower() not in var.choices:
        raise ConfigError(
            f"{name}={raw!r} is not valid; use one of: {', '.join(var.choices)}"
        )
    return value.lower() if var.choices else value


def is_set(name: str) -> bool:
    """Whether the variable is set to something other than blanks."""
    return bool(os.environ.get(name, "").strip())


def flag(name: str) -> bool:
    """A yes/no variable: 1, true, yes, on."""
    return get(name) in ("1", "true", "yes", "on")


def requested_device() -> str:
    """FLAGOS_DEVICE, else its alias FLAGOS_DEVICE_BACKEND; '' when neither is set."""
    return get("FLAGOS_DEVICE") or get("FLAGOS_DEVICE_BACKEND")

"""The precision policy: which dtypes the active chip runs natively, and what bfloat16 work
becomes where bfloat16 is not native (dtype_policy "strict" or "downcast")."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from . import _env, _state

POLICIES = ("strict", "downcast")
# The low-precision dtypes, best first: what preferred_dtype() and the downcast pick from.
_LOW_PRECISION = (torch.bfloat16, torch.float16, torch.float32)


def check_policy(value: str, where: str = "dtype_policy") -> str:
    """The policy a user typed, lower-cased; ConfigError naming the valid ones otherwise."""
    policy = value.strip().lower() if isinstance(value, str) else value
    if policy not in POLICIES:
        raise ConfigError(f"{where}={value!r} is not valid; use one of: {', '.join(POLICIES)}")
    return policy


def env_policy() -> str | None:
    """FLAGOS_DTYPE_POLICY when it is set (checked), else None."""
    return _env.get("FLAGOS_DTYPE_POLICY") if _env.is_set("FLAGOS_DTYPE_POLICY") else None


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 or 'bfloat16'; ConfigError for anything else."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        return str(getattr(torch, dtype.removeprefix("torch."))).removeprefix("torch.")
    raise ConfigError(f"{dtype!r} is not a torch dtype; pass one such as torch.bfloat16")


def substitute(native_dtypes) -> torch.dtype | None:
    """What bfloat16 work runs in on a chip with these native dtypes: None where bfloat16 is
    native, else float16, else float32."""
    if "bfloat16" in native_dtypes:
        return None
    return torch.float16 if "float16" in native_dtypes else torch.float32


def supports_dtype(dtype) -> bool:
    """Whether the active chip runs `dtype` natively (its own kernels, no CPU fallback)."""
    return dtype_name(dtype) in _state.active().chip.native_dtypes


def preferred_dtype() -> torch.dtype:
    """The best low-precision dtype the active chip runs natively: bfloat16 where it is native,
    else float16, else float32."""
    native = _state.active().chip.native_dtypes
    return next((d for d in _LOW_PRECISION if dtype_name(d) in native), torch.float32)

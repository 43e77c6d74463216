"""The exceptions and warnings flagos raises: one vocabulary on every chip."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad value in an environment variable or an API argument; the message names valid ones."""


class ChipNotFoundError(ConfigError):
    """The requested chip is unknown or not available on this machine."""


class AdapterError(RuntimeError):
    """A chip adapter library cannot be used: it does not load, lacks an entry point, speaks
    another ABI major version, or its init() failed. The message names the file and why."""


class DeviceMismatchError(RuntimeError):
    """A flagos tensor and a tensor on another device met in one op."""


class FallbackError(RuntimeError):
    """An op would fall back to the CPU while FLAGOS_FALLBACK=error, or is routed to 'error'."""


class FallbackWarning(UserWarning):
    """An op falls back to the CPU (given once per op while FLAGOS_FALLBACK=warn)."""


class DowncastWarning(UserWarning):
    """bfloat16 work runs in another dtype (dtype_policy="downcast" on a chip whose bfloat16 is
    not native); given once, at the first op it changes."""


class DeviceError(RuntimeError):
    """A chip failure other than out-of-memory, in one form on every chip."""

    def __init__(self, message: str, *, chip: str, code: int | None = None,
                 code_name: str | None = None, hint: str | None = None):
        super().__init__(message)
        self.chip = chip
        self.code = code
        self.code_name = code_name
        self.hint = hint


class NoEngineQueueError(RuntimeError):
    """backward() over flagos tensors that autograd's engine cannot schedule: a backward ran
    before activation, or the tensors are on flagos:1 and above (the message says which)."""


class AcceleratorBackwardError(RuntimeError):
    """backward() over tensors of PyTorch's own accelerator (plain cuda tensors, say) in a process
    where flagos holds the PrivateUse1 device: PyTorch's autograd engine cannot run it there."""

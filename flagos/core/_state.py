"""The chip flagos runs on in this process: what every layer above asks, and `info()`.

Activation (flagos/_activation.py) sets it; everything else only reads it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .. import _C, __version__
from . import _env, _routes

TESTED_TORCH = ("2.9", "2.14")


@dataclass
class Active:
    """The chip flagos runs on in this process."""
    chip: object                # a chips.base.TorchChip (an AdapterChip for C-ABI chips)
    mode: str
    device_count: int
    native_mode: object = None  # the dispatch mode object in native mode
    native_thread: int = 0      # the thread whose dispatch mode stack holds it
    backward_ok: bool = True    # autograd's engine has a queue for flagos (see _activation)
    redirect_cuda: bool = False  # "cuda" means this chip (integrations/_redirect.py)
    dtype_policy: str = "strict"  # "downcast": bfloat16 work runs in downcast_to (core/_precision.py)
    downcast_to: torch.dtype | None = None  # None: bfloat16 runs as bfloat16
    flagos_devices: tuple = field(default_factory=tuple)
    caches: dict = field(default_factory=dict)  # the chip's cache folder (integrations/_caches.py)
    _thread: threading.local = field(default_factory=threading.local, repr=False, compare=False)

    # The current device is the calling thread's, as CUDA's: a thread that serves one device
    # (torch.flagos.set_device(i)) does not move the others; a new thread starts on flagos:0.
    @property
    def current(self) -> int:
        return getattr(self._thread, "index", 0)

    @current.setter
    def current(self, index: int) -> None:
        self._thread.index = index

    def chip_index(self, index: int) -> int:
        if not 0 <= index < self.device_count:
            raise ValueError(f"flagos:{index} does not exist: chip '{self.chip.name}' has "
                             f"{self.device_count} device(s)")
        return index


_active: Active | None = None
_refusal: str | None = None   # this process may not use the chip (a fork the chip does not survive)


def set_active(state: Active | None) -> None:
    """Activation's word: the process now runs on `state` (None: native mode left)."""
    global _active
    _active = state


def active_or_none() -> Active | None:
    return _active


def refuse(message: str) -> None:
    """From now on this process may not use the chip: active() raises `message`."""
    global _refusal
    _refusal = message


def refusal() -> str | None:
    return _refusal


def active() -> Active:
    if _refusal is not None:
        raise RuntimeError(_refusal)
    if _active is None:
        raise RuntimeError("flagos is not active: call flagos.activate() first "
                           "(or set FLAGOS_DEVICE=auto before `import torch`)")
    return _active


def set_current(index: int) -> None:
    state = active()
    state.chip_index(index)
    if not state.chip.payload_is_host:
        state.chip.set_device(index)
    _C.set_current_device(index)  # torch.zeros(n, device="flagos") is then on flagos:index
    state.current = index


def device(index: int | None = None) -> torch.device:
    """The device to move models and tensors to: flagos:N in device mode, the chip's own
    device (npu:N, cpu) in native mode."""
    state = active()
    index = state.current if index is None else index
    state.chip_index(index)
    return state.flagos_devices[index]


def info() -> dict:
    """What flagos runs on, and how it is configured."""
    state = _active
    out = {
        "version": __version__,
        "torch": torch.__version__,
        "torch_tested": f"{TESTED_TORCH[0]} to {TESTED_TORCH[1]}",
        "active": state is not None,
        "fallback": _env.get("FLAGOS_FALLBACK") or "warn",
        "forced_routes": _routes.forced_routes(),
        "report_path": _env.get("FLAGOS_REPORT") or None,
    }
    if state is not None:
        out.update(
            chip=state.chip.name, vendor=state.chip.vendor, mode=state.mode,
            device=str(device()), device_count=state.device_count,
            devices=[state.chip.device_name(i) for i in range(state.device_count)],
            native_dtypes=list(state.chip.native_dtypes),
            collective_backend=state.chip.collective_backend,
            backward=state.backward_ok,
            redirect_cuda=state.redirect_cuda,
            dtype_policy=state.dtype_policy,
            downcast_to=str(state.downcast_to).removeprefix("torch.") if state.downcast_to else None,
            caches=dict(state.caches),
        )
    return out

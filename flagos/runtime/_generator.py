"""Per-device random generators: `torch.Generator(device=flagos.device())`.

PyTorch builds a generator for a PrivateUse1 device by asking the backend's C++ hooks
(`getNewGenerator`), which a Python backend cannot provide. So, while flagos is the device,
`torch.Generator` is a subclass of PyTorch's own generator type whose metaclass sends
`device="flagos[:N]"` to a `FlagosGenerator`, and everything else to PyTorch unchanged.

A FlagosGenerator *is* the chip's own generator (a CPU generator on the cpu chip and on
adapter chips, whose random ops run on the host; a CUDA generator on the cuda chip) that reports
`.device == flagos:N`. Random ops reach the payload op with it untouched, so a seeded flagos
generator draws exactly the numbers the same generator draws on the payload device.
"""
from __future__ import annotations

import torch

from ..core import _state

_TORCH_GENERATOR = torch._C.Generator   # PyTorch's type; FlagosGenerator derives from it
_saved = None                           # what torch.Generator was before install()


def _flagos_index(device) -> int | None:
    """The flagos device index a Generator(device=...) argument names, or None if not flagos."""
    if device is None or isinstance(device, int):
        return None
    if isinstance(device, str):
        if not device.startswith("flagos"):
            return None
        device = torch.device(device)
    if not isinstance(device, torch.device) or device.type != "flagos":
        return None
    state = _state.active()
    return state.chip_index(state.current if device.index is None else device.index)


class FlagosGenerator(_TORCH_GENERATOR):
    """The generator of flagos:N: the chip's own generator, reporting the flagos device."""

    def __new__(cls, index: int | None = None):
        state = _state.active()
        index = state.chip_index(state.current if index is None else index)
        self = super().__new__(cls, device=state.chip.torch_device(index))
        self._flagos_device = torch.device("flagos", index)
        return self

    @property
    def device(self) -> torch.device:
        return self._flagos_device

    def __repr__(self) -> str:
        return f"<torch.Generator object on {self._flagos_device}>"

    def __reduce__(self):
        # PyTorch's own __reduce__ would rebuild a plain generator of the payload device.
        return _rebuild, (self._flagos_device.index, self.get_state())


def _rebuild(index: int, state: torch.Tensor) -> FlagosGenerator:
    generator = FlagosGenerator(index)
    generator.set_state(state)
    return generator


class _GeneratorMeta(type(_TORCH_GENERATOR)):
    """Metaclass of the installed torch.Generator: routes construction by device, and keeps
    every generator (PyTorch's and flagos's) an instance of torch.Generator."""

    def __call__(cls, device="cpu"):
        if cls is not Generator:  # a user's subclass of torch.Generator builds as before
            return super().__call__(device)
        index = _flagos_index(device)
        if index is None:
            return _TORCH_GENERATOR(device=device)
        return FlagosGenerator(index)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _TORCH_GENERATOR)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, _TORCH_GENERATOR)


class Generator(_TORCH_GENERATOR, metaclass=_GeneratorMeta):
    __doc__ = _TORCH_GENERATOR.__doc__


Generator.__module__ = "torch"
Generator.__qualname__ = "Generator"


def install() -> None:
    """Make torch.Generator accept the flagos device (at activation, device mode)."""
    global _saved
    if torch.Generator is Generator:
        return
    _saved = torch.Generator
    torch.Generator = Generator


def uninstall() -> None:
    """Give torch.Generator back (generators already made keep working on their payload)."""
    global _saved
    if _saved is not None and torch.Generator is Generator:
        torch.Generator = _saved
    _saved = None

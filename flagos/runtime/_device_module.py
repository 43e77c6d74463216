"""`torch.flagos`: the device module PyTorch looks up for the flagos device.

Every function answers for the active chip, so the same code reads CUDA's
allocator on the cuda chip and the host on the cpu chip.
"""
from __future__ import annotations

import types
from collections import OrderedDict

import torch

from .. import _C
from ..core import _state
from ._streams import Event, Stream, StreamContext, current_stream, default_stream, set_stream, stream  # noqa: F401


def _index(device=None) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return current_device() if device.index is None else device.index


def is_available() -> bool:
    return _state.active_or_none() is not None


def is_initialized() -> bool:
    return is_available()


def _is_in_bad_fork() -> bool:
    """A fork of a process whose chip does not survive fork (PyTorch then leaves the device
    alone in the child: its seeding, its DataLoader workers)."""
    return _state.refusal() is not None


def device_count() -> int:
    state = _state.active_or_none()
    return state.device_count if state else 0


def current_device() -> int:
    return _state.active().current


def set_device(device) -> None:
    _state.set_current(_index(device))


class device:
    """Context manager that makes `device` the current flagos device."""

    def __init__(self, device):
        self.index = _index(device)
        self.prev = None

    def __enter__(self):
        self.prev = current_device()
        set_device(self.index)

    def __exit__(self, *exc):
        set_device(self.prev)
        return False


def synchronize(device=None) -> None:
    state = _state.active()
    state.chip.synchronize(state.chip_index(_index(device)))


def memory_allocated(device=None) -> int:
    state = _state.active()
    return state.chip.memory_allocated(state.chip_index(_index(device)))


def max_memory_allocated(device=None) -> int:
    state = _state.active()
    return state.chip.max_memory_allocated(state.chip_index(_index(device)))


def memory_reserved(device=None) -> int:
    state = _state.active()
    return state.chip.memory_reserved(state.chip_index(_index(device)))


def reset_peak_memory_stats(device=None) -> None:
    state = _state.active()
    state.chip.reset_peak_memory_stats(state.chip_index(_index(device)))


def max_memory_reserved(device=None) -> int:
    """Peak of memory_reserved(): the chip's own figure where it keeps one; otherwise the best
    lower bound flagos has (the reserved bytes now, or the peak of allocated bytes)."""
    state = _state.active()
    index = state.chip_index(_index(device))
    own = getattr(state.chip, "_mem", None)   # torch-native chips: torch.<chip>'s figure
    peak = own("max_memory_reserved", index, None) if own else None
    if peak is not None:
        return int(peak)
    return max(state.chip.memory_reserved(index), state.chip.max_memory_allocated(index))


def memory_stats(device=None) -> OrderedDict[str, int]:
    """The allocator statistics every chip reports, under PyTorch's key names (the subset of
    torch.cuda.memory_stats() that flagos can answer on every chip)."""
    index = _index(device)
    allocated, peak = memory_allocated(index), max_memory_allocated(index)
    reserved, reserved_peak = memory_reserved(index), max_memory_reserved(index)
    return OrderedDict([
        ("allocated_bytes.all.current", allocated), ("allocated_bytes.all.peak", peak),
        ("reserved_bytes.all.current", reserved), ("reserved_bytes.all.peak", reserved_peak),
    ])


def empty_cache() -> None:
    """The chip's cached memory, and the CPU fallback's host staging buffers (_C.staging_*)."""
    _C.staging_release()
    _state.active().chip.empty_cache()


def mem_get_info(device=None) -> tuple[int, int]:
    state = _state.active()
    return state.chip.mem_get_info(state.chip_index(_index(device)))


def manual_seed(seed: int) -> None:
    _state.active().chip.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    _state.active().chip.manual_seed_all(int(seed))


def get_rng_state(device=None) -> torch.Tensor:
    state = _state.active()
    return state.chip.get_rng_state(state.chip_index(_index(device)))


def set_rng_state(new_state: torch.Tensor, device=None) -> None:
    state = _state.active()
    state.chip.set_rng_state(new_state, state.chip_index(_index(device)))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(index) for index in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for index, new_state in enumerate(new_states):
        set_rng_state(new_state, index)


def seed() -> None:
    """A random seed for the current device's generator (all of them where the chip's random
    ops run on the host: there is one generator)."""
    _state.active().chip.seed()


def seed_all() -> None:
    _state.active().chip.seed_all()


def initial_seed() -> int:
    return _state.active().chip.initial_seed()


# ---- what the device is (as torch.cuda answers; the CUDA redirect serves these too) ----

class _Properties(types.SimpleNamespace):
    """What `get_device_properties` answers for the active chip, with the fields CUDA's has:
    the ones the chip knows (name, total_memory); CUDA-only figures read 0."""


def get_device_name(device=None) -> str:
    state = _state.active()
    return state.chip.device_name(state.chip_index(_index(device)))


def get_device_properties(device=None) -> _Properties:
    state = _state.active()
    index = state.chip_index(_index(device))
    return _Properties(name=state.chip.device_name(index), total_memory=state.chip.total_memory(index),
                       major=0, minor=0, multi_processor_count=0, type=state.chip.name)


def is_bf16_supported(including_emulation: bool = False) -> bool:
    """Whether the chip runs bfloat16 natively (emulated or fallen-back bf16 says False, so a
    script that picks its dtype with this picks float16 there)."""
    return "bfloat16" in _state.active().chip.native_dtypes


def get_device_capability(device=None) -> tuple[int, int]:
    """(0, 0): the flagos device has no CUDA compute capability, so a library that gates a
    CUDA-only kernel (flash attention, bf16 tensor cores) on `>= (8, 0)` takes its portable
    path (under the CUDA redirect too)."""
    state = _state.active()
    state.chip_index(_index(device))
    return (0, 0)


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """What the chip's allocator reports, in words (PyTorch's table needs statistics of
    the CUDA caching allocator that other chips do not keep)."""
    state = _state.active()
    index = state.chip_index(_index(device))
    stats = memory_stats(index)
    free, total = mem_get_info(index)

    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"

    return "\n".join([
        f"flagos memory summary, flagos:{index} (chip {state.chip.name}, {state.chip.device_name(index)})",
        f"  allocated: {mib(stats['allocated_bytes.all.current'])} (peak {mib(stats['allocated_bytes.all.peak'])})",
        f"  reserved:  {mib(stats['reserved_bytes.all.current'])} (peak {mib(stats['reserved_bytes.all.peak'])})",
        f"  device:    {mib(free)} free of {mib(total)}",
    ])


def get_amp_supported_dtype() -> list[torch.dtype]:
    # Both run on every chip: natively where the chip declares them, else through the
    # fallback (and the report says so). Refusing one would silently turn autocast off.
    return [torch.float16, torch.bfloat16]


def info() -> dict:
    return _state.info()

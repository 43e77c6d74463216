"""Code written for CUDA, run unchanged on the active chip (`activate(redirect_cuda=True)`,
`FLAGOS_REDIRECT_CUDA=1`).

`torch.device("cuda")` is parsed in C++ and nothing can make it mean another device, so the
redirect rewrites device arguments where they enter PyTorch: the Python-visible functions and
methods that take a device (factories, `Tensor.to`/`.cuda()`/`.type()`, `Module.cuda()`,
`torch.load`, `torch.Generator`, autocast, GradScaler, `init_process_group`: "nccl" becomes
`flagos.dist_backend()`) are replaced by wrappers that turn "cuda", "cuda:N" and
`torch.device("cuda", N)` into the active chip's device (flagos:N in device mode, the chip's own
device in native mode), and `torch.cuda` is replaced by a module whose common functions and
legacy tensor types (`torch.cuda.FloatTensor`, ...) answer for the active chip (everything else
falls through to PyTorch's own `torch.cuda`). Only the wrapped entry points pay (a Python call);
ordinary ops pay nothing, and with the redirect off nothing is installed. Why wrappers and not a TorchFunctionMode, and
what each costs: docs/design.md §16.

flagos's own detection reads the real module (`sys.modules["torch.cuda"]`, see
`chips.base.torch_module`), never the replacement. On the cuda chip the redirect is a no-op.
`ENTRY_POINTS` lists every redirected entry point; tests/test_redirect.py checks each.
"""
from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import types
import warnings

import torch
import torch.utils._device

from ..core import _state
from ..runtime import _device_module
from . import _distributed

log = logging.getLogger("flagos")

# Every redirected entry point, by the name users call it. tests/test_redirect.py holds one
# check per name and fails when a name has none (or a check names no entry point).
FACTORIES = (
    "empty", "empty_strided", "zeros", "ones", "full", "rand", "randn", "randint", "randperm",
    "arange", "linspace", "logspace", "eye", "tensor", "as_tensor", "scalar_tensor", "normal",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "tril_indices", "triu_indices",
)
TENSOR_METHODS = ("to", "cuda", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
CUDA_FUNCTIONS = (
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "device",
    "synchronize", "manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state",
    "get_rng_state_all", "set_rng_state_all", "seed", "seed_all", "initial_seed", "random",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "memory_stats", "mem_get_info", "empty_cache",
    "get_device_name", "get_device_properties", "is_bf16_supported", "Event", "Stream", "stream", "current_stream",
    "default_stream", "get_device_capability", "init", "is_current_stream_capturing", "ipc_collect",
    "set_per_process_memory_fraction", "memory_summary", "nvtx",
    "CUDAGraph", "graph", "make_graphed_callables", "graph_pool_handle",
)
# The legacy tensor types of CUDA (`torch.cuda.FloatTensor(2, 3)`, `x.type(torch.cuda.LongTensor)`,
# `Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor` in older scripts), by dtype.
LEGACY_TYPES = {
    "FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
    "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8,
    "BoolTensor": torch.bool,
}
ENTRY_POINTS = (
    tuple(f"torch.{n}" for n in FACTORIES)
    + tuple(f"torch.Tensor.{n}" for n in TENSOR_METHODS) + ("torch.Tensor.type",)
    + ("torch.nn.Module.cuda", "torch.load", "torch.Generator", "torch.set_default_device",
       "torch.autocast",
       "torch.amp.GradScaler", "torch.cuda.amp.GradScaler",
       "torch.distributed.init_process_group")
    + tuple(f"torch.cuda.{n}" for n in CUDA_FUNCTIONS)
    + tuple(f"torch.cuda.{n}" for n in LEGACY_TYPES)
)

_DEVICE_KWARGS = ("device",)
_saved: list[tuple[object, str, object]] = []   # (owner, attribute, original), to uninstall
_target_type = ""                               # "flagos" (device mode) or the chip's type
_strings: dict[str, torch.device] = {}          # "cuda:N" -> the chip's device, parsed once


# ---- mapping one device argument -----------------------------------------------------

def is_installed() -> bool:
    return bool(_saved)


def _map(value):
    """The active chip's device for a CUDA device argument; anything else unchanged."""
    tp = type(value)
    if tp is str:
        if not value.startswith("cuda"):
            return value
        mapped = _strings.get(value)
        if mapped is None:
            mapped = _strings[value] = _map(torch.device(value))
        return mapped
    if tp is not torch.device or value.type != "cuda":
        return value
    return torch.device(_target_type, value.index) if value.index is not None \
        else torch.device(_target_type)


def _map_index(device):
    """`.cuda(device)` / `torch.cuda.set_device(device)`: None or an index is a CUDA index."""
    if device is None:  # the current device, as `.cuda()` means on CUDA, in either mode
        return torch.device(_target_type, _state.active().current)
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device(_target_type, device)
    return _map(device)


def _rewrite(fn, ints=False):
    """`fn` with its device arguments (positional or keyword) mapped to the active chip."""
    @functools.wraps(fn)
    def redirected(*args, **kwargs):
        if kwargs:
            for key in _DEVICE_KWARGS:
                value = kwargs.get(key)
                if value is not None:
                    kwargs[key] = _map(value)
        for i, arg in enumerate(args):
            tp = type(arg)
            if tp is str or tp is torch.device or (ints and tp is int and i == 1):
                args = args[:i] + (_map_index(arg) if tp is int else _map(arg),) + args[i + 1:]
        return fn(*args, **kwargs)
    redirected.__flagos_redirect__ = fn
    return redirected


_ABSENT = object()   # the attribute was inherited: uninstall deletes it again


def _load(load):
    """torch.load(map_location="cuda"): the chip's device instead, given by keyword. On flagos,
    torch.load then moves what it restores onto the device (runtime/_storage.py)."""
    @functools.wraps(load)
    def redirected(f, *args, **kwargs):
        if len(args) > 2:  # PyTorch's own TypeError
            return load(f, *args, **kwargs)
        if args:  # map_location and pickle_module may come positionally
            kwargs.update(zip(("map_location", "pickle_module"), args))
        location = kwargs.get("map_location")
        if isinstance(location, dict):
            kwargs["map_location"] = {k: _map(v) for k, v in location.items()}
        elif location is not None:
            kwargs["map_location"] = _map(location)
        return load(f, **kwargs)
    redirected.__flagos_redirect__ = load
    return redirected


def _set(owner, name: str, value) -> None:
    _saved.append((owner, name, vars(owner).get(name, _ABSENT)))
    setattr(owner, name, value)


# ---- the replacements ------------------------------------------------------------

def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self.to(_map_index(device), non_blocking=non_blocking, memory_format=memory_format)


def _module_cuda(self, device=None):
    return self.to(_map_index(device))


class _LegacyType(type):
    """`torch.cuda.FloatTensor` and its kin on the chip: called, a tensor of the type's dtype on
    the current device (sizes give an uninitialized one, data is copied, as PyTorch's legacy
    constructors do); `isinstance` of a tensor of that dtype on the chip, as
    `isinstance(x, torch.cuda.FloatTensor)` is of a CUDA float tensor."""

    def __call__(cls, *args, device=None):
        target = _map_index(device)
        if all(type(a) is int for a in args) and args or (len(args) == 1 and type(args[0]) is torch.Size):
            return torch.empty(*args, dtype=cls.dtype, device=target)
        return getattr(torch, cls.__name__)(*args).to(target)  # the host type, then the chip

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.Tensor) and obj.dtype == cls.dtype and obj.device.type == _target_type


def _legacy_type(name: str) -> type:
    kind = _LegacyType(name, (), {"dtype": LEGACY_TYPES[name], "__module__": "torch.cuda"})
    kind.__doc__ = f"CUDA's legacy {name}, on the active chip (flagos redirect_cuda)."
    return kind


def _legacy_dtype(kind):
    """The dtype a legacy CUDA type names (the class or its name, 'torch.cuda.FloatTensor');
    None for anything else."""
    if isinstance(kind, _LegacyType):
        return kind.dtype
    if isinstance(kind, str) and kind.startswith("torch.cuda."):
        return LEGACY_TYPES.get(kind[len("torch.cuda."):])
    return None


def _tensor_type(original):
    """`x.type(torch.cuda.FloatTensor)` / `x.type("torch.cuda.LongTensor")`: to the chip, in that
    dtype; every other call is PyTorch's."""
    @functools.wraps(original)
    def redirected(self, dtype=None, non_blocking=False, **kwargs):
        target = _legacy_dtype(dtype)
        if target is None:
            return original(self, dtype, non_blocking, **kwargs)
        return self.to(_map_index(None), target, non_blocking=non_blocking)
    redirected.__flagos_redirect__ = original
    return redirected


class _HostEvent:
    """`torch.cuda.Event` for the cpu chip in native mode, where PyTorch has no CPU events:
    host work is synchronous, so recording is reading the clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._time - self._time) * 1000.0

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def init() -> None:
    """The chip was initialised when flagos activated it."""
    _state.active()


def is_current_stream_capturing() -> bool:
    return False  # no CUDA graph is ever being captured on the chip


def ipc_collect() -> None:
    """No memory is shared with other processes through CUDA IPC on the chip."""


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """Checked as PyTorch checks it; not enforced: the chip's allocator has no such cap."""
    # PyTorch's own checks and words (torch/cuda/memory.py)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    state = _state.active()
    index = state.chip_index(_device_module._index(device))
    warnings.warn(f"torch.cuda.set_per_process_memory_fraction({fraction}) is not enforced on "
                  f"chip {state.chip.name!r} (flagos:{index}): its allocator has no per-process cap",
                  stacklevel=2)


def _no_cuda_graphs(*args, **kwargs):
    """`torch.cuda.make_graphed_callables`, `graph_pool_handle`, and the constructors of the
    classes below: a CUDA graph records CUDA kernels, and the chip has none to record (PyTorch's
    own answer without CUDA is "Tried to instantiate dummy base class CUDAGraph")."""
    chip = _state.active().chip.name
    raise RuntimeError(f"CUDA graphs are not available under redirect_cuda: chip {chip!r} has no "
                       f"CUDA kernels to capture. Run the captured code eagerly (drop the capture "
                       f"and replay), or torch.compile it with the default mode.")


class _CUDAGraph:
    """`torch.cuda.CUDAGraph`: a class still (libraries annotate with `torch.cuda.CUDAGraph | None`
    at import), refused when made."""
    __init__ = _no_cuda_graphs


class _Graph:
    """`torch.cuda.graph`, the capture context: refused when made."""
    __init__ = _no_cuda_graphs


class _Nvtx:
    """`torch.cuda.nvtx`: NVTX ranges become PyTorch profiler ranges (record_function), so a
    script's annotations still show in torch.profiler traces on the chip."""

    _ranges = threading.local()

    @classmethod
    def _stack(cls) -> list:
        stack = getattr(cls._ranges, "stack", None)
        if stack is None:
            stack = cls._ranges.stack = []
        return stack

    @classmethod
    def range_push(cls, msg: str) -> int:
        scope = torch.autograd.profiler.record_function(msg)
        scope.__enter__()
        stack = cls._stack()
        stack.append(scope)
        return len(stack) - 1

    @classmethod
    def range_pop(cls) -> int:
        stack = cls._stack()
        if not stack:
            return -1  # as NVTX answers a pop without a push
        stack.pop().__exit__(None, None, None)
        return len(stack)

    @staticmethod
    def range(msg: str, *args, **kwargs):
        return torch.autograd.profiler.record_function(msg.format(*args, **kwargs))

    @staticmethod
    def mark(msg: str) -> None:
        with torch.autograd.profiler.record_function(msg):
            pass


def _cuda_namespace(real: types.ModuleType, state) -> types.ModuleType:
    """The module `torch.cuda` becomes: the common functions answer for the active chip, every
    other name is PyTorch's own."""
    ns = _CudaModule("torch.cuda", real)
    streams = _device_module if state.mode == "device" else sys.modules.get(f"torch.{state.chip.torch_type}")
    own = {"get_device_name": _device_module.get_device_name,
           "get_device_properties": _device_module.get_device_properties,
           "is_bf16_supported": _device_module.is_bf16_supported,
           "is_initialized": _device_module.is_available,
           "get_device_capability": _device_module.get_device_capability, "init": init,
           "is_current_stream_capturing": is_current_stream_capturing, "ipc_collect": ipc_collect,
           "set_per_process_memory_fraction": set_per_process_memory_fraction,
           "memory_summary": _device_module.memory_summary, "nvtx": _Nvtx,
           "random": _random_namespace(real.random), "CUDAGraph": _CUDAGraph,
           "graph": _Graph, "make_graphed_callables": _no_cuda_graphs,
           "graph_pool_handle": _no_cuda_graphs}
    for name in CUDA_FUNCTIONS:
        if name in own:
            value = own[name]
        elif name == "Event" and state.mode != "device" and state.chip.payload_is_host:
            value = _HostEvent
        elif name in ("Event", "Stream", "stream", "current_stream", "default_stream"):
            value = getattr(streams, name, None)
            if value is None:
                continue
        else:
            value = getattr(_device_module, name)
        ns.__dict__[name] = value
    for name in LEGACY_TYPES:
        ns.__dict__[name] = _legacy_type(name)
    return ns


# `torch.cuda.random`'s functions (transformers' Trainer saves and restores the device's RNG
# state through it when torch.cuda.is_available()).
RANDOM_FUNCTIONS = ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
                    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed")


def _random_namespace(real: types.ModuleType) -> types.ModuleType:
    ns = _CudaModule("torch.cuda.random", real)
    for name in RANDOM_FUNCTIONS:
        ns.__dict__[name] = getattr(_device_module, name)
    return ns


class _CudaModule(types.ModuleType):
    def __init__(self, name: str, real: types.ModuleType):
        super().__init__(name, real.__doc__)
        self.__dict__["_flagos_real"] = real

    def __getattr__(self, name):
        return getattr(self.__dict__["_flagos_real"], name)


def _autocast_init(init):
    @functools.wraps(init)
    def redirected(self, device_type, *args, **kwargs):
        if device_type == "cuda":
            device_type = _target_type
        return init(self, device_type, *args, **kwargs)
    return redirected


def _grad_scaler_init(init):
    @functools.wraps(init)
    def redirected(self, device="cuda", *args, **kwargs):
        if device == "cuda":
            device = _target_type
        return init(self, device, *args, **kwargs)
    return redirected


def _generator_class(current):
    """A torch.Generator whose construction maps the device, and of which every generator is
    an instance (as flagos's own and PyTorch's)."""
    base = torch._C.Generator

    class _Meta(type(current)):
        def __call__(cls, device="cpu"):
            if cls is not Generator:
                return type.__call__(cls, device)
            return current(_map(device))

        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub) -> bool:
            return issubclass(sub, base)

    class Generator(base, metaclass=_Meta):
        __doc__ = base.__doc__

    Generator.__module__, Generator.__qualname__ = "torch", "Generator"
    return Generator


def _backend_spec(spec: str) -> str:
    """An `init_process_group` backend string written for CUDA, for the active chip: "nccl"
    becomes `flagos.dist_backend()` ("flagos" in device mode, the chip's own backend in native
    mode), and in "device:backend" pairs "cuda:nccl" becomes "flagos:flagos" (or "npu:hccl")."""
    name = _distributed.dist_backend()
    if ":" not in spec:
        return name if spec.lower() == "nccl" else spec
    pairs = []
    for pair in spec.split(","):
        device, _, backend = pair.partition(":")
        if device.strip().lower() == "cuda":
            device = _target_type
        if backend.strip().lower() == "nccl":
            backend = name
        pairs.append(f"{device}:{backend}")
    return ",".join(pairs)


def _process_group(fn):
    """init_process_group("nccl") (positional or backend=): the active chip's backend. Without a
    backend PyTorch asks the accelerator, which is flagos in device mode: nothing to map."""
    @functools.wraps(fn)
    def redirected(*args, **kwargs):
        if args and isinstance(args[0], str):
            args = (_backend_spec(args[0]),) + args[1:]
        elif isinstance(kwargs.get("backend"), str):
            kwargs["backend"] = _backend_spec(kwargs["backend"])
        if "device_id" in kwargs:
            kwargs["device_id"] = _map_index(kwargs["device_id"]) if kwargs["device_id"] is not None else None
        return fn(*args, **kwargs)
    redirected.__flagos_redirect__ = fn
    return redirected


# ---- installing ------------------------------------------------------------------

def install(state) -> bool:
    """Redirect CUDA to `state`'s chip; False (nothing done) on the cuda chip itself."""
    global _target_type
    if _saved:
        return True
    if state.chip.name == "cuda" or state.chip.torch_type == "cuda":
        log.info("redirect_cuda: the active chip is cuda; nothing to redirect")
        return False
    _target_type = "flagos" if state.mode == "device" else state.chip.torch_type
    # torch.set_default_device's mode recognises factories by a set it builds once from the
    # torch namespace: build it while it still holds PyTorch's own functions.
    torch.utils._device._device_constructors()
    for name in FACTORIES:
        _set(torch, name, _rewrite(getattr(torch, name)))
    _set(torch.Tensor, "to", _rewrite(torch.Tensor.to, ints=True))
    _set(torch.Tensor, "cuda", _tensor_cuda)
    for name in TENSOR_METHODS[2:]:
        _set(torch.Tensor, name, _rewrite(getattr(torch.Tensor, name)))
    _set(torch.Tensor, "type", _tensor_type(torch.Tensor.type))
    _set(torch.nn.Module, "cuda", _module_cuda)
    _set(torch, "load", _load(torch.load))
    _set(torch, "set_default_device", _rewrite(torch.set_default_device))
    _set(torch, "Generator", _generator_class(torch.Generator))
    autocast = torch.amp.autocast_mode.autocast
    _set(autocast, "__init__", _autocast_init(autocast.__init__))
    scaler = torch.amp.grad_scaler.GradScaler   # torch.cuda.amp.GradScaler calls its __init__
    _set(scaler, "__init__", _grad_scaler_init(scaler.__init__))
    if torch.distributed.is_available():
        dist = torch.distributed
        _set(dist, "init_process_group", _process_group(dist.init_process_group))
    _set(torch, "cuda", _cuda_namespace(sys.modules["torch.cuda"], state))
    log.info("redirect_cuda: 'cuda' now means %s", _target_type)
    return True


def uninstall() -> None:
    """Put every replaced entry point back (native mode's deactivate(), the tests)."""
    _strings.clear()
    while _saved:
        owner, name, original = _saved.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)

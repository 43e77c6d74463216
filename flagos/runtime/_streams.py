"""Streams and events of the flagos device: `torch.flagos.Stream`, `Event`, `current_stream`,
`default_stream`, `set_stream`, `stream(...)`, and what `torch.accelerator` asks of them.

PyTorch's Python device guard for PrivateUse1 cannot create streams or events (every
`torch.Stream(device="flagos")` is stream 0, and recording an event does nothing), so flagos
keeps its own: `Stream` and `Event` are subclasses of `torch.Stream` and `torch.Event` (PyTorch
code that checks their type or passes them on keeps working) whose methods go to one of two
engines, chosen by the chip:

- an adapter chip that fills the stream/event entries of the adapter ABI (1.1): each stream
  and event is the adapter's own handle, and flagos tells the adapter which stream is current
  (`set_stream`), so the work flagos issues goes to it;
- every other chip (the cpu chip, adapters built without streams, torch-native chips): work is
  ordered as issued, so a stream is complete once its calls return; synchronizing waits for
  the whole device, and an event's time is the host's clock after that wait.

While flagos is the device, `torch.Stream(...)` and `torch.Event(...)` for the flagos device
(or for no device: the current accelerator) build these, as `torch.cuda`'s would on CUDA.
The current stream of each device is one for the whole process (not one per thread).
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref

import torch

from .. import _C
from ..chips.adapter import AdapterChip
from ..core import _state

_TORCH_STREAM, _TORCH_EVENT = torch.Stream, torch.Event   # PyTorch's own types
_saved: dict[str, type] = {}                              # torch.Stream/Event before install()
_lock = threading.RLock()
_ids = itertools.count(1)                 # stream_id of flagos streams; 0 is the default
_streams = weakref.WeakValueDictionary()  # (device index, stream_id) -> Stream
_defaults: dict[int, Stream] = {}
_current: dict[int, Stream] = {}
_engine = None                            # the engine of the active chip (built on first use)
_engine_chip = None


_DEVICE_TYPE: list[int] = []


def _device_type() -> int:
    """PyTorch's number for the PrivateUse1 device type, as torch.Stream stores it."""
    if not _DEVICE_TYPE:
        _DEVICE_TYPE.append(_TORCH_STREAM(torch.device("flagos", 0)).device_type)
    return _DEVICE_TYPE[0]


def _index(device=None) -> int:
    state = _state.active()
    if device is None:
        return state.current
    if isinstance(device, int):
        return state.chip_index(device)
    device = torch.device(device)
    if device.type != "flagos":
        raise ValueError(f"{device} is not a flagos device; use flagos.device() "
                         f"(torch.flagos streams live on the flagos device)")
    return state.chip_index(state.current if device.index is None else device.index)


# ---- engines ------------------------------------------------------------------

class _Synchronous:
    """Chips whose work completes in issue order before the host sees it."""

    def __init__(self, chip):
        self.chip = chip
        self.handles = itertools.count(1)
        self.recorded: dict[int, int] = {}   # event handle -> time.perf_counter_ns() of record

    def stream_create(self, index, priority):
        return next(self.handles)

    def stream_destroy(self, index, handle):
        pass

    def set_stream(self, index, handle):
        pass

    def stream_synchronize(self, index, handle):
        self.chip.synchronize(index)

    def stream_query(self, index, handle):
        return True

    def stream_wait_event(self, index, stream, event):
        pass

    def event_create(self, index, timing):
        return next(self.handles)

    def event_destroy(self, index, handle):
        self.recorded.pop(handle, None)

    def event_record(self, index, handle, stream):
        self.chip.synchronize(index)   # what the device had been given is done by now
        self.recorded[handle] = time.perf_counter_ns()

    def event_synchronize(self, index, handle):
        self.chip.synchronize(index)

    def event_query(self, index, handle):
        return True

    def event_elapsed_ms(self, index, start, end):
        return (self.recorded[end] - self.recorded[start]) / 1e6


class _Adapter:
    """Adapter chips with the ABI 1.1 stream/event entries: every call is the adapter's own
    (flagos._C.Adapter has a method of the same name and arguments for each)."""

    def __init__(self, adapter):
        self.adapter = adapter

    def __getattr__(self, name):
        return getattr(self.adapter, name)

    def event_create(self, index, timing):
        return self.adapter.event_create(index, _C.ADAPTER_EVENT_TIMING if timing else 0)


def engine():
    """The stream engine of the active chip."""
    global _engine, _engine_chip
    chip = _state.active().chip
    if _engine_chip is not chip:
        adapter = chip.adapter if isinstance(chip, AdapterChip) else None
        has_streams = adapter is not None and adapter.has_streams
        _engine = _Adapter(adapter) if has_streams else _Synchronous(chip)
        _engine_chip = chip
    return _engine


def uses_adapter_streams() -> bool:
    """Whether the active chip's streams are the adapter's own (ABI 1.1)."""
    return isinstance(engine(), _Adapter)


# ---- Stream ---------------------------------------------------------------------

class Stream(_TORCH_STREAM):
    """An in-order queue of work on a flagos device (see the module docstring for what that
    means on each chip). `Stream(device=None, priority=0)`; usable as a context manager."""

    def __new__(cls, device=None, priority: int = 0):
        index = _index(device)
        handle = engine().stream_create(index, int(priority))
        return cls._make(index, next(_ids), handle, int(priority), owned=True)

    @classmethod
    def _make(cls, index: int, stream_id: int, handle: int, priority: int, owned: bool):
        self = _TORCH_STREAM.__new__(cls, stream_id=stream_id, device_index=index,
                                    device_type=_device_type())
        self._index, self._handle, self._priority = index, handle, priority
        self._engine = engine() if owned else None   # who destroys the handle
        self._entered: list[Stream] = []
        _streams[(index, stream_id)] = self
        return self

    def __init__(self, *args, **kwargs):
        pass  # everything happened in __new__ (torch.Stream's __init__ takes no arguments)

    @property
    def priority(self) -> int:
        return self._priority

    def synchronize(self) -> None:
        """Wait until the work given to this stream is done."""
        engine().stream_synchronize(self._index, self._handle)

    def query(self) -> bool:
        """Whether the work given to this stream is done."""
        return engine().stream_query(self._index, self._handle)

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for `event` (the host does not wait)."""
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        """Make later work on this stream wait for the work given to `stream` so far."""
        self.wait_event(_as_flagos_stream(stream).record_event())

    def record_event(self, event: Event | None = None) -> Event:
        event = Event(self.device) if event is None else event
        event.record(self)
        return event

    def __enter__(self):
        self._entered.append(current_stream(self._index))
        set_stream(self)
        return self

    def __exit__(self, *exc):
        set_stream(self._entered.pop())
        return False

    def __eq__(self, other):
        return isinstance(other, _TORCH_STREAM) and (other.device_type, other.device_index,
                                                    other.stream_id) == (
            self.device_type, self.device_index, self.stream_id)

    def __hash__(self):
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.flagos.Stream device=flagos:{self._index} stream_id={self.stream_id}>"

    def __del__(self):
        if getattr(self, "_engine", None) is not None:
            try:
                self._engine.stream_destroy(self._index, self._handle)
            except Exception:  # at interpreter exit the adapter may be gone already
                pass


def default_stream(device=None) -> Stream:
    """The stream work goes to unless another is made current (stream_id 0)."""
    index = _index(device)
    with _lock:
        stream = _defaults.get(index)
        if stream is None:
            stream = _defaults[index] = Stream._make(index, 0, 0, 0, owned=False)
        return stream


def current_stream(device=None) -> Stream:
    """The stream of `device` (default: the current device) that work goes to now."""
    index = _index(device)
    stream = _current.get(index)
    return default_stream(index) if stream is None else stream


def _as_flagos_stream(stream) -> Stream:
    if isinstance(stream, Stream):
        return stream
    if not isinstance(stream, _TORCH_STREAM) or stream.device.type != "flagos":
        raise TypeError(f"expected a stream of the flagos device (torch.flagos.Stream), got "
                        f"{stream!r}")
    if stream.stream_id == 0:
        return default_stream(stream.device_index)
    found = _streams.get((stream.device_index, stream.stream_id))
    if found is None:
        raise ValueError(f"{stream!r} is not a live flagos stream; create streams with "
                         f"torch.flagos.Stream() (torch.Stream(device='flagos') is always the "
                         f"default stream)")
    return found


def set_stream(stream) -> None:
    """Make `stream` the current stream of its device."""
    stream = _as_flagos_stream(stream)
    with _lock:
        if current_stream(stream._index) is stream:
            return
        engine().set_stream(stream._index, stream._handle)
        if stream._handle == 0:
            _current.pop(stream._index, None)
        else:
            _current[stream._index] = stream


class StreamContext:
    """`with torch.flagos.stream(s):` makes s current inside the block; None does nothing."""

    def __init__(self, stream):
        self.stream = None if stream is None else _as_flagos_stream(stream)

    def __enter__(self):
        if self.stream is not None:
            self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            self.stream.__exit__(*exc)
        return False


def stream(stream) -> StreamContext:
    return StreamContext(stream)


# ---- Event ----------------------------------------------------------------------

class Event(_TORCH_EVENT):
    """A point in a flagos stream: record, wait, query, synchronize, elapsed_time."""

    def __new__(cls, device=None, *, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False):
        if interprocess:
            raise ValueError("interprocess events are not supported on flagos; create the "
                             "event with interprocess=False")
        index = _index(device)
        self = _TORCH_EVENT.__new__(cls, torch.device("flagos", index),
                                    enable_timing=enable_timing, blocking=blocking)
        self._index, self._timing = index, bool(enable_timing)
        self._handle = self._engine = None   # created at the first record(), on its device
        return self

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        """Mark the work given to `stream` (default: the current stream) so far."""
        stream = current_stream(self._index) if stream is None else _as_flagos_stream(stream)
        if stream._index != self._index:
            raise ValueError(f"event on flagos:{self._index} cannot be recorded on a stream of "
                             f"flagos:{stream._index}")
        if self._handle is None:
            self._engine = engine()
            self._handle = self._engine.event_create(self._index, self._timing)
        engine().event_record(self._index, self._handle, stream._handle)

    def wait(self, stream=None) -> None:
        """Make later work on `stream` (default: the current stream) wait for this event."""
        stream = current_stream(self._index) if stream is None else _as_flagos_stream(stream)
        if self._handle is not None:
            engine().stream_wait_event(stream._index, stream._handle, self._handle)

    def query(self) -> bool:
        return True if self._handle is None else engine().event_query(self._index, self._handle)

    def synchronize(self) -> None:
        if self._handle is not None:
            engine().event_synchronize(self._index, self._handle)

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event and `end_event` (both recorded, both timing)."""
        if not (self._timing and getattr(end_event, "_timing", False)):
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        if self._handle is None or end_event._handle is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        return engine().event_elapsed_ms(self._index, self._handle, end_event._handle)

    def __repr__(self) -> str:
        return f"<torch.flagos.Event device=flagos:{self._index} timing={self._timing}>"

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            try:
                self._engine.event_destroy(self._index, self._handle)
            except Exception:  # at interpreter exit the adapter may be gone already
                pass


# ---- torch.Stream(...) and torch.Event(...) on the flagos device -------------------

def _routes_to_flagos(device) -> bool:
    """Whether a torch.Stream/torch.Event device argument means the flagos device (no device,
    or an index, means the current accelerator, as in PyTorch)."""
    if device is None or isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator()
        return accelerator is not None and accelerator.type == "flagos"
    return torch.device(device).type == "flagos"


class _RoutingMeta(type):
    """Metaclass of the installed torch.Stream and torch.Event: construction for the flagos
    device makes flagos's own object (PyTorch's Python device guard would give stream 0 every
    time, and an event that records nothing and refuses synchronize()); everything else is
    PyTorch's, and every stream or event stays an instance of torch.Stream / torch.Event."""

    def __call__(cls, *args, **kwargs):
        if cls not in _ROUTES:  # a subclass made after install builds as before
            return super().__call__(*args, **kwargs)
        original, ours = _ROUTES[cls]
        device = args[0] if args else kwargs.get("device")
        if "stream_id" in kwargs or not _routes_to_flagos(device):  # stream_id: a known stream
            return original(*args, **kwargs)
        return ours(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _ROUTES[cls][0]) if cls in _ROUTES else super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, _ROUTES[cls][0]) if cls in _ROUTES else super().__subclasscheck__(sub)


class _RoutedStream(_TORCH_STREAM, metaclass=_RoutingMeta):
    __doc__ = _TORCH_STREAM.__doc__


class _RoutedEvent(_TORCH_EVENT, metaclass=_RoutingMeta):
    __doc__ = _TORCH_EVENT.__doc__


_ROUTES = {_RoutedStream: (_TORCH_STREAM, Stream), _RoutedEvent: (_TORCH_EVENT, Event)}
for _routed in (_RoutedStream, _RoutedEvent):
    _routed.__module__, _routed.__qualname__ = "torch", _routed.__name__[len("_Routed"):]
    _routed.__name__ = _routed.__qualname__


def install() -> None:
    """Make torch.Stream and torch.Event build flagos streams and events for the flagos device."""
    if not _saved:
        _saved.update(Stream=torch.Stream, Event=torch.Event)
        torch.Stream, torch.Event = _RoutedStream, _RoutedEvent
    reset()


def uninstall() -> None:
    if _saved:
        torch.Stream, torch.Event = _saved["Stream"], _saved["Event"]
        _saved.clear()
    reset()


# ---- what tensors need of streams -----------------------------------------------

def record_stream(tensor, stream) -> None:
    """`tensor.record_stream(s)` on a flagos tensor: the memory of a flagos tensor is freed
    only after the work already given to its device is done (synchronous engine), or by the
    adapter once the queued work that uses it is done (the ABI's rule for free()), so there is
    nothing to record; the stream is still checked."""
    _as_flagos_stream(stream)


def reset() -> None:
    """Forget streams and the engine (the chip changed)."""
    global _engine, _engine_chip
    with _lock:
        _current.clear()
        _defaults.clear()
        _engine = _engine_chip = None

"""Streams, events and the torch.accelerator API on the flagos device. On the cpu chip streams
order work as the CPU does (synchronously); on sim they are the adapter's own streams and
events (adapter ABI 1.1), and sim's call counters show flagos used them."""
import ctypes
import gc
import time
import types

import pytest
import torch
from conftest import CHIP, assert_close, device_mode_only, run_python, runs_once

import flagos
from flagos.runtime import _streams

pytestmark = device_mode_only


def sim_counters():
    """sim's own counts of the stream/event calls flagos made (None on other chips)."""
    if CHIP != "sim":
        return None
    lib = ctypes.CDLL(flagos.chips.profile("sim").adapter.path)
    lib.flagos_sim_calls.restype = ctypes.c_uint64
    lib.flagos_sim_stream_copies.restype = ctypes.c_uint64
    lib.flagos_sim_stream_copies.argtypes = (ctypes.c_int32, ctypes.c_uint64)
    return lib


def test_streams_are_torch_streams_of_the_device(dev):
    s = torch.flagos.Stream()
    assert isinstance(s, torch.Stream) and s.device == dev and s.stream_id != 0
    assert s != torch.flagos.default_stream() and s == s
    assert torch.flagos.default_stream().stream_id == 0
    assert torch.flagos.current_stream() == torch.flagos.default_stream()
    s.synchronize()
    assert s.query() is True
    assert torch.flagos.Stream(priority=-1).priority == -1


def test_stream_context_makes_work_go_to_the_stream_and_gives_cpu_results(dev):
    counters = sim_counters()
    before = counters and counters.flagos_sim_calls(b"set_stream")
    x = torch.randn(16, 8)
    s = torch.flagos.Stream()
    with torch.flagos.stream(s) as entered:
        assert entered is s and torch.flagos.current_stream() is s
        assert torch.accelerator.current_stream() == s
        inner = torch.flagos.Stream()
        with inner:  # nested: the inner stream is current, then the outer one again
            assert torch.flagos.current_stream() is inner
        assert torch.flagos.current_stream() is s
        y = torch.relu(x.to(dev)) * 2
    assert torch.flagos.current_stream() == torch.flagos.default_stream()
    s.synchronize()
    assert torch.equal(y.cpu(), torch.relu(x) * 2)
    with torch.flagos.stream(None):  # None changes nothing, as on CUDA
        assert torch.flagos.current_stream() == torch.flagos.default_stream()
    if counters:
        assert counters.flagos_sim_calls(b"set_stream") - before == 4  # s, inner, s, default
        # the host-to-device copy of x was work of stream s
        assert counters.flagos_sim_stream_copies(0, s._handle) >= 1


def test_events_record_wait_query_and_time(dev):
    counters = sim_counters()
    before = counters and counters.flagos_sim_calls(b"event_record")
    start = torch.flagos.Event(enable_timing=True)
    end = torch.flagos.Event(enable_timing=True)
    assert isinstance(start, torch.Event) and start.query() is True  # never recorded: complete
    # The events time the interval between their records: it holds the host-clock interval
    # read inside it and lies within the one read around it, however loaded the machine.
    before_start = time.perf_counter_ns()
    start.record()
    inside_from = time.perf_counter_ns()
    x = torch.randn(64, 64, device=dev)
    y = x @ x
    time.sleep(0.01)
    inside_to = time.perf_counter_ns()
    end.record()
    end.synchronize()
    after_end = time.perf_counter_ns()
    assert end.query() is True
    elapsed_ms = start.elapsed_time(end)
    rounding_ms = 1e-3
    assert (inside_to - inside_from) / 1e6 - rounding_ms <= elapsed_ms, (elapsed_ms, inside_to - inside_from)
    assert elapsed_ms <= (after_end - before_start) / 1e6 + rounding_ms, (elapsed_ms, after_end - before_start)
    s = torch.flagos.Stream()
    s.wait_event(end)
    s.wait_stream(torch.flagos.current_stream())
    event = s.record_event()
    assert isinstance(event, torch.flagos.Event)
    # query() may say False until the stream reaches the event on a chip whose queues run on
    # their own (opencl), as on CUDA; once it has, it says True
    event.synchronize()
    assert event.query() is True
    assert_close(y, x.cpu() @ x.cpu(), atol=1e-5, rtol=1e-5)  # sim's mm sums in its own order
    if counters:
        assert counters.flagos_sim_calls(b"event_record") - before == 4
        assert counters.flagos_sim_calls(b"event_elapsed_ms") >= 1


@pytest.mark.skipif(CHIP != "cpu", reason="the cpu chip's events read the host clock")
def test_the_host_clock_times_events_in_milliseconds_to_the_nanosecond(dev, monkeypatch):
    """On a chip whose work is done when the host sees it, an event's record is the host
    clock's reading, and elapsed_time the milliseconds between two readings: with the clock
    read as 1 s and then 2.500001 ms later, exactly that."""
    readings = iter([1_000_000_000, 1_002_500_001])
    monkeypatch.setattr(_streams, "time", types.SimpleNamespace(perf_counter_ns=lambda: next(readings)))
    start, end = torch.flagos.Event(enable_timing=True), torch.flagos.Event(enable_timing=True)
    start.record()
    end.record()
    assert start.elapsed_time(end) == 2.500001


def test_event_errors_name_the_fix(dev):
    plain, timed = torch.flagos.Event(), torch.flagos.Event(enable_timing=True)
    plain.record()
    with pytest.raises(ValueError, match="enable_timing=True"):
        plain.elapsed_time(timed)
    with pytest.raises(ValueError, match="must be recorded"):
        timed.elapsed_time(torch.flagos.Event(enable_timing=True))
    with pytest.raises(ValueError, match="interprocess events are not supported"):
        torch.flagos.Event(interprocess=True)
    with pytest.raises(ValueError, match=r"cpu is not a flagos device; use flagos.device\(\)"):
        torch.flagos.Stream(device="cpu")
    with pytest.raises(TypeError, match="expected a stream of the flagos device"):
        torch.flagos.set_stream(torch.Stream(device="cpu"))


def test_torch_accelerator_streams_and_devices(dev):
    assert torch.accelerator.current_accelerator() == torch.device("flagos")
    # PyTorch's C++ side asks the device's hooks whether it is available (at::getAccelerator)
    assert torch._C._get_accelerator() == torch.device("flagos")
    assert torch.accelerator.device_count() == torch.flagos.device_count()
    assert torch.accelerator.current_device_index() == torch.flagos.current_device() == 0
    s = torch.flagos.Stream()
    torch.accelerator.set_stream(s)
    try:
        assert torch.accelerator.current_stream() is s and torch.flagos.current_stream() is s
    finally:
        torch.accelerator.set_stream(torch.flagos.default_stream())
    # a PyTorch stream object naming a flagos stream by its ids means that stream
    torch.accelerator.set_stream(s)
    plain = torch.Stream(stream_id=0, device_index=0, device_type=s.device_type)
    assert type(plain) is not torch.flagos.Stream
    torch.accelerator.set_stream(plain)
    assert torch.flagos.current_stream() == torch.flagos.default_stream()
    torch.accelerator.synchronize()
    torch.accelerator.synchronize(dev)
    last = torch.accelerator.device_count() - 1
    with torch.accelerator.device_index(last):
        assert torch.flagos.current_device() == last
        assert torch.accelerator.current_stream().device == torch.device("flagos", last)
    assert torch.flagos.current_device() == 0
    torch.accelerator.set_device_index(last)
    assert torch.accelerator.current_device_index() == last
    with torch.accelerator.device_index(0):  # back to the first device, and out again
        assert torch.flagos.current_device() == 0
    assert torch.flagos.current_device() == last
    torch.accelerator.set_device_index(-1)  # "no device", as on CUDA: nothing changes
    with torch.accelerator.device_index(-1):
        assert torch.flagos.current_device() == last
    assert torch.flagos.current_device() == last
    torch.accelerator.set_device_index(0)
    assert torch.accelerator.current_device_index() == 0
    # every dtype a flagos tensor holds, also those a C-ABI chip leaves to the CPU fallback
    caps = torch.accelerator.get_device_capability()
    assert {torch.float32, torch.float16, torch.int64, torch.bool} <= caps["supported_dtypes"]


def test_torch_accelerator_memory_matches_torch_flagos(dev):
    torch.accelerator.empty_cache()
    if hasattr(torch.accelerator, "empty_host_cache"):   # PyTorch 2.12 and later
        torch.accelerator.empty_host_cache()
    torch.accelerator.reset_peak_memory_stats()
    base = torch.accelerator.memory_allocated()
    assert base == torch.flagos.memory_allocated()
    x = torch.empty(1024, 256, device=dev)
    grown = torch.accelerator.memory_allocated() - base
    assert torch.accelerator.memory_allocated() == torch.flagos.memory_allocated()
    assert torch.accelerator.max_memory_allocated() == torch.flagos.max_memory_allocated()
    assert torch.accelerator.memory_reserved() == torch.flagos.memory_reserved()
    assert torch.accelerator.max_memory_reserved() >= torch.accelerator.memory_reserved()
    stats = torch.accelerator.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.flagos.memory_allocated()
    info, (free, total) = tuple(torch.accelerator.get_memory_info()), torch.flagos.mem_get_info()
    if CHIP == "sim":  # sim's pool moves only with this process's tensors
        assert info == (free, total)
    else:  # the cpu chip's memory is the host's: other processes move its free part between calls
        assert info[1] == total and info[0] == pytest.approx(free, rel=0.05)
    if CHIP == "sim":  # sim keeps allocator statistics; the cpu chip, like PyTorch's CPU, none
        assert grown == x.numel() * 4
        del x
        assert torch.accelerator.memory_allocated() == base
        assert torch.accelerator.max_memory_allocated() >= base + 1024 * 256 * 4
        torch.accelerator.reset_peak_memory_stats()
        assert torch.accelerator.max_memory_allocated() == base


def test_torch_stream_and_event_make_flagos_ones(dev):
    """PyTorch-generic code (torch.Stream(), torch.Event(device), as transformers writes it)
    gets working flagos streams and events; other devices get PyTorch's own."""
    for s in (torch.Stream(), torch.Stream(device=dev, priority=-1), torch.Stream(dev)):
        assert type(s) is torch.flagos.Stream and isinstance(s, torch.Stream) and s.device == dev
    with torch.Stream(dev) as s:
        assert torch.accelerator.current_stream() is s
    start, end = torch.Event(dev, enable_timing=True), torch.Event(device=dev, enable_timing=True)
    assert type(start) is torch.flagos.Event and isinstance(start, torch.Event)
    start.record()
    end.record()
    end.synchronize()  # PyTorch's own event on a Python backend refuses this
    assert start.elapsed_time(end) >= 0
    cpu_stream, cpu_event = torch.Stream(device="cpu"), torch.Event(device="cpu")
    assert type(cpu_stream) is torch._C.Stream and cpu_stream.device.type == "cpu"
    assert type(cpu_event) is torch._C.Event and isinstance(cpu_event, torch.Event)


def test_record_stream_on_a_flagos_tensor(dev):
    s = torch.flagos.Stream()
    x = torch.ones(4, device=dev)
    x.record_stream(s)
    assert x.sum().item() == 4.0


def test_sim_uses_the_adapter_streams():
    if CHIP != "sim":
        # the cpu chip orders work itself; opencl's queues are the adapter streams (its own
        # tests: tests/test_opencl.py)
        assert flagos.runtime._streams.uses_adapter_streams() == (CHIP == "opencl")
        return
    counters = sim_counters()
    created, destroyed = (counters.flagos_sim_calls(n) for n in (b"stream_create", b"stream_destroy"))
    s = torch.flagos.Stream()
    s.synchronize()
    s.query()
    assert counters.flagos_sim_calls(b"stream_create") == created + 1
    assert counters.flagos_sim_calls(b"stream_synchronize") >= 1
    assert counters.flagos_sim_calls(b"stream_query") >= 1
    del s
    assert counters.flagos_sim_calls(b"stream_destroy") == destroyed + 1


def test_diffusers_group_offloading_accepts_flagos_streams(dev):
    """The stream check of group offloading passes: its onload stream is a flagos stream."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(8, 16), norm_num_groups=4,
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"))
    unet.enable_group_offload(onload_device=dev, offload_type="leaf_level", use_stream=True)
    streams = {hook.group.stream for m in unet.modules() if getattr(m, "_diffusers_hook", None)
               for hook in m._diffusers_hook.hooks.values() if getattr(hook, "group", None)}
    streams.discard(None)
    assert len(streams) == 1
    (stream,) = streams
    assert isinstance(stream, torch.flagos.Stream) and stream.device == dev


@runs_once
def test_release_gives_torch_accelerator_back():
    proc = run_python("""
        import torch, flagos
        from flagos.runtime import _registration
        original = torch._C._accelerator_synchronizeDevice
        stream_type, event_type = torch.Stream, torch.Event
        flagos.activate("cpu")
        torch.accelerator.synchronize()
        assert type(torch.Stream()) is torch.flagos.Stream
        _registration.release()
        assert torch._C._accelerator_synchronizeDevice is original
        assert (torch.Stream, torch.Event) == (stream_type, event_type)
        assert torch.Stream(flagos.device()).stream_id == 0  # PyTorch's own again
        try:
            torch.accelerator.synchronize()
        except RuntimeError as e:
            print("PYTORCH", e)
    """)
    assert "PYTORCH Backend doesn't support synchronizing all streams" in proc.stdout


class RecordingEngine:
    """The chip's stream engine, with every call it is given written down (name, arguments)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args):
            self.calls.append((name, args))
            return method(*args)
        return call


def test_wait_stream_records_on_the_other_stream_and_waits_on_this_one(dev, monkeypatch):
    """a.wait_stream(b): an event recorded on b (b's work so far), and a made to wait for it."""
    waiting, working = torch.flagos.Stream(), torch.flagos.Stream()
    recorder = RecordingEngine(flagos.runtime._streams.engine())
    monkeypatch.setattr(flagos.runtime._streams, "engine", lambda: recorder)
    waiting.wait_stream(working)
    records = [args for name, args in recorder.calls if name == "event_record"]
    waits = [args for name, args in recorder.calls if name == "stream_wait_event"]
    assert len(records) == 1 and len(waits) == 1, recorder.calls
    (index, event, stream), = records
    assert (index, stream) == (0, working._handle)
    assert waits[0] == (0, waiting._handle, event)
    assert waiting._handle != working._handle != 0


def test_sim_refuses_a_stream_of_another_device():
    """A stream handle belongs to its device: sim refuses flagos:1's stream on device 0, and
    device 0's work keeps going to its own current stream."""
    if CHIP != "sim":
        pytest.skip("sim's own stream checks (adapter ABI 1.1)")
    adapter, counters = flagos.chips.profile("sim").adapter, sim_counters()
    other = torch.flagos.Stream("flagos:1")
    event = torch.flagos.Event("flagos:1")
    event.record(other)
    try:
        with pytest.raises(flagos.DeviceError,
                           match=f"stream {other._handle} is not a live stream of sim device 0"):
            adapter.set_stream(0, other._handle)
        with pytest.raises(flagos.DeviceError, match="is not a live stream of sim device 0"):
            adapter.stream_synchronize(0, other._handle)
        with pytest.raises(flagos.DeviceError,
                           match=f"event {event._handle} is not a live event of sim device 0"):
            adapter.stream_wait_event(0, 0, event._handle)
    finally:
        adapter.set_stream(0, 0)  # a mutant sim accepted it: leave the device as it was
    copies = counters.flagos_sim_stream_copies(0, 0)
    torch.ones(3).to("flagos:0")
    assert counters.flagos_sim_stream_copies(0, 0) == copies + 1
    assert counters.flagos_sim_stream_copies(0, other._handle) == 0
    adapter.set_stream(1, other._handle)  # on its own device it is accepted
    adapter.set_stream(1, 0)


def test_a_stream_block_lets_an_error_through_and_restores_the_stream(dev):
    """An exception inside `with stream:` or `with torch.flagos.stream(s):` reaches the caller
    (as with CUDA streams) and the previous stream is current again."""
    s = torch.flagos.Stream()
    with pytest.raises(KeyError, match="inside"):
        with s:
            raise KeyError("inside")
    assert torch.flagos.current_stream() == torch.flagos.default_stream()
    with pytest.raises(KeyError, match="inside"):
        with torch.flagos.stream(s):
            raise KeyError("inside")
    assert torch.flagos.current_stream() == torch.flagos.default_stream()


def test_streams_compare_with_anything_and_default_to_priority_zero(dev):
    """A stream is unequal to what is not a stream (no error); a stream made without a priority,
    and the default stream, have priority 0, as torch.cuda's."""
    s = torch.flagos.Stream()
    assert (s == "stream") is False and s != 3
    assert s.priority == 0 and torch.flagos.default_stream().priority == 0
    # a PyTorch stream object with a flagos stream's ids is that stream; ids of no live one are refused
    plain = torch.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
    assert type(plain) is not torch.flagos.Stream
    torch.flagos.set_stream(plain)
    try:
        assert torch.flagos.current_stream() is s
    finally:
        torch.flagos.set_stream(torch.flagos.default_stream())
    gone = torch.Stream(stream_id=s.stream_id + 10**6, device_index=0, device_type=s.device_type)
    with pytest.raises(ValueError, match="is not a live flagos stream"):
        torch.flagos.set_stream(gone)


@pytest.mark.skipif(CHIP != "cpu", reason="the synchronous engine of chips without adapter streams")
def test_the_first_stream_of_a_new_engine_is_not_the_default(dev, monkeypatch):
    """A stream engine made anew (the chip changed) gives its first stream a handle other than
    the default stream's 0: making it current makes it current."""
    monkeypatch.setattr(_streams, "_engine_chip", None)
    first = torch.flagos.Stream()
    assert first._handle != 0
    torch.flagos.set_stream(first)
    try:
        assert torch.flagos.current_stream() is first
    finally:
        torch.flagos.set_stream(torch.flagos.default_stream())


def test_sim_never_destroys_a_default_stream_and_refuses_unknown_event_flags():
    """Default streams are the device's own: dropping them (the chip changed) destroys nothing.
    event_create's flags other than FLAGOS_EVENT_TIMING are reserved; flagos passes 0 for them."""
    if CHIP != "sim":
        pytest.skip("sim's own call counters and flag check")
    counters = sim_counters()
    torch.flagos.default_stream(0), torch.flagos.default_stream(1)
    gc.collect()  # streams earlier tests dropped are destroyed now, not below
    destroyed = counters.flagos_sim_calls(b"stream_destroy")
    _streams.reset()
    gc.collect()
    assert counters.flagos_sim_calls(b"stream_destroy") == destroyed
    assert torch.flagos.current_stream().stream_id == 0
    adapter = flagos.chips.profile("sim").adapter
    with pytest.raises(flagos.DeviceError, match="unknown flags 0x2"):
        adapter.event_create(0, 2)
    for timing in (False, True):
        event = torch.flagos.Event(enable_timing=timing)
        event.record()  # made by the adapter at the first record
        assert event.query() is True


def test_a_stream_or_event_whose_handle_cannot_be_freed_is_dropped_quietly(dev, monkeypatch):
    """At interpreter exit the adapter may be gone before the last streams and events: their
    destructors then fail, and the failure is swallowed, not printed as an ignored exception."""
    class GoneAdapter:
        def stream_destroy(self, index, handle):
            raise flagos.DeviceError("the adapter was unloaded")

        event_destroy = stream_destroy

    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    stream, event = torch.flagos.Stream(), torch.flagos.Event()
    event.record()
    stream._engine = event._engine = GoneAdapter()
    del stream, event
    gc.collect()
    assert unraisable == []


def test_event_record_state_decides_what_synchronize_elapsed_and_drop_do(dev):
    """An event never recorded: synchronize() and drop do nothing. A recorded one: synchronize
    waits for it, dropping it frees it (sim's counters). elapsed_time needs both events
    recorded and both flagos timing events."""
    counters = sim_counters()
    calls = (lambda name: counters.flagos_sim_calls(name)) if counters else (lambda name: 0)
    gc.collect()
    synced, destroyed = calls(b"event_synchronize"), calls(b"event_destroy")
    unrecorded = torch.flagos.Event()
    unrecorded.synchronize()
    del unrecorded
    gc.collect()
    assert (calls(b"event_synchronize"), calls(b"event_destroy")) == (synced, destroyed)
    recorded = torch.flagos.Event()
    recorded.record()
    recorded.synchronize()
    del recorded
    gc.collect()
    if counters:
        assert (calls(b"event_synchronize"), calls(b"event_destroy")) == (synced + 1, destroyed + 1)

    start = torch.flagos.Event(enable_timing=True)
    start.record()
    with pytest.raises(ValueError, match="must be recorded"):
        start.elapsed_time(torch.flagos.Event(enable_timing=True))
    with pytest.raises(ValueError, match="enable_timing=True"):
        start.elapsed_time(torch.Event(device="cpu", enable_timing=True))  # not a flagos event


def test_installed_torch_stream_and_event_are_still_pytorch_types():
    """While flagos is installed, torch.Stream and torch.Event keep their names, and every
    stream or event class, PyTorch's own or flagos's, is a subclass of them."""
    for routed, own, ours in ((torch.Stream, torch._C.Stream, torch.flagos.Stream),
                              (torch.Event, torch._C.Event, torch.flagos.Event)):
        assert (routed.__module__, routed.__name__, routed.__qualname__) == ("torch", own.__name__, own.__name__)
        assert issubclass(own, routed) and issubclass(ours, routed) and not issubclass(int, routed)


def test_torch_stream_goes_to_the_current_accelerator(dev, monkeypatch):
    """torch.Stream() without a device is a stream of the current accelerator: flagos's while
    flagos is it, PyTorch's own otherwise."""
    assert type(torch.Stream()) is torch.flagos.Stream
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    assert type(torch.Stream()) is torch._C.Stream
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert type(torch.Stream()) is torch._C.Stream


@runs_once
def test_pytorch_stream_objects_name_flagos_streams_from_the_first_one():
    """In a fresh process: PyTorch's stream 0 is the default stream before flagos made it, and
    stream_id 1 (the process's first flagos stream) is that stream."""
    code = """
        import torch, flagos
        flagos.activate("cpu")
        from flagos.runtime import _streams
        kind = _streams._device_type()
        torch.flagos.set_stream(torch.Stream(stream_id=0, device_index=0, device_type=kind))
        print("default", torch.flagos.current_stream().stream_id)
        first = torch.flagos.Stream()
        torch.flagos.set_stream(torch.Stream(stream_id=first.stream_id, device_index=0, device_type=kind))
        print("first", first.stream_id, torch.flagos.current_stream() is first)
    """
    out = run_python(code).stdout
    assert "default 0" in out and "first 1 True" in out

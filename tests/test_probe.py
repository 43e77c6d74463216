"""What `flagos diagnose`, `flagos devices` and `flagos top` read about the machine
(flagos/report/_probe.py), checked against hand-computed answers with the sources stubbed."""
import io
import sys
import types

import pytest
import torch
from conftest import run_python

import flagos
from flagos.chips.adapter import AdapterChip
from flagos.chips.base import TorchChip
from flagos.errors import AdapterError, DeviceError
from flagos.report import _probe
from flagos.runtime._registration import device_mode_supported


def test_the_cpu_chip_status_names_its_threads_and_simd_and_no_other_chip_does():
    cpu = _probe.chip_status("cpu")
    assert cpu["versions"]["threads"] == str(torch.get_num_threads())
    assert cpu["versions"]["simd"] == torch.backends.cpu.get_cpu_capability()
    assert "threads" not in _probe.chip_status("sim")["versions"]


def test_host_utilization_is_busy_time_over_total_time_between_two_readings(monkeypatch):
    """/proc/stat's counters (busy, total) read at the first call and at the next: the share
    of the time between them that the CPUs were busy."""
    readings = iter([(1_000, 10_000), (1_600, 12_000), (1_600, 12_000), (2_600, 14_000)])
    monkeypatch.setattr(_probe, "_read_cpu_times", lambda: next(readings))
    monkeypatch.setattr(_probe, "time", types.SimpleNamespace(sleep=lambda s: None))
    monkeypatch.setattr(_probe, "_cpu_sample", None)
    assert _probe.cpu_utilization() == 0.3       # 600 busy of 2,000
    assert _probe.cpu_utilization() == 0.3       # no tick since: the last answer stands
    assert _probe.cpu_utilization() == 0.5       # 1,000 busy of 2,000


def test_a_gpu_reports_its_utilization_in_percent_and_flagos_as_a_fraction(monkeypatch):
    """torch.<chip>.utilization(index) answers in percent (NVML's); flagos reports 0..1, and
    None where the vendor's management library is missing (the call raises)."""
    monkeypatch.setattr(torch, "flagosfake", types.SimpleNamespace(utilization=lambda index: 37 + index),
                        raising=False)
    chip = TorchChip(name="fake", torch_type="flagosfake", vendor="Fake", collective_backend="gloo")
    assert _probe.device_utilization(chip, 0) == 0.37 and _probe.device_utilization(chip, 2) == 0.39

    def no_library(index):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch, "flagosfake", types.SimpleNamespace(utilization=no_library))
    assert _probe.device_utilization(chip, 0) is None
    assert _probe.device_utilization(flagos.chips.profile("sim"), 0) is None


class _NowhereChip(AdapterChip):
    """An adapter chip whose library is in no folder."""
    install = "build libflagos_nowhere_adapter.so from the vendor's kit"


class _VendorFails(AdapterChip):
    @property
    def vendor(self) -> str:
        raise AdapterError("the adapter cannot be loaded to ask it")


def test_a_missing_adapter_library_names_the_folders_searched_and_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGOS_ADAPTER_PATH", str(tmp_path))
    found = _probe._adapter_status(_NowhereChip("nowhere", vendor="Acme"))
    assert found == {
        "chip": "nowhere", "kind": "adapter", "status": _probe.UNAVAILABLE, "problem": "library_missing",
        "reason": f"library missing: no libflagos_nowhere_adapter.so in {tmp_path}, {_probe.PACKAGE_DIR}; "
                  "build libflagos_nowhere_adapter.so from the vendor's kit",
        "vendor": "Acme", "device_count": 0, "mode": "device", "versions": {}, "source": ""}
    # no install hint: the reason ends with the folders
    plain = _probe._adapter_status(AdapterChip("nowhere"))
    assert plain["reason"] == f"library missing: no libflagos_nowhere_adapter.so in {tmp_path}, {_probe.PACKAGE_DIR}"
    assert plain["vendor"] == ""
    # a vendor that cannot be read (its adapter does not load) is reported empty, not raised
    assert _probe._adapter_status(_VendorFails("nowhere"))["vendor"] == ""


class _StubAdapter:
    abi = (1, 2)

    def __init__(self, count):
        self._count = count

    def device_count(self):
        if isinstance(self._count, Exception):
            raise self._count
        return self._count


@pytest.mark.parametrize("count, expected", [
    (DeviceError("toy_device_count failed: TOY_ERROR_BUS", chip="nowhere"),
     ("broken", "device_error", "device error: toy_device_count failed: TOY_ERROR_BUS", 0, {})),
    (0, ("unavailable", "no_devices", "no devices: the adapter reports 0 devices; "
         "build libflagos_nowhere_adapter.so from the vendor's kit", 0, {"adapter_abi": "1.2"})),
    (1, ("available", "", "", 1, {"adapter_abi": "1.2"})),
])
def test_an_adapter_that_loads_is_judged_by_its_device_count(monkeypatch, count, expected):
    monkeypatch.setattr(_probe, "find_library", lambda name: f"/opt/{name}/libflagos_{name}_adapter.so")
    monkeypatch.setattr(_probe, "load", lambda path: _StubAdapter(count))
    found = _probe._adapter_status(_NowhereChip("nowhere"))
    assert (found["status"], found["problem"], found["reason"], found["device_count"], found["versions"]) == expected
    assert found["source"] == "/opt/nowhere/libflagos_nowhere_adapter.so"


def test_the_natural_mode_is_native_only_for_a_chip_that_owns_privateuse1(monkeypatch):
    device = "device" if device_mode_supported() else "native"
    assert _probe.chip_status("cpu")["mode"] == device
    assert _probe.chip_status("sim")["mode"] == "device"  # an adapter chip always wraps
    owner = TorchChip(name="owner", torch_type="flagosfake", vendor="Fake", collective_backend="gloo")
    owner.owns_privateuse1 = True
    assert _probe.natural_mode(owner) == "native"
    # a PyTorch without device mode: only adapter chips (which need it) still say device
    monkeypatch.setattr(_probe, "device_mode_supported", lambda: False)
    assert _probe.natural_mode(flagos.chips.profile("cpu")) == "native"
    assert _probe.natural_mode(flagos.chips.profile("sim")) == "device"


@pytest.mark.parametrize("error, expected", [
    (OSError("/opt/torch_npu/lib/libtorch_npu.so: undefined symbol: _ZN3c104impl3cow\nsecond line"),
     ("abi_mismatch", "ABI mismatch: torch_npu was built for another PyTorch than {torch} (OSError: "
      "/opt/torch_npu/lib/libtorch_npu.so: undefined symbol: _ZN3c104impl3cow); install the torch_npu "
      "release made for this PyTorch")),
    (ImportError("module compiled against an INCOMPATIBLE torch"),
     ("abi_mismatch", "ABI mismatch: torch_npu was built for another PyTorch than {torch} (ImportError: "
      "module compiled against an INCOMPATIBLE torch); install the torch_npu release made for this PyTorch")),
    (ImportError("libhccl.so: cannot open shared object file: No such file or directory"),
     ("driver_missing", "driver missing: torch_npu cannot load a vendor library (ImportError: libhccl.so: "
      "cannot open shared object file: No such file or directory); install the vendor driver/toolkit and "
      "source its environment script")),
    (RuntimeError("LibAscend_hal not found"),
     ("driver_missing", "driver missing: torch_npu cannot load a vendor library (RuntimeError: LibAscend_hal "
      "not found); install the vendor driver/toolkit and source its environment script")),
    (RuntimeError(""), ("load_error", "load error: import torch_npu failed (RuntimeError: )")),
])
def test_a_vendor_plugin_that_fails_to_import_is_told_apart_by_its_message(error, expected):
    problem, reason = _probe._import_failure("torch_npu", error)
    assert (problem, reason) == (expected[0], expected[1].format(torch=torch.__version__))


def test_versions_name_the_plugin_and_the_gpu_runtime_libraries(monkeypatch):
    plugin = TorchChip(name="fake", torch_type="flagosfake", vendor="Fake", collective_backend="gloo",
                       plugin="flagos_fake_plugin")
    monkeypatch.setitem(sys.modules, "flagos_fake_plugin", types.SimpleNamespace(__version__="2.1.0"))
    assert _probe._torch_versions(plugin) == {"flagos_fake_plugin": "2.1.0"}
    monkeypatch.setitem(sys.modules, "flagos_fake_plugin", types.SimpleNamespace())
    assert _probe._torch_versions(plugin) == {"flagos_fake_plugin": "unknown"}

    cuda = flagos.chips.profile("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(_probe, "_nvidia_driver_version", lambda: "550.54.15")
    assert _probe._torch_versions(cuda) == {"cuda_runtime": "12.4", "cudnn": "90100", "driver": "550.54.15"}

    def no_cudnn():
        raise RuntimeError("cuDNN not loadable")

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2.4", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "version", no_cudnn)
    monkeypatch.setattr(_probe, "_nvidia_driver_version", lambda: "")
    assert _probe._torch_versions(cuda) == {"hip": "6.2.4"}

    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    assert _probe._torch_versions(flagos.chips.profile("xpu")) == {"xpu": "20250101"}
    assert "xpu" not in _probe._torch_versions(flagos.chips.profile("cpu"))


def test_the_nvidia_driver_version_is_read_through_nvml_when_it_loads(monkeypatch):
    read = _probe._nvidia_driver_version.__wrapped__  # the function without its cache
    for answer in (b"550.54.15", "550.54.15"):  # older pynvml answers bytes
        monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(
            nvmlInit=lambda: None, nvmlSystemGetDriverVersion=lambda answer=answer: answer))
        assert read() == "550.54.15"

    class NVMLError(Exception):  # pynvml's own errors derive from Exception only
        pass

    def no_driver():
        raise NVMLError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    assert read() == ""


def test_a_chip_this_pytorch_build_cannot_have_is_named_as_not_built(monkeypatch):
    version = torch.__version__
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    cuda = flagos.chips.profile("cuda")
    assert _probe._not_built_reason(cuda) == f"this PyTorch ({version}) is built without CUDA or ROCm"
    monkeypatch.setattr(torch.version, "hip", "6.2.4")
    assert _probe._not_built_reason(cuda) == ""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert _probe._not_built_reason(cuda) == ""

    mps = flagos.chips.profile("mps")
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    assert _probe._not_built_reason(mps) == f"this PyTorch ({version}) is built without MPS (macOS builds only)"
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    assert _probe._not_built_reason(mps) == ""

    xpu = flagos.chips.profile("xpu")
    monkeypatch.setattr(torch.version, "xpu", None, raising=False)
    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: False)
    assert _probe._not_built_reason(xpu) == f"this PyTorch ({version}) is built without XPU"
    monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: True)
    assert _probe._not_built_reason(xpu) == ""
    assert _probe._not_built_reason(flagos.chips.profile("cpu")) == ""


class _Board:
    """A torch-native chip's device queries, stubbed: what `flagos devices` reads of a device."""
    name, vendor, native_dtypes = "board", "Acme", ("float32", "float16")

    def __init__(self, device_wide=True, broken=False):
        self.device_wide, self.broken = device_wide, broken

    def device_name(self, index):
        if self.broken:
            raise RuntimeError("device 1 is lost")
        return f"Acme {index}"

    def mem_get_info(self, index):
        if not self.device_wide:
            raise NotImplementedError
        return 3_000, 10_000  # free, total

    def memory_reserved(self, index):
        return 1_234

    def total_memory(self, index):
        return 8_000


def test_a_device_row_reads_memory_device_wide_where_it_can_and_reports_a_failed_device():
    assert _probe.device_row(_Board(), 1, "device") == {
        "chip": "board", "index": 1, "name": "Acme 1", "vendor": "Acme", "memory_used": 7_000,
        "memory_total": 10_000, "native_dtypes": ["float32", "float16"], "mode": "device", "status": "ok"}
    # no device-wide query (mps): what this process holds, of the device's total
    row = _probe.device_row(_Board(device_wide=False), 0, "native", utilization=True)
    assert (row["memory_used"], row["memory_total"], row["utilization"]) == (1_234, 8_000, None)
    broken = _probe.device_row(_Board(broken=True), 1, "device", utilization=True)
    assert broken["status"] == "error: RuntimeError: device 1 is lost"
    assert (broken["name"], broken["memory_used"], broken["native_dtypes"], broken["utilization"]) == \
        (None, None, [], None)


def test_device_rows_list_the_devices_of_available_chips_in_the_mode_they_run_in():
    statuses = [_probe.chip_status("cpu"), _probe.chip_status("sim"),
                {**_probe.chip_status("sim"), "chip": "npu", "status": _probe.UNAVAILABLE}]
    rows = _probe.device_rows(statuses)
    assert [(r["chip"], r["index"]) for r in rows] == [("cpu", 0), ("sim", 0), ("sim", 1)]
    info = flagos.info()
    for row in rows:  # the active chip says the mode it was activated in, the others their natural one
        natural = statuses[0 if row["chip"] == "cpu" else 1]["mode"]
        assert row["mode"] == (info["mode"] if row["chip"] == info["chip"] else natural), row


def _fake_chip(**kw) -> TorchChip:
    return TorchChip(name="fake", torch_type="flagosfake", vendor="Fake", collective_backend="gloo", **kw)


def test_a_torch_native_chip_is_judged_by_its_plugin_then_its_torch_module(monkeypatch, tmp_path):
    def judged(chip):
        found = _probe._torch_status(chip)
        return found["status"], found["problem"], found["reason"], found["device_count"], found["source"]

    assert judged(_fake_chip(plugin="flagos_absent_plugin")) == (
        "unavailable", "package_missing", "package missing: flagos_absent_plugin is not installed", 0,
        "flagos_absent_plugin")
    (tmp_path / "flagos_broken_plugin.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, problem, reason, _, source = judged(_fake_chip(plugin="flagos_broken_plugin"))
    assert (status, problem, source) == ("broken", "driver_missing", "flagos_broken_plugin")
    assert reason.startswith("driver missing: flagos_broken_plugin cannot load a vendor library (ImportError: ")

    monkeypatch.setattr(torch, "flagosfake", types.SimpleNamespace(is_available=lambda: False,
                                                                  device_count=lambda: 0), raising=False)
    assert judged(_fake_chip()) == (
        "unavailable", "driver_missing",
        "driver missing or no device: torch.flagosfake.is_available() is False", 0, "torch.flagosfake")
    torch.flagosfake.is_available = lambda: True
    assert judged(_fake_chip()) == ("unavailable", "no_devices", "no devices", 0, "torch.flagosfake")
    torch.flagosfake.device_count = lambda: 2
    assert judged(_fake_chip()) == ("available", "", "", 2, "torch.flagosfake")

    def lost():
        raise RuntimeError("driver/library version mismatch")

    torch.flagosfake.is_available = lost
    assert judged(_fake_chip()) == (
        "broken", "load_error",
        "load error: torch.flagosfake failed (RuntimeError: driver/library version mismatch)", 0, "torch.flagosfake")


def test_the_active_mode_is_the_active_chips_alone():
    info = flagos.info()
    assert _probe._active_mode(info["chip"]) == info["mode"]
    assert _probe._active_mode("npu" if info["chip"] != "npu" else "mlu") is None


def test_cpu_times_are_read_from_proc_stat_with_iowait_counted_idle(monkeypatch):
    def stat(text):
        monkeypatch.setattr(_probe, "open", lambda path: io.StringIO(text), raising=False)
        return _probe._read_cpu_times()

    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    assert stat("cpu  100 5 50 800 20 0 5 0 0 0\ncpu0 1 2 3 4\n") == (160, 980)
    assert stat("cpu 1 2 3 4\n") == (6, 10)  # an old kernel: no iowait column
    assert stat("cpu 1 2 3 4 5\n") == (6, 15)  # iowait the last column
    assert stat("cpu  x y z\n") is None

    def unreadable(path):
        raise PermissionError(path)

    monkeypatch.setattr(_probe, "open", unreadable, raising=False)
    assert _probe._read_cpu_times() is None


def test_host_utilization_is_zero_before_a_clock_tick_and_none_without_proc_stat(monkeypatch):
    # a fresh process: its first answer, when no clock tick passed, is the initial one
    proc = run_python("""
        from flagos.report import _probe
        _probe._read_cpu_times = lambda: (1_000, 10_000)
        print("first", _probe.cpu_utilization())
        _probe._read_cpu_times = lambda: None
        print("unreadable", _probe.cpu_utilization())
    """)
    assert "first 0.0\nunreadable None" in proc.stdout


def test_host_utilization_is_rounded_to_four_places_and_taken_after_a_single_tick(monkeypatch):
    readings = iter([(0, 0), (1, 3), (2, 4)])
    monkeypatch.setattr(_probe, "_read_cpu_times", lambda: next(readings))
    monkeypatch.setattr(_probe, "time", types.SimpleNamespace(sleep=lambda s: None))
    monkeypatch.setattr(_probe, "_cpu_sample", None)
    assert _probe.cpu_utilization() == 0.3333   # 1 busy of 3
    assert _probe.cpu_utilization() == 1.0      # one tick, busy

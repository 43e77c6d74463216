"""What `flagos diagnose`, `flagos devices` and `flagos top` read about the machine
(flagos/report/_probe.py), checked against hand-computed answers with the sources stubbed."""
import types

import torch

import flagos
from flagos.chips.base import TorchChip
from flagos.report import _probe


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

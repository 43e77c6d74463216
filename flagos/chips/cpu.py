"""The host CPU as a chip: always present, the reference every test compares with."""
from __future__ import annotations

import platform

import torch

from .base import HostGenerator, TorchChip, host_memory


class CpuChip(HostGenerator, TorchChip):
    """PyTorch's CPU device. It has no allocator statistics (PyTorch keeps none for the
    CPU), so the memory counters read 0 and mem_get_info reports host memory."""

    def __init__(self):
        super().__init__(name="cpu", torch_type="cpu", vendor=platform.processor() or "host",
                         collective_backend="gloo")

    def detect(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device_name(self, index: int) -> str:
        return platform.processor() or platform.machine() or "cpu"

    def total_memory(self, index: int) -> int:
        return host_memory()[1]

    def architecture(self) -> str:
        """The machine and the vector ISA Inductor's C++ code is built for ("x86_64-avx2")."""
        try:
            isa = torch.backends.cpu.get_cpu_capability().lower()
        except Exception:  # an older PyTorch without it
            isa = "unknown"
        return f"{platform.machine() or 'unknown'}-{isa}"

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"the cpu chip has one device; flagos:{index} does not exist")

    def synchronize(self, index=None) -> None:
        pass

    def memory_allocated(self, index: int) -> int:
        return 0

    max_memory_allocated = memory_reserved = memory_allocated

    def reset_peak_memory_stats(self, index: int) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self, index: int) -> tuple[int, int]:
        return host_memory()


CHIP = CpuChip()

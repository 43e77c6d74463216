"""opencl: every OpenCL device (backends/opencl), a C-ABI adapter over the Khronos ICD loader.

`auto` picks it only for a GPU or accelerator (after cuda, xpu and mps): on a machine whose
only OpenCL devices are CPUs (PoCL), the cpu chip runs PyTorch's own kernels and is faster.
Asked for by name (`FLAGOS_DEVICE=opencl`), it runs on any OpenCL device, CPUs included.
"""
from __future__ import annotations

import ctypes

from ..errors import AdapterError, DeviceError
from .adapter import AdapterChip, find_library, search_path

CL_DEVICE_TYPE_CPU = 2
INSTALL = ("install the OpenCL headers and ICD loader (Debian/Ubuntu: `apt-get install "
           "ocl-icd-opencl-dev opencl-headers`) and a driver (your GPU vendor's OpenCL ICD, or "
           "pocl-opencl-icd for the CPU), then rebuild flagos (`pip install -e .` or "
           "`python setup.py build_ext --inplace`)")


class OpenCLChip(AdapterChip):
    install = f"to use it, {INSTALL}"
    fork_safe = False  # OpenCL drivers (PoCL included) run threads a fork does not copy

    @property
    def adapter(self):
        if self._adapter is None:
            if find_library(self.name) is None:
                raise AdapterError(
                    f"chip 'opencl': the OpenCL adapter was not built (no "
                    f"libflagos_opencl_adapter.so in {', '.join(search_path())}): {INSTALL}")
            adapter = super().adapter
            if adapter.device_count() < 1:
                raise AdapterError(
                    "chip 'opencl': the OpenCL adapter found no device (`clinfo -l` lists the "
                    "OpenCL platforms and devices the ICD loader sees); install an OpenCL "
                    "driver: your GPU vendor's OpenCL ICD, or pocl-opencl-icd for the CPU")
        return self._adapter

    def why_unavailable(self) -> str:
        try:
            _ = self.adapter
        except (AdapterError, DeviceError) as e:
            return str(e)
        return "available"

    def detect(self) -> bool:
        """Quietly False when the adapter was not built or no OpenCL device exists."""
        if find_library(self.name) is None:
            return False
        try:
            return self.adapter.device_count() > 0
        except (AdapterError, DeviceError):
            return False

    def device_type(self, index: int) -> int:
        """CL_DEVICE_TYPE bits of a device (2 CPU, 4 GPU, 8 accelerator)."""
        fn = ctypes.CDLL(self.adapter.path).flagos_opencl_device_type
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_int32]
        return int(fn(index))

    def picked_by_auto(self) -> bool:
        """Only for a device that is not a CPU: there the cpu chip is the better choice."""
        return self.detect() and any(
            not self.device_type(i) & CL_DEVICE_TYPE_CPU for i in range(self.device_count()))

    def program_stats(self) -> dict:
        """What the on-disk program cache did in this process (backends/opencl/program.c)."""
        values = [ctypes.c_int64() for _ in range(3)]
        ctypes.CDLL(self.adapter.path).flagos_opencl_program_stats(*map(ctypes.byref, values))
        return dict(zip(("from_cache", "built", "written"), (v.value for v in values)))


CHIP = OpenCLChip("opencl", vendor="OpenCL (Khronos ICD)")

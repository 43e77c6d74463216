"""GPUs behind PyTorch's `torch.cuda` API: NVIDIA, and the vendors whose PyTorch build answers
through it (AMD ROCm, Hygon DCU, Iluvatar CoreX, MetaX). One chip, `cuda`; its vendor is read
from what PyTorch reports (names.cuda_vendor) once a device is there, and brings that vendor's
native dtypes, collective backend and out-of-memory patterns."""
from __future__ import annotations

import torch

from .base import TorchChip, torch_module
from .names import CUDA_VENDORS, VendorFacts, cuda_vendor


class CudaChip(TorchChip):
    def __init__(self):
        self.name, self.torch_type, self.plugin = "cuda", "cuda", None
        self.owns_privateuse1, self.extra = False, {}
        self.install = ("a PyTorch build for your GPU and its driver: CUDA (NVIDIA), ROCm (AMD), "
                        "or the vendor's (Hygon DTK, Iluvatar CoreX, MetaX MACA)")
        self._facts: VendorFacts | None = None

    def facts(self) -> VendorFacts:
        """The vendor's facts: identified once a device answers; NVIDIA's until then (reading
        the device name initializes the runtime, which detect() must not do)."""
        if self._facts is None:
            try:
                if not torch.cuda.is_available():
                    return CUDA_VENDORS["nvidia"]
                name = torch.cuda.get_device_name(0)
            except Exception:  # a broken runtime is detect()'s to report
                return CUDA_VENDORS["nvidia"]
            vendor = cuda_vendor(name, getattr(torch.version, "hip", None), torch.__version__)
            self._facts = CUDA_VENDORS[vendor]
        return self._facts

    @property
    def vendor(self) -> str:
        return self.facts().vendor

    @property
    def native_dtypes(self) -> tuple[str, ...]:
        return self.facts().native_dtypes

    @property
    def collective_backend(self) -> str:
        return self.facts().collective_backend

    def architecture(self) -> str | None:
        """"sm90" (NVIDIA: the compute capability), the gfx target on ROCm ("gfx942:sramecc+:
        xnack-"); several when the devices differ ("sm80+sm90"). None until the CUDA runtime is
        initialized: reading a device's properties initializes it, which activation must not
        do (a program that forks workers after `import torch` could no longer use CUDA in
        them); `when_initialized` says when it is."""
        if not torch_module("cuda").is_initialized():
            return None
        return self.architecture_now()

    def architecture_now(self) -> str:
        """The architecture, read now (initializing the runtime if it is not)."""
        cuda = torch_module("cuda")
        found = set()
        for i in range(cuda.device_count()):
            if getattr(torch.version, "hip", None):
                found.add(getattr(cuda.get_device_properties(i), "gcnArchName", "") or "unknown")
            else:
                major, minor = cuda.get_device_capability(i)
                found.add(f"sm{major}{minor}")
        return "+".join(sorted(found)) or "unknown"

    def when_initialized(self, callback) -> None:
        """Run `callback` once the CUDA runtime is initialized (now, if it is)."""
        torch_module("cuda")._lazy_call(callback)  # where torch.cuda.manual_seed waits too

    @property
    def oom_patterns(self) -> tuple[str, ...]:
        return self.facts().oom_patterns


CHIP = CudaChip()

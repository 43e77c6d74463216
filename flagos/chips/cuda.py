"""GPUs behind PyTorch's `torch.cuda` API: NVIDIA, and the vendors whose PyTorch build answers
through it (AMD ROCm, Hygon DCU, Iluvatar CoreX, MetaX). One chip, `cuda`; its vendor is read
from what PyTorch reports (names.cuda_vendor) once a device is there, and brings that vendor's
native dtypes, collective backend and out-of-memory patterns."""
from __future__ import annotations

import torch

from .base import TorchChip
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

    @property
    def oom_patterns(self) -> tuple[str, ...]:
        return self.facts().oom_patterns


CHIP = CudaChip()

"""Apple GPUs through PyTorch's `mps` device (no float64, one device)."""
from .base import _COMMON_DTYPES, TorchChip


class MpsChip(TorchChip):
    def device_count(self) -> int:
        return 1 if self.detect() else 0

    def device_name(self, index: int) -> str:
        return "Apple GPU (mps)"

    def total_memory(self, index: int) -> int:
        import torch
        return int(torch.mps.recommended_max_memory())

    def memory_allocated(self, index: int) -> int:
        import torch
        return int(torch.mps.current_allocated_memory())

    def memory_reserved(self, index: int) -> int:
        import torch
        return int(torch.mps.driver_allocated_memory())

    def synchronize(self, index=None) -> None:
        import torch
        torch.mps.synchronize()

    # torch.mps has one generator and no *_all or initial_seed functions: PyTorch's seeding
    # calls manual_seed_all on the device module, which must not fail here.
    def manual_seed_all(self, seed: int) -> None:
        self._module().manual_seed(seed)

    def seed_all(self) -> None:
        self._module().seed()

    def initial_seed(self) -> int:
        return int(self._module()._get_default_mps_generator().initial_seed())


CHIP = MpsChip(name="mps", torch_type="mps", vendor="apple", collective_backend="gloo",
               native_dtypes=_COMMON_DTYPES, oom_patterns=("mps backend out of memory",),
               install="PyTorch on macOS 12.3+ on Apple silicon (the standard macOS wheels)")

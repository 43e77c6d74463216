"""sim: the emulated accelerator (backends/sim), a C-ABI adapter with its own memory pool."""
import ctypes

from .adapter import AdapterChip


class SimChip(AdapterChip):
    def on_activated(self) -> None:
        """FLAGOS_SIM_FAIL_ALLOC_AT counts the program's allocations: from here, not those of
        activate()'s own checks. (A sim library from FLAGOS_ADAPTER_PATH may not offer it.)"""
        count_allocations = getattr(ctypes.CDLL(self.adapter.path), "flagos_sim_count_allocations", None)
        if count_allocations is not None:
            count_allocations.restype = None
            count_allocations()


CHIP = SimChip("sim", vendor="flagos (emulated accelerator)")

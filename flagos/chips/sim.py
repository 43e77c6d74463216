"""sim: the emulated accelerator (backends/sim), a C-ABI adapter with its own memory pool."""
from .adapter import AdapterChip

CHIP = AdapterChip("sim", vendor="flagos (emulated accelerator)")

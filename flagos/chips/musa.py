"""Moore Threads GPUs through torch_musa (which owns PrivateUse1: native mode)."""
from .base import _COMMON_DTYPES, TorchChip

CHIP = TorchChip(name="musa", torch_type="musa", vendor="moore threads", collective_backend="mccl",
                 plugin="torch_musa", owns_privateuse1=True, native_dtypes=_COMMON_DTYPES,
                 oom_patterns=("musa out of memory", "out of memory"),
                 install="torch_musa from Moore Threads' release matching your MUSA toolkit and driver")

"""Cambricon MLUs through torch_mlu (which owns PrivateUse1: native mode)."""
from .base import _COMMON_DTYPES, TorchChip

CHIP = TorchChip(name="mlu", torch_type="mlu", vendor="cambricon", collective_backend="cncl",
                 plugin="torch_mlu", owns_privateuse1=True, native_dtypes=_COMMON_DTYPES,
                 oom_patterns=("mlu out of memory", "out of memory", "CNRT_RET_ERR_NOMEM"),
                 install="torch_mlu from Cambricon's PyTorch release for your driver (Cambricon Neuware)")

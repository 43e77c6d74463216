"""Huawei Ascend NPUs through torch_npu (which owns PrivateUse1: native mode)."""
from .base import _COMMON_DTYPES, TorchChip

CHIP = TorchChip(name="npu", torch_type="npu", vendor="huawei", collective_backend="hccl",
                 plugin="torch_npu", owns_privateuse1=True, native_dtypes=_COMMON_DTYPES,
                 oom_patterns=("npu out of memory", "out of memory", "ERR00100"),
                 install="torch_npu matching your PyTorch (pip install torch-npu), on top of Ascend's "
                         "CANN toolkit and driver")

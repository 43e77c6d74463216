"""Intel GPUs through PyTorch's built-in `xpu` device."""
from .base import TorchChip

CHIP = TorchChip(name="xpu", torch_type="xpu", vendor="intel", collective_backend="xccl",
                 oom_patterns=("xpu out of memory", "out of memory", "ur_result_error_out_of"),
                 install="a PyTorch build with XPU support (the xpu wheels) and Intel's GPU driver")

"""NVIDIA GPUs, and AMD GPUs through ROCm (PyTorch exposes both as `cuda`)."""
from .base import TorchChip

CHIP = TorchChip(name="cuda", torch_type="cuda", vendor="nvidia", collective_backend="nccl",
                 oom_patterns=("cuda out of memory", "out of memory", "hip out of memory"))

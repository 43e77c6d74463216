"""Native mode: the same C router, installed as a dispatch mode over the chip's own tensors.

Used when a vendor plugin owns PrivateUse1 (torch_npu, torch_mlu, torch_musa)
or when asked for. Dispatch modes are per thread; autograd's backward carries
the mode of the thread that started it.
"""
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _C


class NativeMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _C.dispatch_native(func, types, args, kwargs)

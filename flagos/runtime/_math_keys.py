"""Chip ops on complex tensors with PyTorch's conjugate and negative fallbacks enabled.

Inside `__torch_dispatch__` (and a dispatch mode) PyTorch excludes every dispatch key above
Python, the Conjugate and Negative keys included. An op that reaches the router whole but is
written in terms of other ops (linalg.pinv, linalg.lstsq: conjugate views, then products) then
hands conjugate views to kernels that ignore the bit, and computes with unconjugated values. The
C router calls chip ops whose tensors include a complex one through `call`, which turns those
two keys back on for the call.
"""
from __future__ import annotations

import torch

from .. import _C

_K = torch._C.DispatchKey
_MATH_KEYS = (_K.Conjugate, _K.Negative)
COMPLEX = (torch.complex32, torch.complex64, torch.complex128)


def call(fn, args, kwargs):
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _MATH_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        return fn(*args, **(kwargs or {}))


def install() -> None:
    _C.set_math_call(call, COMPLEX)

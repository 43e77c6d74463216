"""Python errors pending when PyTorch calls flagos's device guard.

PyTorch's `noexcept` stream guard calls the Python device guard's `type_()` while an exception
from backward unwinds with its Python error still pending. flagos's guard answers without
Python (csrc/guard.c): it takes the pending error aside and hands it to `keep`, which files it
with the backward pass it belongs to. integrations/_backward_errors.py raises it from
`backward()` and `autograd.grad()` in the caller's thread.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("flagos")

# Each backward() puts a fresh list in PyTorch's Python-object TLS; the engine hands the
# caller's thread-local state to the threads that run the pass, so keep() files an error with
# the pass it belongs to, from whichever thread. The pass itself then fails with the emptied
# C++ error, which reaches Python as a SystemError ("returned NULL without setting an
# exception"); the kept exception replaces it.

KEPT = "flagos.backward_errors"


def keep(exc: BaseException) -> None:
    """Called by the device guard with the Python error pending when PyTorch called it."""
    kept = torch._C._get_obj_in_tls(KEPT) if torch._C._is_key_in_tls(KEPT) else None
    if kept is not None:
        kept.append(exc)
        return
    log.error("a Python error was pending in a PyTorch device-guard call outside backward() "
              "and autograd.grad(); the caller gets a SystemError instead:", exc_info=exc)

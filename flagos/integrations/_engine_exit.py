"""autograd's engine thread lets go of every backward pass before the interpreter shuts down.

The engine runs the backward nodes of flagos tensors on a C++ thread of its own. That thread
holds each pass (its `GraphTask`) a little past the moment the caller of `backward()` resumes,
and a pass that failed on the CPU side can still be running a flagos node or hook there. When it
lets go it drops Python objects (the pass's copy of the caller's thread-local state, hooks,
tensors), which takes the GIL; if the program has ended by then, the interpreter is finalizing
and CPython ends that thread inside a `noexcept` frame: the process aborts at exit ("terminate
called without an active exception") after the program did all its work. On plain CPU the caller
runs every node itself, so it never happens there.

At exit, before the interpreter starts finalizing, one scalar backward pass that runs no kernel
goes through the engine from a fresh thread: the engine thread takes it only after it has finished what it was
doing and let go of the previous pass, and this pass holds no Python object, so what the thread
does after it never needs the GIL (docs/design.md §11, "At exit").
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time

import torch

from ..core import _state

log = logging.getLogger("flagos")

_passes_ran = False   # a backward pass went through the engine since flagos was activated

# The drains' threads not yet seen to end. One that gave up can still be inside the engine's
# run_backward: when its pass completes it takes the GIL back in a C++ destructor, and if the
# interpreter is finalizing by then that ends the process (the abort this module is for).
_workers: list[threading.Thread] = []

# PyTorch's own limit on waiting for its autograd threads at shutdown; the same wait here.
WAIT_LIMIT_VARIABLE = "TORCH_AUTOGRAD_SHUTDOWN_WAIT_LIMIT"


def note_pass() -> None:
    """Called for each backward pass (backward(), autograd.grad()) on the way into the engine."""
    global _passes_ran
    _passes_ran = True


def wait_limit() -> float:
    raw = os.environ.get(WAIT_LIMIT_VARIABLE, "")
    try:
        return max(float(raw), 0.0) if raw.strip() else 10.0
    except ValueError:
        return 10.0  # PyTorch reads it with atof, which gives 0 here; waiting is the safe side


def drain() -> bool:
    """Push one backward pass through flagos:0's engine thread and wait for it. True when the
    thread answered within the limit (or had nothing to answer for)."""
    state = _state.active_or_none()
    if not _passes_ran or state is None or state.mode != "device" or not state.backward_ok:
        return True
    deadline = time.monotonic() + wait_limit()
    # A fresh thread: its thread-local state holds no Python object for the pass to copy.
    worker = threading.Thread(target=_one_pass, args=(state.flagos_devices[0],),
                              name="flagos-engine-drain", daemon=True)
    worker.start()
    _workers.append(worker)
    # Earlier drains' threads too, within the same limit: one may still be on its way out
    # of the engine.
    for waiting in _workers:
        waiting.join(max(deadline - time.monotonic(), 0.0))
    _workers[:] = [waiting for waiting in _workers if waiting.is_alive()]
    if _workers:
        log.warning("autograd's engine thread was still busy %.0f s after the program ended "
                    "(a hook or op that does not return?); the process may abort while it "
                    "exits", wait_limit())
        return False
    return True


class _KernelFree(torch.autograd.Function):
    """A node whose backward runs no op: the drain's pass needs no kernel of the chip, so forced
    routes and the fallback policy cannot make it fail."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None


def _one_pass(device: torch.device) -> None:
    try:
        x = torch.empty((), device=device, requires_grad=True)
        root = _KernelFree.apply(x)
        # The engine directly: backward()'s wrapper would put a Python object in the pass. The
        # node runs on flagos:0's engine thread because its incoming gradient is on flagos:0.
        torch.autograd.Variable._execution_engine.run_backward(
            (root,), (torch.empty((), device=device),), False, False, (), True, True)
    except BaseException as e:  # noqa: BLE001 - a broken chip at exit: nothing to wait for
        log.debug("the engine drain at exit failed: %s", e)


# Registered at import, before anything flagos registers at activation (the report's exit hook
# among them): atexit runs hooks last-in first-out, so the drain's ops never reach the report.
atexit.register(drain)

"""Errors inside `backward()`: raised by `backward()` in the caller's thread, never an abort.

PyTorch runs the backward nodes of a PrivateUse1 device on an engine thread of its own, inside a
stream guard. When Python code the engine runs there raises (a tensor or module hook, a
saved-tensor unpack hook, an op's `__torch_dispatch__`, a KeyboardInterrupt), PyTorch unwinds
through that guard with the Python error still pending, and the guard's `noexcept` destructor
calls the Python device guard. flagos's device guard answers that call without Python
(csrc/guard.c): it takes the pending error aside and hands it to `keep` (runtime/_guard_errors.py), which files it with the
backward pass it belongs to; `backward()` and `autograd.grad()` then raise it in the caller's
thread as the exception it was (docs/design.md, "Errors inside backward").
"""
from __future__ import annotations

import functools

import torch

from .. import _C, errors
from ..core import _state
from ..runtime._guard_errors import KEPT
from . import _engine_exit


def install() -> None:
    _install_engine_check()


# ---- backward passes autograd's engine has no queue for ------------------------
#
# The engine gives each non-CPU device index a ready queue, sized once, at the first backward
# of the process, by the largest device count a registered device guard reports. PyTorch's
# Python device guard for PrivateUse1 reports one device and offers no way to report more,
# and a guard registered after that first backward is not counted at all. A backward pass
# that needs a missing queue stops at an internal assert (`device_ready_queues_`) before any
# op runs; it is raised in the caller's thread, so it can be replaced by an error that says
# why and what to do.

ENGINE_QUEUE = "device_ready_queues_"


NoEngineQueueError = errors.NoEngineQueueError
AcceleratorBackwardError = errors.AcceleratorBackwardError
# PyTorch's assert when a backward meets tensors of an accelerator other than the one it takes
# for the process's: once PrivateUse1 is registered it takes PrivateUse1 (pytorch/pytorch#161129,
# docs/design.md).
STREAM_ASSERT = "opt_ready_stream && opt_parent_stream"
ACCELERATOR_BACKWARD = (
    "backward() over tensors of another accelerator (plain cuda tensors, say) cannot run in a "
    "process where flagos holds PyTorch's PrivateUse1 device (device mode): PyTorch's autograd "
    "engine then takes flagos for the process's accelerator and asserts on the other device's "
    "streams (pytorch/pytorch#161129). Put the model and its inputs on flagos.device() (their "
    "memory stays the chip's), or use native mode (FLAGOS_MODE=native, or "
    "flagos.activate(mode=\"native\")), where they stay cuda tensors and flagos routes their ops "
    "all the same.")


def engine_queue_message() -> str:
    state = _state.active_or_none()
    if state is not None and not state.backward_ok:
        return ("backward() cannot run on flagos tensors in this process: a backward pass ran "
                "before flagos was activated, and PyTorch's autograd engine sizes its device "
                "queues once, at the first backward of a process, so it has none for flagos. "
                "Activate flagos before the first backward(): call flagos.activate() at the "
                "start of the program, or set FLAGOS_DEVICE so it activates at `import torch`.")
    return ("backward() over tensors on flagos:1 or above cannot run: PyTorch's Python device "
            "guard for PrivateUse1 reports one device, so autograd's engine has a queue for "
            "flagos:0 only. Train on flagos:0 (flagos.device(0)); to train on another device "
            "of the chip, make it the first one (CUDA_VISIBLE_DEVICES and the like, "
            "FLAGOS_SIM_DEVICES on sim). Forward passes and copies work on every flagos device.")


# ---- any Python error inside backward ---------------------------------------------
#
# runtime/_guard_errors.py files each error the device guard takes aside with its backward
# pass; the wrapper below gives each pass its list and raises what was filed.

_forget_tls = getattr(torch._C, "_remove_obj_from_tls", None)  # newer PyTorch only


def _install_engine_check() -> None:
    """Wrap the engine's entry (used by backward() and autograd.grad()) once: an error the device
    guard kept reaches the caller as itself, the engine's assert on a missing queue as a
    NoEngineQueueError."""
    run = torch.autograd.graph._engine_run_backward
    if getattr(run, "_flagos_checked", False):
        torch.autograd._engine_run_backward = run  # put back by whoever replaced it last
        return

    @functools.wraps(run)
    def run_backward(*args, **kwargs):
        _engine_exit.note_pass()
        kept: list[BaseException] = []
        outer = torch._C._get_obj_in_tls(KEPT) if torch._C._is_key_in_tls(KEPT) else None
        torch._C._stash_obj_in_tls(KEPT, kept)
        try:
            return run(*args, **kwargs)
        except SystemError:
            if not kept:
                raise
        except RuntimeError as e:
            if isinstance(e, (NoEngineQueueError, AcceleratorBackwardError)):
                raise
            if ENGINE_QUEUE in str(e):
                raise NoEngineQueueError(engine_queue_message()) from None
            if STREAM_ASSERT in str(e) and _state.active_or_none() is not None:
                raise AcceleratorBackwardError(ACCELERATOR_BACKWARD) from e
            raise
        finally:
            if outer is not None or _forget_tls is None:
                torch._C._stash_obj_in_tls(KEPT, outer)  # outer: a backward inside a hook
            else:
                _forget_tls(KEPT)
        error = kept[0]
        kept.clear()  # the engine's copy of the TLS may outlive the pass
        _C.raise_kept(error)  # a `raise` would set its __context__ to what the caller handles

    run_backward._flagos_checked = True
    # Both names: backward() and grad() call torch.autograd's, and code that patches the entry
    # for a while (torch.compiler's tracing) saves torch.autograd.graph's and puts it back in both.
    torch.autograd.graph._engine_run_backward = run_backward
    torch.autograd._engine_run_backward = run_backward

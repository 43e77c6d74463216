"""Errors inside `backward()`: raised by `backward()` in the caller's thread, never an abort.

PyTorch runs the backward ops of a PrivateUse1 device on an engine thread of its own. An
exception leaving `__torch_dispatch__` there unwinds through the engine's stream guard, whose
`noexcept` `exchangeStream` calls the Python device guard while the error is still pending, and
the process ends in `std::terminate` (docs/design.md, "Errors inside backward"). So an op that
fails inside the autograd engine does not raise: its error is kept, the op hands back zero
placeholders of the shapes it would have produced, every later op of that backward pass is
skipped the same way, and a final callback of the pass raises the kept error, which then leaves
`backward()` like any other exception. Gradients of a failed pass are unspecified (partial sums,
or zeros where a leaf had none): zero them before the next step.
"""
from __future__ import annotations

import functools
import threading
import traceback

import torch

from . import _C, _schema, errors

_lock = threading.Lock()
_failed: dict[int, BaseException] = {}  # graph task id -> its first error
_local = threading.local()              # .busy: placeholders being made, route normally
_STALE_AFTER = 64                       # backward passes after which an entry is stale


def install() -> None:
    _C.set_backward_hooks(on_error, skip)
    _C.set_failed_tasks(len(_failed))
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


def engine_queue_message() -> str:
    from . import _runtime
    state = _runtime.active_or_none()
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


def _install_engine_check() -> None:
    """Wrap the engine's entry (used by backward() and autograd.grad()) once, so its assert
    on a missing queue reaches the caller as a NoEngineQueueError."""
    run = torch.autograd._engine_run_backward
    if getattr(run, "_flagos_checked", False):
        return

    @functools.wraps(run)
    def run_backward(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except RuntimeError as e:
            if ENGINE_QUEUE not in str(e) or isinstance(e, NoEngineQueueError):
                raise
            raise NoEngineQueueError(engine_queue_message()) from None

    run_backward._flagos_checked = True
    torch.autograd._engine_run_backward = run_backward


def on_error(func, args, kwargs, exc):
    """An op failed: None outside a backward pass (raise as usual), else placeholders."""
    if getattr(_local, "busy", False):
        return None
    task = torch._C._current_graph_task_id()
    if task == -1:
        return None
    with _lock:
        # A pass that failed again elsewhere (an engine check) never ran its callback: forget
        # such entries once later passes have run, so the per-op check switches off again.
        for old in [t for t in _failed if t < task - _STALE_AFTER]:
            del _failed[old]
        first = task not in _failed
        if first:
            # The failed frames' locals hold the op's tensors: let them go now, keep the lines.
            traceback.clear_frames(exc.__traceback__)
            _failed[task] = exc
            _C.set_failed_tasks(len(_failed))
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _raise(task))
    return _placeholders(func, args, kwargs or {})


def skip(func, args, kwargs):
    """Placeholders for an op of a backward pass that already failed, else None (run it)."""
    if getattr(_local, "busy", False) or torch._C._current_graph_task_id() not in _failed:
        return None
    return _placeholders(func, args, kwargs or {})


def _raise(task: int) -> None:
    with _lock:
        exc = _failed.pop(task, None)
        _C.set_failed_tasks(len(_failed))
    if exc is not None:
        raise exc


def _placeholders(func, args, kwargs):
    """What the op would return, filled with zeros; written arguments come back untouched.
    Must not raise: an exception here would abort the process like the one it replaces."""
    try:
        _local.busy = True
        return _make_placeholders(func, args, kwargs)
    except Exception:  # noqa: BLE001 - see docstring
        return _by_schema(func, args, kwargs)
    finally:
        _local.busy = False


_ZERO = {"bool": False, "int": 0, "SymInt": 0, "float": 0.0, "complex": 0j}


def _by_schema(func, args, kwargs):
    """Placeholders from the schema's return types when the op has no meta kernel: zeros of
    the Python type for scalars (item() and friends), the first tensor argument for tensors
    (the engine's own shape checks report a mismatch)."""
    outs = []
    for ret in func._schema.returns:
        kind = str(ret.type)
        if kind == "Scalar":
            tensor = _first_tensor(args, kwargs)
            outs.append(0j if tensor.is_complex() else 0.0 if tensor.is_floating_point() else 0)
        elif kind in _ZERO:
            outs.append(_ZERO[kind])
        else:
            outs.append(_first_tensor(args, kwargs))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _make_placeholders(func, args, kwargs):
    _, _, _, return_alias, _ = _schema.describe(func)
    device = _first_device(args, kwargs)
    meta_args, meta_kwargs = torch.utils._pytree.tree_map(_to_meta, (args, kwargs))
    meta_out = func(*meta_args, **meta_kwargs)
    outs = meta_out if isinstance(meta_out, (tuple, list)) else (meta_out,)
    result = []
    for i, m in enumerate(outs):
        alias = return_alias[i] if i < len(return_alias) else -1
        if alias >= 0:
            result.append(args[alias] if alias < len(args)
                          else kwargs[func._schema.arguments[alias].name])
        elif isinstance(m, torch.Tensor):
            result.append(_zeros(m, device))
        else:
            result.append(m)
    if isinstance(meta_out, (tuple, list)):
        return type(meta_out)(result)
    return result[0]


def _zeros(meta: torch.Tensor, device) -> torch.Tensor:
    try:
        return torch.zeros(meta.shape, dtype=meta.dtype, device=device)
    except Exception:  # noqa: BLE001 - out of memory: one element, broadcast
        return torch.zeros((), dtype=meta.dtype, device=device).expand(meta.shape)


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, torch.device) and v.type == "flagos":
        return torch.device("meta")
    return v


def _tensors(args, kwargs):
    return [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]


def _first_device(args, kwargs):
    for v in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(v, torch.device) and v.type == "flagos":
            return v
    for t in _tensors(args, kwargs):
        if t.device.type == "flagos":
            return t.device
    return torch.device("flagos", 0)


def _first_tensor(args, kwargs):
    tensors = _tensors(args, kwargs)
    return tensors[0] if tensors else torch.zeros(())

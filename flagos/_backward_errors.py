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

import threading
import traceback

import torch

from . import _C, _schema

_lock = threading.Lock()
_failed: dict[int, BaseException] = {}  # graph task id -> its first error
_local = threading.local()              # .busy: placeholders being made, route normally
_STALE_AFTER = 64                       # backward passes after which an entry is stale


def install() -> None:
    _C.set_backward_hooks(on_error, skip)
    _C.set_failed_tasks(len(_failed))


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

"""What torch.compile's tracers ask of a flagos tensor (its `__tensor_flatten__`, its cache key,
its printout while traced), and the refusals for tensors they cannot trace.

Dynamo makes a fake copy of every flagos input (`__tensor_unflatten__` over a fake payload)
before it traces anything, so that is where a compilation first meets flagos: it runs the hook
integrations/_compile.py installs at activation (registering the flagos device with Inductor). A C-ABI chip's tensors hold adapter buffers and cannot be traced.
"""
from __future__ import annotations

import hashlib
import sys
import warnings

import torch

from ..core import _state

_on_first_trace = None   # set by integrations/_compile.py on torch-native chips
_warned = False          # the eager-only message was given (once per process)
_skipping = False        # Dynamo runs flagos's own frames as they are


def on_first_trace(hook) -> None:
    """Run `hook()` when a compilation meets a flagos tensor (it may be called again; the hook
    makes its own work happen once)."""
    global _on_first_trace
    _on_first_trace = hook


def flatten(tensor):
    """`__tensor_flatten__` of a flagos tensor whose payload is not a plain tensor (that case
    answers in `FlagosTensor.__tensor_flatten__` itself, the one Dynamo's guards meet on every
    compiled call): its one inner tensor is the payload. A fake or functional payload means a
    compilation is tracing; an adapter buffer cannot be traced."""
    payload = tensor._payload
    if "torch._dynamo" not in sys.modules:
        return ["_payload"], None
    if not compiling():
        # A library, not a compilation, asks for the inner tensors (huggingface_hub's storage
        # ids when saving): nothing of Inductor to register for it, which costs seconds.
        if not isinstance(payload, torch.Tensor):
            refuse_host_storage()
        return ["_payload"], None
    if not isinstance(payload, torch.Tensor):
        refuse_trace()
    _meet_compilation()
    return ["_payload"], None


def unflattened(payload) -> None:
    """`__tensor_unflatten__` was handed a payload that is not a plain tensor. Dynamo makes
    the fake copy of every flagos input this way before it traces anything, so this is where
    a compilation first meets flagos (the guards' `__tensor_flatten__` calls, on real
    tensors, stay a type check)."""
    if "torch._dynamo" in sys.modules and compiling():
        _meet_compilation()


def compiling() -> bool:
    """Whether a compiler traces now. Dynamo's tracing context is there from the first fake copy
    of an input on; `is_compiling()` alone answers False there on PyTorch 2.11."""
    return torch._guards.TracingContext.try_get() is not None or torch.compiler.is_compiling()


def _meet_compilation() -> None:
    """A compilation traces flagos tensors: Dynamo must skip flagos's own frames, Inductor
    must know the flagos device (the hook), and the compilation is marked: its graphs are
    graphs over flagos tensors (the wrapper code reads the mark)."""
    skip_flagos_frames()
    if _on_first_trace is not None:
        _on_first_trace()
    context = torch._guards.TracingContext.try_get()
    if context is not None:
        context.flagos_graph = True


def cache_key(tensor) -> str:
    """`_stable_hash_for_caching` of a flagos tensor: all that AOTAutograd's on-disk cache
    knows of a flagos input, so everything a compiled graph depends on. Inductor's code checks
    the sizes and strides it was generated for (`assert_size_stride`); a key without them hands
    one model's graph to another model's tensors in any process that shares the cache
    directory. The key holds the chip, the flagos tensor's own metadata, and the payload's
    metadata as Inductor keys a plain tensor (`extract_tensor_metadata_for_cache_key`)."""
    # Inductor costs seconds to import; only a compilation, which has imported it, gets here.
    from torch._inductor.codecache import extract_tensor_metadata_for_cache_key
    state = _state.active_or_none()
    payload = tensor._payload
    fields = (
        state.chip.name if state else None,
        str(tensor.device), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
        tensor.requires_grad,
        # Symbolic sizes print as their symbols (s0), as Inductor's own key writes them.
        extract_tensor_metadata_for_cache_key(payload) if isinstance(payload, torch.Tensor) else None,
    )
    return hashlib.blake2b(repr(fields).encode(), digest_size=16).hexdigest()


def traced_contents(tensor) -> str | None:
    """What `repr` shows in place of the values of a flagos tensor that torch.compile is
    tracing (its payload a FakeTensor or a meta tensor: no data), as a FakeTensor shows itself:
    `tensor(..., size=(16, 8), device='flagos:0')`. None for a tensor with data. Formatting
    values runs ops on the payload, and a fake payload refuses `masked_select` (its output
    size depends on the data): whatever prints a traced tensor during a compilation (the
    aot_graphs and dynamo logs print AOTAutograd's metadata, which holds them) would fail it
    with DynamicOutputShapeException, which Dynamo turns into a graph break."""
    payload = tensor._payload
    if isinstance(payload, torch.Tensor) and (
            payload.is_meta or torch._subclasses.fake_tensor.is_fake(payload)):
        return f"..., size={tuple(tensor.shape)}"
    return None


def refuse_trace() -> None:
    """A C-ABI chip's tensor met Dynamo: one warning, then Dynamo runs the frame eagerly."""
    global _warned
    from torch._dynamo.exc import Unsupported  # a compilation has imported Dynamo already

    skip_flagos_frames()
    state = _state.active_or_none()
    chip = state.chip.name if state else "?"
    reason = (f"torch.compile cannot trace tensors on chip '{chip}': it is a C-ABI adapter "
              f"chip, whose flagos tensors hold adapter buffers rather than torch tensors, and "
              f"Dynamo and Inductor compile torch tensors only")
    if not _warned:
        _warned = True
        warnings.warn(f"{reason}. Compiled functions run eagerly on '{chip}' instead (every op "
                      f"routed and counted as usual); call them uncompiled to skip the attempt.",
                      UserWarning, stacklevel=2)
    raise Unsupported(reason)


def refuse_host_storage() -> None:
    """A library, not a compilation, asked a C-ABI chip's tensor for its inner tensors
    (`__tensor_flatten__`); it has none."""
    state = _state.active_or_none()
    chip = state.chip.name if state else "?"
    raise RuntimeError(
        f"flagos tensors on chip '{chip}' hold adapter buffers, not torch tensors, so they have no "
        f"inner tensor to hand to __tensor_flatten__ outside torch.compile. Ask the tensor itself: "
        f"untyped_storage() and data_ptr() name its buffer (to find tensors that share memory), "
        f"and tensor.cpu() copies its values to the host. Tracers that make fake copies of "
        f"tensors (torch.export, make_fx, FakeTensorMode) trace torch tensors only: trace the "
        f"model on the CPU (model.cpu()) or on a torch-native chip.")


def skip_flagos_frames(trace_rules=None) -> None:
    """flagos's own Python code (route resolution, metadata updates, adapter marshalling, the
    torch.accelerator functions it serves) runs inside ops: Dynamo must run it as it is, never
    trace it as frames of a model. In device mode this runs as soon as Dynamo's trace rules are
    imported (integrations/_libraries.py), also for a compilation over host tensors only:
    Dynamo's guards ask `torch.accelerator` for the current stream, which is flagos's Python, and
    traced as a frame of the model that frame's own guard asked again, without end."""
    global _skipping
    if not _skipping:
        (trace_rules or torch._dynamo.trace_rules).add("flagos")
        _skipping = True


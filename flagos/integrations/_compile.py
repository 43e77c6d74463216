"""torch.compile on the flagos device.

On a torch-native chip a compiled graph runs the chip's own generated code. AOTAutograd sees
through `FlagosTensor` (`__tensor_flatten__`) to the payloads, so most of a graph is a graph on
the payload device already. What is left on the `flagos` device are the tensors a graph makes
itself (`torch.arange(n, device=x.device)`, masks): the router moves them to the payload device
where they meet flagos tensors (`csrc/router.c`, `traced_flagos_index`), and Inductor compiles
the `flagos` device with the payload device's own code generator: its buffers are payload
memory, and a graph output on `flagos` leaves the graph as a `FlagosTensor`.

A C-ABI chip (sim) has adapter buffers as payloads, which Dynamo cannot trace: `torch.compile`
says so once, and the functions it would compile run eagerly, through the router as always.

Compiled graphs bypass the router, so their ops are not in the report's table: the report
counts the calls of compiled graphs instead (`compiled_calls()`) and says so.

Dynamo's per-call guards on flagos inputs are those of the input and its payload: the two
Python guards it adds for any tensor subclass (whose answers are constant for a flagos tensor)
are dropped (`_light_guards`), and so are a flagos parameter's no-aliasing guard (as for an
`nn.Parameter`) and a payload's dimension-mark guard (`_trim_tensor_match`).

Inductor's on-disk cache is the chip's own folder (integrations/_caches.py) unless the user
chose one; the keys below keep graphs apart inside a folder, and in one a user shares.

Activation only registers two allocation kernels and a hook on `torch.flagos`; Dynamo and
Inductor learn about flagos when a compilation first meets it (importing them costs seconds).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading

import torch

from .. import _C
from ..core import _state
from ..runtime import _tracing
from ..runtime._tensor import FlagosTensor, wrap

_registration_lock = threading.RLock()
_ready = False        # Dynamo and Inductor know the flagos device


# ---- the report's counter ----------------------------------------------------

def compiled_calls() -> int:
    """Calls of compiled graphs over flagos tensors since activation or `reset_report()`."""
    return _C.compiled_calls()


def reset_compiled_calls() -> None:
    _C.compiled_calls(True)


# Run by each compiled flagos graph (its generated code calls it): a C counter, no Python frame.
count_call = _C.count_compiled_call


# ---- where torch.compile meets flagos ----------------------------------------------

def install(device_module) -> None:
    """At activation on a torch-native chip, in device mode (cheap: nothing of Dynamo or
    Inductor is imported here)."""
    _register_factories()
    _hook_device_module(device_module)
    _tracing.on_first_trace(_register_inductor)


def _hook_device_module(device_module) -> None:
    """Inductor asks the device module of a renamed PrivateUse1 for its code generators
    (`torch.utils.backend_registration._get_custom_mod_func("Scheduling")`) the first time it
    compiles anything: the moment to register flagos's backend for a graph with no flagos
    input (`torch.ones(3, device="flagos")`). The answer itself is "none": the backend is
    registered directly, with the graph pass that PyTorch's path would drop."""
    previous = device_module.__dict__.get("__getattr__")

    def module_getattr(name):
        if name == "Scheduling":
            _register_inductor()
        if previous is not None:
            return previous(name)
        raise AttributeError(f"module 'torch.flagos' has no attribute {name!r}")

    device_module.__getattr__ = module_getattr


_factory_lib = None  # keeps the registrations below alive


def _register_factories() -> None:
    """`torch.tensor(data, device=x.device)` in a traced function allocates with the Python
    key excluded, so it reaches the flagos key with PyTorch's Python dispatcher on. That
    dispatcher serves only per-op Python kernels (a boxed fallback fails an internal
    assert there): give the allocation ops their own kernels, the same router entry as
    the fallback."""
    global _factory_lib
    if _factory_lib is not None:
        return
    _factory_lib = torch.library.Library("aten", "IMPL")
    for name, op in (("empty.memory_format", torch.ops.aten.empty.memory_format),
                     ("empty_strided", torch.ops.aten.empty_strided.default)):
        _factory_lib.impl(name, functools.partial(_C.dispatch_factory, op), "PrivateUse1")


# ---- Inductor: the flagos device compiled by the payload device's codegen ------

def _pass_id(payload_type: str) -> str:
    """Changes with this file, with the tracing side (runtime/_tracing.py marks the graphs
    over flagos tensors) and with the payload device, so Inductor's on-disk cache never hands
    back wrapper code that another version of flagos generated, or code generated for another
    chip's payloads."""
    digest = hashlib.sha256()
    for path in (__file__, _tracing.__file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"flagos-compile-{digest.hexdigest()[:16]}-{payload_type}"


def _register_inductor() -> None:
    global _ready
    with _registration_lock:
        if _ready:  # also true while registering: Inductor's own registration asks again
            return
        _ready = True
        chip = _state.active().chip
        try:
            _light_guards()
            _register_inductor_for("cpu" if chip.payload_is_host else chip.torch_type)
        except BaseException:
            _ready = False
            raise


def _register_inductor_for(payload_type: str) -> None:
    from torch._dynamo import device_interface
    from torch._inductor.codegen import common
    from torch._inductor.custom_graph_pass import CustomGraphModulePass

    class ToPayloadDevice(CustomGraphModulePass):
        """Inductor's pass for graphs that hold `flagos` tensors: they become tensors of the
        payload device, compiled by its own code generator. Inductor's code generators test
        for their device by name ("cpu") in many places, so a `flagos` device that only
        borrowed one would take wrong branches.

        Its uuid is part of the key of every graph Inductor caches while flagos is
        registered: it names flagos's code and payload device, and says whether the graph
        being keyed is one over flagos tensors, whose wrapper code counts its calls. After
        AOTAutograd a graph over flagos tensors is a graph over their payloads, identical to
        a plain graph on the payload device; without that mark either would be handed the
        other's code."""

        def __init__(self, then=None):
            self.then = then  # a pass registered for the payload device before flagos's

        def __call__(self, gm):
            _to_payload_device(gm)
            if self.then is not None:
                self.then(gm)

        def uuid(self):
            context = torch._guards.TracingContext.try_get()
            over_flagos = bool(getattr(context, "flagos_graph", False))
            own = pass_id + ("-graph-over-flagos" if over_flagos else "")
            return own if self.then is None else (own, self.then.uuid())

    pass_id = _pass_id(payload_type)
    common.init_backend_registration()
    payload = common.device_codegens.get(payload_type)
    if payload is None:
        return  # Inductor has no backend for this chip: compiling fails as it does natively
    wrapper = _wrapper_class(payload.wrapper_codegen)
    common.register_backend_for_device("flagos", payload.scheduling, wrapper,
                                       payload.cpp_wrapper_codegen, payload.fx_wrapper_codegen,
                                       device_custom_pass=ToPayloadDevice())
    # After the pass every graph is a payload-device graph: that device's wrapper wraps
    # `flagos` outputs and counts calls of graphs over flagos tensors (nothing else changes).
    common.device_codegens[payload_type] = dataclasses.replace(payload, wrapper_codegen=wrapper)
    # Inductor runs a device's pass only on graphs with an input or output on that device. A
    # graph over flagos tensors whose own `flagos` tensors all meet payloads inside it (Llama's
    # positions and masks, in forward and backward) has neither: the payload device runs the
    # pass too (on graphs with nothing on `flagos` it changes nothing).
    common.custom_backend_passes[payload_type] = ToPayloadDevice(
        then=common.custom_backend_passes.get(payload_type))
    common.register_device_op_overrides("flagos", common.get_device_op_overrides(payload_type))
    device_interface.register_interface_for_device(
        "flagos", device_interface.get_interface_for_device(payload_type))


# ---- Dynamo: guards that hold for every flagos tensor are not checked per call ----

def _light_guards() -> None:
    """Dynamo guards a traceable tensor subclass with two Python checks on every call of a
    compiled function, for each subclass input (a module's parameters included): that
    `__tensor_flatten__()` still names the same inner tensors and returns the same metadata.
    Called from C++ once per input and per check, they cost ~1 µs each, ~90 µs a call for
    tiny BERT's 45 flagos inputs (docs/design.md §15). For a flagos tensor whose
    payload is a torch tensor the answer is a constant (`["_payload"], None`); the guards
    that stay (the input's type, its own TENSOR_MATCH, and the TENSOR_MATCH of its payload,
    which an adapter buffer fails) cover everything else, as PyTorch does for DTensor.
    Other subclasses keep every guard.

    The tensor guards that stay are trimmed to what native inputs get (`_trim_tensor_match`)."""
    # A compilation is under way and has imported Dynamo (this runs at its first trace).
    from torch._dynamo import config, guards
    from torch._dynamo.source import AttrSource, SubclassAttrListSource

    builder = guards.GuardBuilder
    if getattr(builder, "_flagos_light_guards", False):
        return
    metadata_match = getattr(builder, "TENSOR_SUBCLASS_METADATA_MATCH", None)
    equals_match = getattr(builder, "EQUALS_MATCH", None)
    if metadata_match is None or equals_match is None:
        return  # another PyTorch: its guards as they are

    @functools.wraps(metadata_match)
    def tensor_subclass_metadata_match(self, guard):
        if type(self.get(guard)) is FlagosTensor:
            return
        return metadata_match(self, guard)

    @functools.wraps(equals_match)
    def equals(self, guard, *args, **kwargs):
        source = guard.originating_source
        if type(source) is SubclassAttrListSource and type(self.get(source.base)) is FlagosTensor:
            return
        return equals_match(self, guard, *args, **kwargs)

    builder.TENSOR_SUBCLASS_METADATA_MATCH = tensor_subclass_metadata_match
    builder.EQUALS_MATCH = equals
    tensor_match = getattr(builder, "TENSOR_MATCH", None)
    if tensor_match is not None:
        builder.TENSOR_MATCH = _trim_tensor_match(tensor_match, config, AttrSource)
    builder._flagos_light_guards = True


class _NoDimensionMarks:
    """A guard manager that takes every guard but the dimension-marking one."""

    def __init__(self, manager):
        self.manager = manager

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def add_dimension_marking_guard(self, *args, **kwargs):
        pass


def _trim_tensor_match(tensor_match, config, attr_source):
    """TENSOR_MATCH of a flagos input and of its payload, less two per-call checks that a
    native input does not pay (`docs/design.md` §15):

    - a flagos parameter (`_is_param`, what `type(param)` is FlagosTensor means) and its payload
      leave the no-aliasing check, as Dynamo leaves an `nn.Parameter` out of it
      (`config.skip_no_tensor_aliasing_guards_on_parameters`; with it off, they stay). A flagos
      input that is not a parameter keeps both: its payload is what says two inputs share memory.
    - the payload drops its guard on `mark_dynamic`-style marks (five `hasattr` per input and
      call). The payload is flagos's own: marks go on the flagos tensor, whose guard stays, and
      nothing marks a payload.

    The payload keeps its TENSOR_MATCH (type, dtype, device, sizes, strides: an adapter buffer or
    a payload of another shape fails it)."""

    @functools.wraps(tensor_match)
    def trimmed(self, guard, value=None):
        source = guard.originating_source
        of_payload = (type(source) is attr_source and source.member == "_payload"
                      and type(self.get(source.base)) is FlagosTensor)
        owner = self.get(source.base) if of_payload else (value if value is not None else self.get(guard))
        if type(owner) is not FlagosTensor:
            return tensor_match(self, guard, value)
        aliasing = len(self.no_tensor_aliasing_names)
        real_manager = self.get_guard_manager
        if of_payload:
            self.get_guard_manager = lambda g: _NoDimensionMarks(real_manager(g))
        try:
            tensor_match(self, guard, value)
        finally:
            if of_payload:
                del self.get_guard_manager  # the class's method again
        managers = self.no_tensor_aliasing_guard_managers
        if getattr(owner, "_is_param", False) and config.skip_no_tensor_aliasing_guards_on_parameters:
            del self.no_tensor_aliasing_names[aliasing:]
            del managers[aliasing:]
        else:
            managers[aliasing:] = [getattr(m, "manager", m) for m in managers[aliasing:]]

    return trimmed


def _to_payload_device(gm) -> None:
    """Move every `flagos` tensor of a graph to its payload device; remember which outputs
    were on `flagos` (they leave the graph as flagos tensors). The copies that took tensors
    from `flagos` to the payload device (the router's, where a made tensor meets a payload)
    are copies to the same device now: Inductor's own no-op pass, which ran before this one,
    removes them, so the graph is the one plain PyTorch compiles on the payload device (a
    `device_put` left in place is a DeviceCopy, whose fusion Inductor's CPU code generator
    fails on in Llama's forward and backward: `assert not index.is_vec`)."""
    # Inductor's passes are imported only by a compilation, which has imported them already.
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    moved = False

    def move(v):
        nonlocal moved
        if isinstance(v, torch.device) and v.type == "flagos":
            moved = True
            return payload_device(v.index or 0)
        return v

    flagos_values = {}
    for node in gm.graph.nodes:
        node.args, node.kwargs = torch.utils._pytree.tree_map(move, (node.args, node.kwargs))
        for val in torch.utils._pytree.tree_leaves(node.meta.get("val")):
            if isinstance(val, torch._subclasses.FakeTensor) and val.device.type == "flagos":
                index = val.device.index or 0
                flagos_values[id(val)] = index
                val.fake_device = payload_device(index)
        if node.op == "output" and flagos_values:
            outs = torch.utils._pytree.tree_leaves(node.args)
            gm.meta["flagos_outputs"] = {
                i: flagos_values[id(o.meta.get("val"))] for i, o in enumerate(outs)
                if isinstance(o, torch.fx.Node) and id(o.meta.get("val")) in flagos_values}
    if moved or flagos_values:  # a graph with nothing on flagos stays as it is
        remove_noop_ops(gm.graph)
        gm.recompile()


def _graph_over_flagos() -> bool:
    """Whether the graph being compiled is one over flagos tensors (see runtime/_tracing.py's `flatten`)."""
    from torch._inductor.virtualized import V

    context = torch._guards.TracingContext.try_get()
    return bool(getattr(context, "flagos_graph", False) or _flagos_outputs(V.graph))


def _flagos_outputs(graph) -> dict:
    """Output position -> flagos index, for outputs that `_to_payload_device` moved."""
    return getattr(graph.module, "meta", {}).get("flagos_outputs", {})


def _wrapper_class(base):
    """The payload device's host-side wrapper codegen; in graphs over flagos tensors, outputs
    that were on `flagos` leave the graph as flagos tensors, and each call is counted."""

    class FlagosWrapperCodegen(base):
        @staticmethod
        def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
            if is_subgraph:
                return base.create(True, subgraph_name, parent_wrapper, partition_signatures)
            return FlagosWrapperCodegen()

        def write_header(self) -> None:
            super().write_header()
            self.flagos_graph = _graph_over_flagos()
            if self.flagos_graph:
                self.header.writeline("from flagos.integrations._compile import count_call as flagos_count_call")
                self.header.writeline("from flagos.integrations._compile import wrap_output as flagos_wrap")

        def generate_return(self, output_refs: list[str]) -> None:
            if not getattr(self, "flagos_graph", False):
                return super().generate_return(output_refs)
            from torch._inductor.virtualized import V
            flagos_outputs = _flagos_outputs(V.graph)
            refs = [f"flagos_wrap({ref}, {flagos_outputs[i]})" if i in flagos_outputs else ref
                    for i, ref in enumerate(output_refs)]
            self.wrapper_call.writeline("flagos_count_call()")
            return super().generate_return(refs)

    return FlagosWrapperCodegen


def payload_device(index: int) -> torch.device:
    return payload_device_of(_state.active().chip, index)


def payload_device_of(chip, index: int) -> torch.device:
    """The device the payloads of `flagos:index` report, where a traced graph moves the tensors
    it makes on `flagos`. A CPU tensor reports `cpu` whatever index it was made for, but a fake
    one keeps `cpu:0` and refuses to meet a `cpu` one (docs/design.md §15, repro 4): a host
    chip's payloads are made and moved to `cpu`, no index."""
    return torch.device("cpu") if chip.payload_is_host else chip.torch_device(index)


def wrap_output(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """A graph output that Inductor made for `flagos:index` (payload memory), as a flagos tensor."""
    return wrap(tensor, index)

"""FlagosTensor: what a tensor on the flagos device is.

A traceable wrapper subclass: its device is `flagos:N`, it owns no memory, and
its `_payload` is the chip's own tensor (a CPU tensor on the cpu chip, a CUDA
tensor on the cuda chip). `__torch_dispatch__` is the C router, so every aten
op on it is routed, counted and rewrapped in C. Autograd, views and in-place
ops work at the wrapper level exactly as on any PyTorch device; torch.compile
sees through the wrapper with `__tensor_flatten__`.
"""
from __future__ import annotations

import copy
import copyreg
import sys
import weakref
from collections import OrderedDict

import torch
from torch.nn.parameter import UninitializedTensorMixin

from .. import _C
from . import _storage, _tracing, _user_subclasses

_META = torch.device("meta")

_BASE_DATA = torch._C.TensorBase.data
_BASE_COMPATIBLE = torch._has_compatible_shallow_copy_type
_PLAIN = torch.Tensor  # a real payload's exact type (a traced one is a subclass: fake, functional)
# PyTorch's describer of a tensor it is about to copy as a fake one (on a version without it,
# fake copies outside torch.compile fail as they did)
_DESCRIBER = getattr(torch._subclasses.meta_utils, "MetaTensorDescriber", None)
_DESCRIBE_TENSOR = _DESCRIBER.describe_tensor.__code__ if _DESCRIBER is not None else None
# PyTorch's refusal to export a tensor that requires grad (Tensor.__dlpack__), word for word
DLPACK_REQUIRES_GRAD = "Can't export tensors that require gradient, use tensor.detach()"


def _copy_sharing_memory(t: FlagosTensor, memo: dict) -> torch.Tensor:
    """t's deep copy as PyTorch makes it: its memory copied once per deepcopy call, so the
    copies of tensors that shared memory (views, tied weights' detached state-dict entries)
    share the copied memory, each with t's sizes, strides and offset."""
    if t.is_neg() or t.is_conj():
        return t.clone(memory_format=torch.preserve_format)  # bits the memory does not hold
    # (a view lies inside its storage, in its own dtype too: PyTorch checks that when it is made)
    storage = t.untyped_storage()
    item = t.element_size()
    whole = storage.nbytes() // item
    key = ("flagos memory", str(t.device), storage.data_ptr())  # deepcopy's memo takes any key
    copied = memo.get(key)
    if copied is None:
        copied = memo[key] = t.as_strided((whole,), (1,), 0).clone()
    elif copied.dtype != t.dtype:  # a view of the memory as another dtype (x.view(torch.int32))
        if storage.nbytes() % item:
            return t.clone(memory_format=torch.preserve_format)
        copied = copied.view(t.dtype)
    return copied.as_strided(t.shape, t.stride(), t.storage_offset()).detach()


class FlagosTensor(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl
    __torch_dispatch__ = classmethod(_C.dispatch)

    # -- parameters: a module's parameter on flagos is a FlagosTensor marked `_is_param` (PyTorch's
    # rule for tensor subclasses), so `type(param)` is FlagosTensor. Libraries rebuild parameters
    # with `type(param)(tensor, requires_grad=...)` (accelerate's set_module_tensor_to_device, its
    # offload hooks): that means nn.Parameter(tensor, requires_grad) here, as on every device.
    def __new__(cls, data=None, requires_grad=True):
        return torch.nn.Parameter(data, requires_grad)

    # -- `.data = other`: PyTorch swaps the TensorImpl's metadata but not the Python object's
    # payload, which would keep the old values under the new shape.
    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        if not isinstance(new, FlagosTensor):
            take_memory_of(self, new)  # PyTorch refuses set_data across flagos and other devices
            return
        take_payload_of(self, new)

    # -- a subclass of the program's own over a flagos tensor (runtime/_user_subclasses.py)
    def as_subclass(self, cls):
        if issubclass(FlagosTensor, cls):  # torch.Tensor, FlagosTensor: PyTorch's own answer
            return torch._C.TensorBase.as_subclass(self, cls)
        holder = cls if issubclass(cls, FlagosTensor) else _user_subclasses.holding_flagos(cls, FlagosTensor)
        alias = torch.ops.aten.alias.default(self)  # what PyTorch makes the object over
        alias.__class__ = holder
        return alias

    # -- host views of the values, as on every PyTorch device -------------
    def tolist(self):
        return torch.Tensor.cpu(self).tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                            f"Tensor.cpu() to copy the tensor to host memory first.")
        return torch.Tensor.cpu(self.detach()).numpy()

    # -- DLPack: what is exchanged is memory in place, and a flagos tensor's memory is its
    # payload's (a CUDA tensor's on the cuda chip, host memory on the cpu chip): other libraries
    # get the payload's capsule, on the payload's device. A C-ABI chip's memory is the adapter's,
    # which no other library can address. (torch.utils.dlpack.to_dlpack: integrations/_dlpack.py)
    def __dlpack__(self, **kwargs):
        if self.requires_grad:  # PyTorch's rule, which the payload (no autograd) cannot see
            raise BufferError(DLPACK_REQUIRES_GRAD)
        device = kwargs.get("dl_device")
        if (device is not None and device[0] == torch.utils.dlpack.DLDeviceType.kDLCPU
                and not isinstance(self._payload, torch.Tensor) and kwargs.get("copy") is not False):
            # a host copy asked for (torch.from_dlpack(t, device="cpu")): that copy is exported
            return torch.Tensor.cpu(self.detach()).__dlpack__(**{**kwargs, "copy": None})
        return self.dlpack_source().__dlpack__(**kwargs)

    def __dlpack_device__(self):
        payload = self._payload
        if isinstance(payload, torch.Tensor):
            return payload.__dlpack_device__()
        return torch.utils.dlpack.DLDeviceType.kDLExtDev, self.device.index

    def dlpack_source(self) -> torch.Tensor:
        """The tensor whose memory a DLPack capsule of this one shares: the payload."""
        payload = self._payload
        if not isinstance(payload, torch.Tensor):
            raise BufferError(
                f"{self.device} is a C-ABI chip's device: its memory belongs to the adapter, "
                f"which other libraries cannot address through DLPack. Export a host copy "
                f"(tensor.cpu()) instead.")
        return payload

    def __format__(self, spec):
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def untyped_storage(self):
        # The wrapper owns no memory; its payload's storage is the memory it views (a chip
        # storage with a valid data_ptr(), which safetensors, huggingface_hub and transformers
        # read to find tensors that share memory, e.g. tied weights).
        # While torch.compile traces, and whenever PyTorch describes the tensor to make a fake
        # copy of it (FakeTensorMode.from_tensor, make_fx, torch.export), the wrapper's own
        # storage is what its fake tensors describe: the payload's, which the payload's fake
        # copy has described already, would be taken for memory the two share.
        payload = self._payload
        if _tracing.compiling() or sys._getframe(1).f_code is _DESCRIBE_TENSOR:
            return torch.Tensor.untyped_storage(self)
        if isinstance(payload, torch.Tensor):
            return payload.untyped_storage()
        # An adapter buffer: a storage that names the buffer (data_ptr() its handle, nbytes() its
        # size), so every view of one buffer has the same storage and other buffers have others.
        # It holds no data, so it is a meta storage: reading through it raises PyTorch's meta
        # error. (A storage on the flagos device would crash on clone(): PyTorch has no allocator
        # for a PrivateUse1 device registered from Python.) Values are read through the tensor.
        return torch._C._construct_storage_from_data_pointer(payload.handle, _META, payload.nbytes)

    def share_memory_(self):
        # Chip memory is not host memory: moving it to shared memory is a no-op, as PyTorch makes
        # it for CUDA (only host memory uses POSIX shared memory). A C-ABI chip's stand-in storage
        # is a meta storage, which PyTorch would try to share as host memory and fail; a
        # torch-native chip's payload answers for itself (the cpu chip's is host memory).
        if not isinstance(self._payload, torch.Tensor):
            return self
        return torch.Tensor.share_memory_(self)

    def data_ptr(self) -> int:
        # PyTorch answers 0 for a wrapper that owns no memory; libraries that key tensors by
        # data_ptr() (accelerate's tied-weights map when it dispatches a model) would take every
        # flagos tensor for the same one. The address is the payload's (an adapter buffer's
        # handle on C-ABI chips), as a CUDA tensor's is its device address.
        payload = self._payload
        if _tracing.compiling():
            return torch.Tensor.data_ptr(self)
        if isinstance(payload, torch.Tensor):
            return payload.data_ptr()
        return payload.handle + self.storage_offset() * self.element_size()

    def __copy__(self):
        # copy.copy: PyTorch's reduce hands the storage itself to the rebuild, so the copy is a
        # new tensor over the same memory, with requires_grad, no history, the Python attributes
        # (a Parameter stays one); the inherited __reduce_ex__ would copy the values to the host.
        new = self.detach()
        for name, value in vars(self).items():
            if name != "_payload":
                setattr(new, name, value)
        return new.requires_grad_(self.requires_grad)

    def __deepcopy__(self, memo):
        # torch.Tensor.__deepcopy__ would deep-copy the payload object too (an adapter buffer
        # cannot be pickled, a chip tensor would be copied twice): copy the memory once instead.
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = _copy_sharing_memory(self, memo)
        new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for key, value in self.__dict__.items():
            if key != "_payload":
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    # -- torch.compile: one inner tensor, no extra metadata (runtime/_tracing.py) --
    def __tensor_flatten__(self):
        # Dynamo's guards call this twice per flagos input on every compiled call: a payload
        # that is a plain tensor answers at once (a traced one is fake: _tracing.flatten).
        if type(self._payload) is _PLAIN:
            return ["_payload"], None
        return _tracing.flatten(self)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        payload = inner_tensors["_payload"]
        if type(payload) is not _PLAIN:  # fake or functional: a compilation is tracing
            _tracing.unflattened(payload)
        return _C.wrap(payload)  # wrap(payload) without its frame: every compiled output

    def _stable_hash_for_caching(self) -> str:
        return _tracing.cache_key(self)

    # -- pickling: PyTorch's format for a device without storages (a host tensor and the
    # device to rebuild it on, which map_location maps), so a file loads without flagos too
    def __reduce_ex__(self, proto):
        if isinstance(self, torch.nn.Parameter):  # a Parameter loads as one, attributes and all
            state = {k: v for k, v in vars(self).items() if k not in ("_payload", "_is_param")}
            if state:
                return (torch._utils._rebuild_parameter_with_state,
                        (self.detach(), self.requires_grad, OrderedDict(), state))
            return torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, OrderedDict())
        host = None
        if not (self.is_neg() or self.is_conj() or _tracing.compiling()):
            host = _storage.host_view_for_save(self)  # one memory, written once per file
        if host is None:
            host = self.detach().cpu()
        rebuild = (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                   (host, self.dtype, str(self.device), self.requires_grad))
        user_class = _user_subclasses.user_class(type(self))
        if user_class is None:
            return rebuild
        # a subclass of the program's: PyTorch's record for one, its class and attributes kept
        state = {k: v for k, v in vars(self).items() if k != "_payload"}
        return torch._tensor._rebuild_from_type_v2, (rebuild[0], user_class, rebuild[1], state)

    def __repr__(self, *, tensor_contents=None):
        if tensor_contents is None:
            tensor_contents = _tracing.traced_contents(self)
        if tensor_contents is None:
            payload = self._payload
            if isinstance(payload, torch.Tensor):
                host = payload.detach().cpu()
            else:  # an adapter buffer: copy the view to the host through the router
                with torch.no_grad():
                    host = torch.Tensor.cpu(self)
            tensor_contents = torch._tensor_str._tensor_str(host, len("tensor("))
        text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        # Print like a tensor on any other device: tensor([...], device='flagos:0').
        prefix = type(self).__name__ + "("
        return "tensor(" + text[len(prefix):] if text.startswith(prefix) else text


_META_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)


def set_metadata(wrapper, size, stride, offset) -> None:
    """Give a flagos tensor new sizes/strides/offset in place. The wrapper owns no memory, so
    the meta kernel of as_strided_ (pure metadata) is the right tool."""
    torch.ops.aten.as_strided_.default.redispatch(_META_KEYS, wrapper, list(size), list(stride), offset)



def wrap(payload: torch.Tensor, index: int | None = None) -> FlagosTensor:
    """The flagos tensor whose payload is `payload` (no copy): on flagos:index, or on the flagos
    device of the payload's own device (flagos:0 for a host tensor). Made in C, as the router
    makes its outputs: every output of a compiled graph passes here."""
    return _C.wrap(payload, -1 if index is None else index)


def copy_math_bits(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst, given src's conjugate and negative bits (how to read the same bytes)."""
    if src.is_conj():
        torch._C._set_conj(dst, True)
    if src.is_neg():
        torch._C._set_neg(dst, True)
    return dst


def take_payload_of(target: FlagosTensor, new: FlagosTensor) -> None:
    """`target.data = new` for two flagos tensors, as on any one device: PyTorch's set_data gives
    target's TensorImpl new's sizes, strides, dtype and storage, and the impl keeps its Python
    object, its autograd state (version counter, grad, hooks) and its place in every graph that
    saved it. The payload belongs to the Python object, so it follows by hand."""
    _BASE_DATA.__set__(target, new)
    target._payload = new._payload


def exchange_in_place(t1: FlagosTensor, t2: FlagosTensor) -> bool:
    """torch.utils.swap_tensors(t1, t2) for two flagos leaves, done as `t1.data, t2.data =
    t2.data, t1.data` would be on CPU: the data (metadata and payload) is exchanged, and each
    object keeps its TensorImpl, with its autograd state (requires_grad, grad, hooks) and its
    attributes.

    module.to(dtype), .half() and .float() swap every parameter of a wrapper subclass, and a
    whole-object swap takes the parameter's TensorImpl out of the autograd graph that holds it
    (PyTorch then refuses the swap, or poisons the graph's AccumulateGrad node). Here the graph
    keeps the same impl, so backward reads the parameter as it is now and accumulates into its
    .grad, exactly as after `param.data = param.data.half()` on CPU. False (nothing done) where
    set_data cannot serve: a non-leaf, or wrappers whose dispatch keys differ (conj/neg bits)."""
    if t1.grad_fn is not None or t2.grad_fn is not None or not _BASE_COMPATIBLE(t1, t2):
        return False
    before = t1.detach()  # t1's metadata and payload, for t2
    take_payload_of(t1, t2)
    take_payload_of(t2, before)
    return True


def take_memory_of(target: torch.Tensor, new: torch.Tensor) -> None:
    """`target.data = new` where one of them is on flagos and the other is not.

    PyTorch's set_data accepts only pairs its shallow-copy list calls compatible (CPU, CUDA, MPS,
    HIP, XPU, HPU among themselves), never a PrivateUse1 tensor with another device. Swapping the
    whole tensor object does work (swap_keeping_graph): target becomes an alias of new's memory,
    keeping its identity (dicts keyed by the parameter, optimizer references), its
    requires_grad, its parameter-ness and its attributes, as `.data =` keeps them.
    """
    is_param = isinstance(target, torch.nn.Parameter)
    requires_grad = target.requires_grad
    grad = target._grad
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        # shares new's memory; the swap leaves `new` itself untouched. (Without new's own
        # __torch_function__: an uninitialized parameter's refuses detach.)
        alias = new.detach()
    if isinstance(alias, FlagosTensor):
        alias.requires_grad_(requires_grad)
        if is_param:
            alias._is_param = True
    elif is_param:  # back to a plain device: a real nn.Parameter again
        alias = torch.nn.Parameter(alias, requires_grad)
    else:
        alias.requires_grad_(requires_grad)
    if isinstance(new, UninitializedTensorMixin) and not isinstance(alias, FlagosTensor):
        alias.__class__ = type(new)  # a lazy module's parameter leaving flagos stays uninitialized
    for key, value in vars(target).items():
        if key not in ("_payload", "_is_param"):
            setattr(alias, key, value)
    if not swappable(target):
        raise RuntimeError(
            f"`tensor.data = other` from {target.device} to {new.device}: PyTorch refuses set_data "
            f"between flagos and another device, so flagos swaps the tensor object instead, and "
            f"a tensor with a weak reference cannot be swapped (torch.compile keeps one to the "
            f"parameters it compiled). Move the tensor before compiling, or move the module with "
            f"module.to(device), which makes new parameters where it cannot move them.")
    if grad is not None:
        target._grad = None  # the grad stays with the tensor object, not with the memory
    swap_keeping_graph(target, alias, hooks_stay=True)
    if grad is not None:
        with torch.no_grad():
            target._grad = grad.to(target.device)  # the gradient follows, as module.to() moves it


def swap_keeping_graph(t1: torch.Tensor, t2: torch.Tensor, hooks_stay: bool = False) -> None:
    """torch.utils.swap_tensors(t1, t2) for a flagos tensor and a host one, valid while an
    autograd graph holds t1.

    The two Python objects exchange their TensorImpls (PyTorch's set_data cannot move an impl
    between flagos and another device). A graph that saved t1 keeps t1's former impl, with the
    values it saved (a flagos one keeps its payload: the impl's Python object carries it), so
    backward computes what it would have computed; PyTorch's own swap_tensors refuses such a
    tensor, or poisons its AccumulateGrad node when only that node holds it. The gradient the
    graph accumulates into the former impl is handed on to t1's .grad (_GradientHandOver), on
    t1's device, as if the graph had held t1 itself.

    Tensor hooks go with the memory, as PyTorch's swap_tensors leaves them: t2 runs those
    registered on t1. With `hooks_stay` (`.data =`, which keeps the TensorImpl on one device),
    or when the hand-over runs them, t1 keeps its own.
    """
    for t, name in ((t1, "t1"), (t2, "t2")):
        if weakref.getweakrefs(t):
            raise RuntimeError(f"Cannot swap {name} because it has weakref associated with it")
    slots = set(copyreg._slotnames(t1.__class__))
    if slots != set(copyreg._slotnames(t2.__class__)):
        raise RuntimeError("Cannot swap t1 and t2 if they have different slots")
    held = t1.requires_grad and t1.grad_fn is None and t1._use_count() > 1

    def exchange(name):
        first = getattr(t1, name)
        setattr(t1, name, getattr(t2, name))
        setattr(t2, name, first)

    exchange("__class__")
    exchange("__dict__")
    for slot in slots:
        if hasattr(t1, slot) and hasattr(t2, slot):
            exchange(slot)
        elif hasattr(t1, slot):
            setattr(t2, slot, getattr(t1, slot))
            delattr(t1, slot)
        elif hasattr(t2, slot):
            setattr(t1, slot, getattr(t2, slot))
            delattr(t2, slot)
    torch._C._swap_tensor_impl(t1, t2)
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks") if hooks_stay or held else ():
        hooks = getattr(t1, name)  # the object's own; its new TensorImpl has none registered
        if hooks is not None:
            setattr(t1, name, hooks)  # registers them there, as `.data =` would have kept them
    if held:  # t2 is now the Python object of the impl the graph holds
        node = torch.autograd.graph.get_gradient_edge(t2).node
        node.register_hook(_GradientHandOver(former=t2, owner=t1))
        if t1._post_accumulate_grad_hooks is not None:
            t2._post_accumulate_grad_hooks = {}  # they run from the hand-over, on t1 itself


class _GradientHandOver:
    """Post hook of the AccumulateGrad node of a tensor's former TensorImpl: moves what autograd
    accumulated there into the tensor's own .grad, then runs the tensor's post-accumulate-grad
    hooks on the tensor itself (optimizers in backward key them by parameter). It holds the
    former impl's Python object, not the node (a node that held its own hook would never be
    freed), and the owner strongly: a weak reference to a parameter would stop its next move."""

    def __init__(self, former: torch.Tensor, owner: torch.Tensor):
        self.former = former
        self.owner = owner

    def __call__(self, grad_inputs, grad_outputs):
        grad = self.former._grad
        if grad is None:
            return
        owner = self.owner
        # An error here (a .grad of another shape set meanwhile) reaches backward()'s caller as
        # the same error AccumulateGrad raises on CPU; the process goes on.
        with torch.no_grad():
            grad = grad.to(device=owner.device, dtype=owner.dtype)
            if owner._grad is None:
                owner._grad = grad
            else:
                owner._grad.add_(grad)
        self.former._grad = None
        hooks = owner._post_accumulate_grad_hooks
        for hook in tuple(hooks.values()) if hooks else ():
            hook(owner)


def swappable(tensor: torch.Tensor) -> bool:
    """Whether the tensor object can exchange its TensorImpl with another (swap_keeping_graph):
    not while a weak reference points at it. An autograd graph that holds it is no obstacle."""
    return not weakref.getweakrefs(tensor)

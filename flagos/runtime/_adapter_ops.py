"""Running one aten op on a C-ABI chip (sim, vendor adapters).

The C router calls `Runner.__call__` for every op on such a chip, after its table lookup and
route resolution; counting, warnings and the report stay in C. A flagos tensor's payload is
an adapter `Buffer`; the wrapper's own sizes, strides and storage offset say which part of
the buffer it is, so views share buffers exactly as on a device.

Per op, in order:
- allocation, copies and views are metadata or adapter copies (never a fallback);
- an adapter kernel runs when the op is in its table and the arguments fit its convention
  (csrc/include/flagos/adapter.h); output shapes come from running the op on meta tensors;
- everything else takes the host round trip: the touched bytes of each buffer go to the
  host once, the op runs there, written arguments go back, new results are uploaded.

The router runs the common case of kernel-table ops and views (csrc/adapter_fast.c) and of the
host round trip (csrc/adapter_fallback.c) in C, from `c_fast`; this runner gets the rest.
"""
from __future__ import annotations

import time

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.dlpack import to_dlpack

from .. import _C
from ..core import _routes, _schema, _state
from ..errors import DeviceMismatchError
from . import _math_keys, _transfers
from ._iterator_layout import contiguous_strides, result_strides
from ._tensor import FlagosTensor, copy_math_bits, set_metadata

NATIVE, FALLBACK, WOULD_FALL_BACK = _C.ROUTE_NATIVE, _C.ROUTE_FALLBACK, _C.ROUTE_ERROR
OVERRIDE = _C.ROUTE_OVERRIDE

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3,
               torch.int64: 4, torch.int32: 5, torch.int16: 6, torch.int8: 7, torch.uint8: 8,
               torch.bool: 9}
CPU = torch.device("cpu")
META = torch.device("meta")
_DECOMPOSITION = torch._C.DispatchKey.CompositeImplicitAutograd


def _dense_order(size, stride):
    """The dims from outermost to innermost when (size, stride) is dense and non-overlapping
    (contiguous in some order of its dims, as channels_last is); None otherwise."""
    order = sorted(range(len(size)), key=lambda i: stride[i], reverse=True)
    expected = 1
    for i in reversed(order):
        if size[i] != 1:
            if stride[i] != expected:
                return None
            expected *= size[i]
    return order


def _permute(desc, order):
    buf, offset, code, size, stride = desc
    return buf, offset, code, tuple(size[i] for i in order), tuple(stride[i] for i in order)


def _span(size, stride, offset) -> tuple[int, int]:
    """[first, last + 1) element of the storage a strided view touches (empty: (offset, offset))."""
    if any(s == 0 for s in size):
        return offset, offset
    return offset, offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1


_PARTIAL_OVERLAP = ("unsupported operation: some elements of the input tensor and the written-to "
                    "tensor refer to a single memory location. Please clone() the tensor before "
                    "performing the operation.")
# A plain tensor on the flagos device holds no memory: PyTorch made it (a DLPack import of a
# capsule of a flagos tensor's wrapper); the C router says the same for every other op.
_NOT_MADE_BY_FLAGOS = ("a tensor on {} that flagos did not make: it has no memory. Export a flagos "
                       "tensor with torch.utils.dlpack.to_dlpack(t) or t.__dlpack__(), and make "
                       "flagos tensors with .to(flagos.device()).")


def _overlaps_in_part(a, b) -> bool:
    """PyTorch's memory-overlap rule (get_overlap_status(a, b) == Partial) for two tensors of
    one buffer: both dense and non-overlapping (otherwise PyTorch cannot tell and does not
    refuse), their byte ranges intersecting, and not the same bytes read in the same order."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if _dense_order(a.shape, a.stride()) is None or _dense_order(b.shape, b.stride()) is None:
        return False
    a0, b0 = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    if (a0, a1) == (b0, b1):
        return tuple(a.stride()) != tuple(b.stride())
    return a0 < b1 and b0 < a1


def _tag(fresh: torch.Tensor, t) -> torch.Tensor:
    """fresh (a new tensor over t's bytes, host, meta or flagos) given t's conjugate and
    negative bits, which say how to read those bytes (x.conj(), torch._neg_view(x))."""
    return copy_math_bits(t, fresh)


def _physical(host: torch.Tensor) -> torch.Tensor:
    """A host tensor whose memory holds its values: bits resolved, efficient zeros made real, a
    wrapper subclass's values in a plain tensor (an op run on the host may answer with one:
    the functional collectives' `_wrap_tensor_autograd` gives an AsyncCollectiveTensor, whose
    own memory is none)."""
    if type(host) is not torch.Tensor and is_traceable_wrapper_subclass(host):
        host = host.clone()  # through the subclass's own dispatch: a plain tensor
    if host._is_zerotensor():
        return torch.zeros(host.shape, dtype=host.dtype)
    if host.is_conj() or host.is_neg():
        return host.resolve_conj().resolve_neg()
    return host


def _strided_only(t: torch.Tensor, what: str) -> None:
    """Refuse a tensor a chip buffer cannot hold (sparse, mkldnn, quantized) with a message
    that says what to do."""
    if t.layout is torch._mkldnn:
        raise RuntimeError(f"{what}: mkldnn tensors are not supported on flagos; convert it "
                           f"with .to_dense() first")
    if t.layout is not torch.strided:
        raise RuntimeError(
            f"{what}: sparse tensors are not supported on flagos (this one is {t.layout}); "
            f"convert it with .to_dense() first, or keep the sparse work on the CPU")
    if t.is_quantized:
        raise RuntimeError(
            f"{what}: quantized tensors are not supported on a C-ABI chip (this one is "
            f"{t.dtype}); keep the quantized work on the CPU, or dequantize() it first")
    if t.is_meta:  # PyTorch's own words, which Module.to() completes with to_empty()
        raise NotImplementedError("Cannot copy out of meta tensor; no data!")


def _walk(value, fn):
    """Apply fn to every flagos tensor in an argument (lists and tuples one level deep)."""
    if isinstance(value, FlagosTensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)([_walk(v, fn) for v in value])  # a list: cheaper than a generator
    return value


def _collect(values, out: list, kind=FlagosTensor) -> list:
    """Append every `kind` in values (lists and tuples at any depth) to out, in order."""
    for v in values:
        if isinstance(v, kind):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            _collect(v, out, kind)
    return out


def _flagos_index(device: torch.device) -> int:
    """A flagos device's index; "flagos" without one is the current device (set_device)."""
    return _state.active().current if device.index is None else device.index


def _is_flagos_device(value) -> bool:
    return isinstance(value, torch.device) and value.type == "flagos"


def _host_scalar(value):
    """A Python number for a number or a 0-dim host tensor; None otherwise, and for a bool,
    whose rules are PyTorch's own (sub refuses one, the other ops promote it): the host's."""
    if isinstance(value, (int, float)) and not isinstance(value, (bool, torch.Tensor)):
        return float(value)
    if (isinstance(value, torch.Tensor) and not isinstance(value, FlagosTensor)
            and value.dim() == 0 and value.device.type == "cpu" and value.dtype != torch.bool):
        return float(value.item())
    return None


class _HostRegions:
    """Host copies of the device bytes one fallback call touches: one region per buffer,
    covering every view of it in the call, so host views of one buffer alias each other as
    they do on the device."""

    def __init__(self, tensors):
        spans = {}  # id(buffer) -> [buffer, first byte, end byte, largest item size]
        for t in tensors:
            key = id(t._payload)
            if t.numel() == 0:  # touches no byte (its offset may even lie past a 0-byte buffer)
                spans.setdefault(key, [t._payload, 0, 0, 1])
                continue
            item = t.element_size()
            lo, hi = _span(t.size(), t.stride(), t.storage_offset())
            b0, b1 = lo * item, hi * item
            span = spans.get(key)
            if span is None or span[2] <= span[1]:
                spans[key] = [t._payload, b0, b1, item]
            else:
                span[1], span[2], span[3] = min(span[1], b0), max(span[2], b1), max(span[3], item)
        # Views of one buffer in other dtypes: the region starts where every item size used
        # divides the offset (item sizes are powers of two, so the largest one does).
        self.regions = {key: (buf, b0 - b0 % item, b1) for key, (buf, b0, b1, item) in spans.items()}
        self.data = {}     # id(buffer) -> (host uint8 tensor, first byte)
        self.views = {}    # id(flagos tensor) -> its host view
        self.uploaded = set()
        self.staged = []   # staging buffers taken (_C.staging_take), handed back by release()

    def download(self, stage: bool) -> int:
        """Copy each region to the host: into a reused staging buffer when `stage` (every
        result is uploaded, so none can keep seeing it) and the region is large enough for
        fresh memory to cost page faults, else into a host tensor of its own."""
        moved = 0
        for key, (buf, b0, b1) in self.regions.items():
            n = max(b1 - b0, 0)
            if stage and n >= _C.STAGING_MIN_BYTES:
                flat = _C.staging_take(n)
                self.staged.append(flat)
                data = flat[:n]
            else:
                data = torch.empty(n, dtype=torch.uint8)
            if n:
                buf.read(to_dlpack(data), b0)
                moved += n
            self.data[key] = (data, b0)
        return moved

    def release(self) -> None:
        """Hand the staging buffers back; the pool keeps one only when nothing else sees its
        memory any more (a result that is a host view of it keeps it out of the pool)."""
        self.data.clear()
        self.views.clear()
        staged, self.staged = self.staged, []
        for flat in staged:
            _C.staging_give(flat)

    def view(self, t: FlagosTensor) -> torch.Tensor:
        data, b0 = self.data[id(t._payload)]
        item = t.element_size()
        usable = (data.numel() // item) * item
        flat = data[:usable].view(t.dtype) if usable else torch.empty(0, dtype=t.dtype)
        # offsets in bytes first: b0 is a multiple of every item size viewing this buffer
        offset = (t.storage_offset() * item - b0) // item if t.numel() else 0
        v = flat.as_strided(t.size(), t.stride(), offset)
        self.views[id(t)] = v
        return _tag(v, t)

    def upload(self, buf) -> int:
        """Write a buffer's region back (once per call); returns the bytes moved."""
        key = id(buf)
        if key in self.uploaded:
            return 0
        self.uploaded.add(key)
        _, b0, b1 = self.regions[key]
        if b1 <= b0:
            return 0
        buf.write(to_dlpack(self.data[key][0]), b0)
        return b1 - b0


class Runner:
    def __init__(self, chip, flagos_devices):
        self.chip = chip
        self.adapter = chip.adapter
        self.devices = flagos_devices
        self.kernels = {op: (i, mask) for i, (op, mask) in enumerate(self.adapter.kernels())}
        self.native = [self.adapter.props(i)["native_dtypes"] for i in range(len(flagos_devices))]
        # the router runs the common case of the kernel-table ops, their in-place forms and
        # views in C (csrc/adapter_fast.c) from these: the adapter, the native dtypes of each
        # device, the torch dtype of each flagos dtype code
        codes = {code: dtype for dtype, code in DTYPE_CODES.items()}
        # and the host round trip in C (csrc/adapter_fallback.c) of the ops this runner has no
        # path of its own for: never the SPECIAL ones, the KERNEL_BUILDERS ones only when
        # routed to the fallback (routed native, they try the kernel here first)
        self.c_fast = (self.adapter, tuple(self.native), tuple(codes[i] for i in range(len(codes))),
                       frozenset(SPECIAL) | FUNCTIONAL_COLLECTIVES, frozenset(KERNEL_BUILDERS))
        self.facts = {}
        self.layouts = {}  # (op, operand layouts) -> result strides of elementwise kernels

    # ---- entry ------------------------------------------------------------
    def __call__(self, func, name, route, policy, flags, args, kwargs):
        kwargs = kwargs or {}
        special = SPECIAL.get(name)
        if special is not None:
            return special(self, func, args, kwargs), NATIVE, 0, 0, 0, ()
        fts = _collect(args, [])  # the flagos tensors of the call, args first then kwargs
        if kwargs:
            _collect(kwargs.values(), fts)
        index = self._device_index(name, flags, fts, kwargs)
        if flags & _C.OP_DECOMPOSES and (flags & _C.OP_VIEW or route == NATIVE):
            # A decomposition reached the chip whole: PyTorch skips the autograd key, where it
            # runs them, under inference mode (an override kernel for it runs instead, as on a
            # torch-native chip; routed to the fallback, it runs whole on the host). Its parts
            # run here, as they do outside it, each with its own route: a maybe-view (reshape,
            # contiguous, to) copies when it must, and an op without a kernel (linear, conv2d,
            # attention) runs on the chip's kernels
            # (no KERNEL_BUILDERS entry is a decomposition). PyTorch's own C++ decomposition, as
            # the autograd key runs it, not a Python one registered for tracing (upsample's).
            out = func._op_dk(_DECOMPOSITION, *args, **kwargs)
            if flags & _C.OP_VIEW:
                # The parts' views were made by a dispatch inside this one, with autograd's
                # view metadata where the base requires grad (a parameter's chunk() in
                # multi-head attention): PyTorch makes the op's own views of fresh wrappers.
                out = pytree.tree_map_only(FlagosTensor, self._fresh_view, out)
            return out, NATIVE, 0, 0, 0, ()
        if flags & _C.OP_VIEW:
            if name in ("aten::detach", "aten::alias"):  # same view, new tensor: no meta needed
                return self._fresh_view(args[0]), NATIVE, 0, 0, 0, ()
            return self._view(func, args, kwargs), NATIVE, 0, 0, 0, ()
        if route == OVERRIDE:
            # None when another thread unregistered the kernel after the router resolved the
            # route: this call takes the route the op has now (the chip's kernel, the fallback).
            kernel = _routes._override_for(name)
            if kernel is not None:
                try:
                    return kernel(*args, **kwargs), OVERRIDE, 0, 0, 0, ()
                except NotImplementedError:
                    pass
        if route != FALLBACK:
            out = self._try_kernel(func, name, index, args, kwargs)
            if out is not NotImplemented:
                return out, NATIVE, 0, 0, 0, ()
        if policy:  # the router warns or raises first, then calls again with policy 0
            return None, WOULD_FALL_BACK, 0, 0, 0, ()
        # The chip's queued work finishes first (the copies would wait for it anyway): the
        # fallback's time is its copies and host op, not kernels queued before it.
        self.adapter.synchronize(index)
        start = time.perf_counter_ns()
        out, to_host, to_device, dtypes = self._fallback(func, index, fts, args, kwargs)
        return out, FALLBACK, to_host, to_device, time.perf_counter_ns() - start, dtypes

    def _device_index(self, name, flags, fts, kwargs) -> int:
        seen = {t.device.index for t in fts}
        if len(seen) > 1 and not flags & _C.OP_CROSS_DEVICE:
            found = ", ".join(f"flagos:{i}" for i in sorted(seen))
            raise DeviceMismatchError(
                f"{name}: its tensors are on {found}; every tensor argument must be on the same "
                f"device. Move them to one with .to('flagos:N').")
        if seen:
            return min(seen)
        device = kwargs.get("device")
        return _flagos_index(device) if _is_flagos_device(device) else 0

    # ---- buffers and wrappers ------------------------------------------------
    def _wrap(self, buffer, size, stride, offset, dtype, index) -> FlagosTensor:
        out = torch.Tensor._make_wrapper_subclass(
            FlagosTensor, size, strides=stride, storage_offset=offset, dtype=dtype,
            device=self.devices[index], storage_size=_C.WRAPPER_STORAGE_BYTES)
        out._payload = buffer
        return out

    def _fresh_view(self, t: FlagosTensor) -> FlagosTensor:
        """A new wrapper over t's bytes, with t's layout and math bits, without autograd state."""
        fresh = self._wrap(t._payload, t.size(), t.stride(), t.storage_offset(), t.dtype, t.device.index)
        return _tag(fresh, t)

    def _alloc(self, size, dtype, index, stride=None) -> FlagosTensor:
        # the layout is checked in C (negative sizes or strides, byte counts past 2**63)
        buf = self.adapter.alloc_tensor(index, size, stride, dtype.itemsize)
        size = tuple(size)
        stride = contiguous_strides(size) if stride is None else tuple(stride)
        return self._wrap(buf, size, stride, 0, dtype, index)

    def _upload(self, host: torch.Tensor, index: int, stride=None) -> FlagosTensor:
        """A new flagos tensor with host's values: laid out as `stride`, or as host is (a
        channels_last result stays channels_last, a gapped one such as new_empty_strided's
        keeps its gaps, as on the CPU)."""
        _strided_only(host, "a result for the flagos device")
        host = _physical(host)
        if stride is not None and tuple(host.stride()) != tuple(stride):
            host = torch.empty_strided(host.shape, stride, dtype=host.dtype).copy_(host)
        out = self._alloc(host.shape, host.dtype, index, host.stride())
        first, end = _span(host.shape, host.stride(), host.storage_offset())
        if end > first:  # the elements from its offset to its last one: all it touches
            flat = host.as_strided((end - first,), (1,), first)
            out._payload.write(to_dlpack(flat), 0)
        return out

    def _like_strides(self, t, memory_format):
        """The strides PyTorch gives a tensor made like t (empty_like, clone, _to_copy)."""
        if memory_format in (None, torch.preserve_format) and t.is_contiguous():
            return t.stride()
        if memory_format is torch.contiguous_format:
            return contiguous_strides(t.shape)
        return torch.empty_like(self._meta(t), memory_format=memory_format).stride()

    def _meta(self, t: FlagosTensor) -> torch.Tensor:
        numel = t._payload.nbytes // t.element_size()
        m = torch.empty(numel, dtype=t.dtype, device=META).as_strided(
            t.size(), t.stride(), t.storage_offset())
        return _tag(m, t)

    def _download(self, t: FlagosTensor) -> torch.Tensor:
        """A host copy of the elements the view touches, with the view's layout and bits."""
        return _tag(self._download_bytes(t), t)

    def _download_bytes(self, t: FlagosTensor) -> torch.Tensor:
        """A host copy of just the elements the view touches, with the view's layout."""
        lo, hi = _span(t.size(), t.stride(), t.storage_offset())
        item = t.element_size()
        host = torch.empty(hi - lo, dtype=t.dtype)
        if hi > lo:
            t._payload.read(to_dlpack(host), lo * item)
        return host.as_strided(t.size(), t.stride(), t.storage_offset() - lo)

    # ---- views: metadata over the same buffer -----------------------------------
    def _view(self, func, args, kwargs):
        base = next(t for t in _flatten(args) if isinstance(t, FlagosTensor))
        out = func(*_walk(args, self._meta), **self._stand_in_kwargs(kwargs))
        index = base.device.index

        def rewrap(m):
            if isinstance(m, torch.Tensor):
                # meta views are not bounds-checked against their storage: check the buffer's
                base._payload.check_view(m.shape, m.stride(), m.storage_offset(), m.element_size())
                out = self._wrap(base._payload, m.shape, m.stride(), m.storage_offset(), m.dtype, index)
                return _tag(out, m)
            if isinstance(m, (list, tuple)):
                return type(m)(rewrap(x) for x in m)
            return m
        return rewrap(out)

    def _stand_in_kwargs(self, kwargs):
        """Keyword arguments with flagos devices as meta and flagos tensors as meta stand-ins
        over their buffers."""
        return {k: META if _is_flagos_device(v) else _walk(v, self._meta) for k, v in kwargs.items()}

    # ---- adapter kernels ------------------------------------------------------
    def _try_kernel(self, func, name, index, args, kwargs):
        builder = KERNEL_BUILDERS.get(name)
        if builder is None:
            return NotImplemented
        plan = builder(self, name, args, kwargs)
        if plan is None:
            return NotImplemented
        kname, inputs, scalars, ints, out_shapes, broadcast, finals, *layouts = plan
        entry = self.kernels.get(kname)
        exempt = INDEX_INPUTS.get(kname, {})
        if any(inputs[i].dtype != want for i, want in exempt.items()):
            return NotImplemented
        tensors = [t for i, t in enumerate(inputs) if t is not None and i not in exempt]
        if entry is None or not tensors:
            return NotImplemented
        dtype = tensors[0].dtype
        code = DTYPE_CODES.get(dtype)
        if code is None or any(t.dtype != dtype or t.is_neg() for t in tensors):
            return NotImplemented  # mixed dtypes: type promotion happens on the host
        if not (entry[1] >> code & 1) or not (self.native[index] >> code & 1):
            return NotImplemented
        order = stride = None
        if name in ELEMENTWISE and (not all(t.is_contiguous() for t in tensors) or
                                    any(s < 2 for s in out_shapes[0])):
            # the output takes the layout PyTorch gives it (channels_last in, channels_last
            # out; contiguous operands give a contiguous result, but for the strides of its
            # size-1 dims); the kernel sees every operand with dims permuted so the output is
            # contiguous
            stride = self._elementwise_strides(kname, out_shapes[0], tensors)
            order = _dense_order(out_shapes[0], stride)
        # (allocated strides, final strides) per output: a builder's own layouts (channels_last
        # results), else contiguous
        layouts = layouts[0] if layouts else [(stride if order else None, None)] * len(out_shapes)
        outs = [self._alloc(shape, dtype, index, lay[0]) for shape, lay in zip(out_shapes, layouts)]
        descs = [self._desc(t, broadcast[i] if broadcast else None) for i, t in enumerate(inputs)]
        out_descs = [self._desc(o) for o in outs]
        if order:
            descs = [d if d is None else _permute(d, order) for d in descs]
            out_descs = [_permute(d, order) for d in out_descs]
        try:
            self.adapter.run_kernel(entry[0], index, descs, out_descs,
                                    tuple(float(s) for s in scalars), tuple(int(i) for i in ints))
        except NotImplementedError:  # FLAGOS_STATUS_UNSUPPORTED: the kernel declined these arguments
            return NotImplemented
        if finals is not None:  # keepdim=False reductions, merged dims: same bytes, final shape
            outs = [self._wrap(o._payload, f, lay[1] or contiguous_strides(f), 0, dtype, index)
                    for o, f, lay in zip(outs, finals, layouts)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _elementwise_strides(self, kname, shape, tensors):
        """The CPU's layout of the result (TensorIterator's rule, runtime/_iterator_layout.py),
        worked out once per kernel, shape and operand layouts, as a training loop repeats them.
        A `.Scalar` kernel's op took a Python number as an operand."""
        key = (kname, tuple(shape), tuple((tuple(t.shape), t.stride()) for t in tensors))
        stride = self.layouts.get(key)
        if stride is None:
            if len(self.layouts) > 4096:
                self.layouts.clear()
            operands = [(tuple(t.shape), t.stride()) for t in tensors]
            stride = self.layouts[key] = result_strides(shape, operands, int(kname.endswith(".Scalar")))
        return stride

    def _desc(self, t, shape=None):
        """(buffer, offset, dtype code, sizes, strides) of a tensor, broadcast to `shape`."""
        if t is None:
            return None
        size, stride = tuple(t.shape), tuple(t.stride())
        if shape is not None and tuple(shape) != size:
            pad = len(shape) - len(size)
            stride = tuple(0 if i < pad or size[i - pad] == 1 and shape[i] != 1 else stride[i - pad]
                           for i in range(len(shape)))
            size = tuple(shape)
        return (t._payload, t.storage_offset(), DTYPE_CODES[t.dtype], size, stride)

    # ---- the host round trip ------------------------------------------------------
    def _fallback(self, func, index, fts, args, kwargs):
        trip = _HostRegions(fts)
        try:  # the host views and results die with _round_trip's frame, before release()
            return self._round_trip(trip, fts, func, index, args, kwargs)
        finally:
            trip.release()

    def _round_trip(self, trip, fts, func, index, args, kwargs):
        target = kwargs.get("device")
        # results handed back as host tensors (.to("cpu") falling back) must own their memory
        to_host = trip.download(not (isinstance(target, torch.device) and target.type != "flagos"))
        hargs = _walk(args, trip.view)
        hkwargs = ({k: CPU if _is_flagos_device(v) else _walk(v, trip.view) for k, v in kwargs.items()}
                   if kwargs else {})
        # the host arguments' tensors have the dtypes of the call's own
        if any(t.is_complex() for t in _collect(kwargs.values(), _collect(args, [], torch.Tensor),
                                                torch.Tensor)):
            out = _math_keys.call(func, hargs, hkwargs)  # conjugate views inside composite ops
        else:
            out = func(*hargs, **hkwargs)
        if func.namespace == "_c10d_functional":
            # A functional collective's host result is registered until someone waits on it;
            # its values are copied to the chip now, so the wait is now (the flagos group has
            # finished the collective already): otherwise the registry keeps it to the end.
            for t in _collect((out,), [], torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(t)

        facts = self.facts.get(func)
        if facts is None:
            facts = self.facts[func] = _schema.describe(func)
        _, arg_names, write_args, return_alias, op_flags = facts

        def argument(i):
            return args[i] if i < len(args) else kwargs.get(arg_names[i])

        to_device = sum(self._write_back(trip, t) for i in write_args
                        for t in _flatten((argument(i),)) if isinstance(t, FlagosTensor)) if write_args else 0
        dtypes = {t.dtype for t in fts}
        dtypes = tuple(dtypes) if len(dtypes) < 2 else tuple(sorted(dtypes, key=str))
        if isinstance(target, torch.device) and target.type != "flagos":
            return out, to_host, to_device, dtypes  # the op asked for host results
        if _is_flagos_device(target):
            index = _flagos_index(target)
        uploaded = [0]

        def to_chip(v):
            if isinstance(v, torch.Tensor) and not isinstance(v, FlagosTensor):
                uploaded[0] += v.numel() * v.element_size()
                return self._upload(v, index)
            if isinstance(v, (list, tuple)):
                return type(v)(to_chip(x) for x in v)
            return v

        # results that are written arguments are the caller's own objects; the rest are uploaded
        if len(return_alias) == 1:
            result = argument(return_alias[0]) if return_alias[0] >= 0 else to_chip(out)
        elif len(return_alias) > 1:
            host = 1 if op_flags & _C.OP_HOST_OUTPUT1 else -1  # a packed sequence's batch sizes
            result = tuple(argument(a) if a >= 0 else v if i == host else to_chip(v)
                           for i, (a, v) in enumerate(zip(return_alias, out)))
        else:
            result = out
        return result, to_host, to_device + uploaded[0], dtypes

    def _write_back(self, trip, t: FlagosTensor) -> int:
        """Bring a written argument's new contents back to the chip; returns the bytes moved."""
        view = trip.views[id(t)]
        data = trip.data[id(t._payload)][0]
        if (view.shape != t.shape or view.stride() != t.stride()
                or view.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()):
            return self._write_back_fresh(t, view)
        return trip.upload(t._payload)

    def _write_back_fresh(self, t: FlagosTensor, view: torch.Tensor) -> int:
        """out= resized a written argument (or an in-place op re-laid it): it gets a buffer of
        its own with the host view's values; returns the bytes moved. The C round trip
        (csrc/adapter_fallback.c) calls this too."""
        fresh = self._upload(view, t.device.index)
        t._payload = fresh._payload
        set_metadata(t, fresh.shape, fresh.stride(), 0)
        return fresh._payload.nbytes

    # ---- allocation and copies (never a fallback) ------------------------------------
    def empty(self, func, args, kwargs):
        size = args[0]
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        memory_format = kwargs.get("memory_format")
        stride = None
        if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
            stride = torch.empty(size, device=META, memory_format=memory_format).stride()
        return self._alloc(size, dtype, self._index_of(kwargs.get("device")), stride)

    def empty_strided(self, func, args, kwargs):
        size, stride = args[0], args[1]
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        return self._alloc(size, dtype, self._index_of(kwargs.get("device")), stride)

    def empty_like(self, func, args, kwargs):
        t = args[0]
        dtype = kwargs.get("dtype") or t.dtype
        device = kwargs.get("device")
        stride = self._like_strides(t, kwargs.get("memory_format"))
        if isinstance(device, torch.device) and device.type != "flagos":
            return torch.empty_strided(t.shape, stride, dtype=dtype, device=device)
        return self._alloc(t.shape, dtype, self._index_of(device, t.device.index), stride)

    def _index_of(self, device, default=0) -> int:
        if _is_flagos_device(device):
            index = _flagos_index(device)
            if index >= len(self.devices):
                raise RuntimeError(f"flagos:{index} does not exist: the active chip has "
                                   f"{len(self.devices)} device(s) (see flagos.list_devices())")
            return index
        return default

    def copy_(self, func, args, kwargs):
        dst, src = args[0], args[1]
        # size(), not .shape: a lazy module's uninitialized parameter (nn.UninitializedParameter,
        # which load_state_dict copies into) refuses .shape but answers size()
        if not isinstance(dst, FlagosTensor):  # host destination: bring the source here
            if not isinstance(src, FlagosTensor) and _is_flagos_device(src.device):
                raise RuntimeError(_NOT_MADE_BY_FLAGOS.format(src.device))
            dst.copy_(self._download(src) if isinstance(src, FlagosTensor) else src)
            return dst
        _strided_only(src, "copying to the flagos device")
        if isinstance(src, FlagosTensor) and src._payload is dst._payload:  # PyTorch's copy_ rules
            if (src.size() == dst.size() and src.stride() == dst.stride() and src.dtype == dst.dtype
                    and src.storage_offset() == dst.storage_offset() and src.is_conj() == dst.is_conj()
                    and src.is_neg() == dst.is_neg()):
                return dst  # the same data: nothing to copy
            if _overlaps_in_part(dst, src):
                raise RuntimeError(_PARTIAL_OVERLAP)
        if isinstance(src, FlagosTensor) and src.device.index != dst.device.index:
            _transfers.add(dst.numel() * dst.element_size())
        tagged = dst.is_conj() or dst.is_neg()
        if (isinstance(src, FlagosTensor) and src.dtype == dst.dtype and src.size() == dst.size()
                and src.is_contiguous() and dst.is_contiguous() and not tagged
                and not src.is_conj() and not src.is_neg()):
            item = dst.element_size()
            if dst.numel():
                dst._payload.copy_from(src._payload, dst.storage_offset() * item,
                                       src.storage_offset() * item, dst.numel() * item)
            return dst
        host = self._download(src) if isinstance(src, FlagosTensor) else src
        if dst.is_contiguous() and not tagged:
            data = _physical(host.to(dst.dtype)).expand(dst.size()).contiguous()
            if data.numel():
                dst._payload.write(to_dlpack(data.view(-1)), dst.storage_offset() * dst.element_size())
            return dst
        region = self._download_bytes(dst)
        _tag(region.view(region.shape), dst).copy_(host)  # writes the bytes dst's bits call for
        self._write_region(dst, region)
        return dst

    def _write_region(self, t: FlagosTensor, region: torch.Tensor) -> None:
        """Upload a host region made by _download(t) (after changing it) back to t's buffer."""
        lo, hi = _span(t.size(), t.stride(), t.storage_offset())
        if hi > lo:
            flat = region.as_strided((hi - lo,), (1,), region.storage_offset() - (t.storage_offset() - lo))
            t._payload.write(to_dlpack(flat.contiguous()), lo * t.element_size())

    def to_copy(self, func, args, kwargs):
        t = args[0]
        _strided_only(t, "copying to the flagos device")
        if kwargs.get("layout") not in (None, torch.strided):
            raise RuntimeError(f"sparse tensors are not supported on flagos (layout "
                               f"{kwargs['layout']} asked for); work with dense tensors")
        dtype = kwargs.get("dtype") or t.dtype
        device = kwargs.get("device")
        stride = self._like_strides(t, kwargs.get("memory_format"))
        if isinstance(device, torch.device) and device.type != "flagos":
            return torch.empty_strided(t.shape, stride, dtype=dtype, device=device).copy_(self._download(t))
        index = self._index_of(device, t.device.index)
        if index != t.device.index:
            _transfers.add(t.numel() * dtype.itemsize)
        if (dtype == t.dtype and tuple(stride) == t.stride() and not t.is_conj() and not t.is_neg()
                and (t.is_contiguous() or _dense_order(t.shape, stride))):
            # same bytes in the same layout: one device copy of the span
            out = self._alloc(t.shape, dtype, index, stride)
            if t.numel():
                item = t.element_size()
                out._payload.copy_from(t._payload, 0, t.storage_offset() * item, t.numel() * item)
            return out
        return self._upload(self._download(t).to(dtype), index, stride)

    def clone(self, func, args, kwargs):
        return self.to_copy(func, (args[0],), {"memory_format": kwargs.get("memory_format")})

    def shallow_copy_compatible(self, func, args, kwargs):
        """Whether `a.data = b` may take b's metadata. PyTorch answers yes for two dense tensors
        of the dense devices it lists (CPU, CUDA, XPU, ...), whatever their autograd keys; for
        others, PrivateUse1 among them, only for equal dispatch keys, which refused an inference
        tensor for a normal one (a lazy module's first forward under inference_mode). Two
        flagos tensors are dense device tensors: the CPU's rule."""
        a, b = args[0], args[1]
        return (isinstance(a, FlagosTensor) and isinstance(b, FlagosTensor)
                and a.layout == torch.strided and b.layout == torch.strided)

    def local_scalar(self, func, args, kwargs):
        return self._download(args[0]).item()

    def unsafe_view(self, func, args, kwargs):
        t, size = args[0], args[1]
        meta = self._meta(t).view(size)  # a view, as on CPU: PyTorch's error where none exists
        return _tag(self._wrap(t._payload, meta.shape, meta.stride(), meta.storage_offset(), t.dtype,
                               t.device.index), t)

    def fill_(self, func, args, kwargs):
        t, value = args[0], args[1]
        value = value.item() if isinstance(value, torch.Tensor) else value
        if t.is_contiguous():
            return self.copy_(func, (t, torch.full(t.shape, value, dtype=t.dtype)), {})
        # fill_ writes any view, an expanded one too (PyTorch skips its overlap check there,
        # where copy_ refuses to write one element twice): fill the view's host region
        region = self._download_bytes(t)
        _tag(region.view(region.shape), t).fill_(value)
        self._write_region(t, region)
        return t

    def zero_(self, func, args, kwargs):
        return self.fill_(func, (args[0], 0), {})

    def itself(self, func, args, kwargs):
        """lift_fresh, and detach_ under inference mode (it changes autograd state only, which
        the wrapper carries): the tensor itself, no kernel and no round trip."""
        return args[0]

    def set_(self, func, args, kwargs):
        """set_(source): the tensor takes source's memory, sizes, strides and offset, and shares
        that memory from then on, as on the CPU (a host round trip gave it a copy); set_() leaves
        it empty, on a buffer of its own. PyTorch's own checks (the dtypes) run on stand-ins."""
        t = args[0]
        source = args[1] if len(args) > 1 else None
        if isinstance(source, torch.TypedStorage):
            source = source.untyped()
        if isinstance(source, torch.UntypedStorage):
            # set_(storage, offset, size, stride): t.untyped_storage() names t's buffer (a meta
            # storage whose data_ptr() is the buffer's handle); no other buffer can be found
            # from a storage, and a host storage is on another device
            if source.device.type != "meta" or source.data_ptr() != t._payload.handle:
                raise RuntimeError(
                    f"set_(storage, ...) on {t.device} takes the tensor's own storage only (storages "
                    f"of this chip name a buffer and hold no memory): to view another tensor's "
                    f"memory, use t.set_(other) or other.as_strided(size, stride, offset)")
            meta = self._meta(t)
            m = func(meta, meta.untyped_storage(), *args[2:], **kwargs)
            end = _span(m.shape, m.stride(), m.storage_offset())[1] * t.element_size()
            if end > t._payload.nbytes:  # the CPU would grow its storage in place
                raise RuntimeError(
                    f"set_: sizes {list(m.shape)}, strides {list(m.stride())} and offset "
                    f"{m.storage_offset()} reach byte {end} of a {t._payload.nbytes}-byte buffer; "
                    f"{t.device} cannot grow a buffer in place: make a larger tensor and copy into it")
            set_metadata(t, m.shape, m.stride(), m.storage_offset())
            return t
        if source is not None and (not isinstance(source, FlagosTensor) or source.device != t.device):
            raise RuntimeError(f'Attempted to set the storage of a tensor on device "{t.device}" to a '
                               f'storage on different device "{source.device}". This is no longer '
                               f'allowed; the devices must match.')
        m = func(self._meta(t)) if source is None else func(self._meta(t), self._meta(source))
        t._payload = (self._alloc((0,), t.dtype, t.device.index) if source is None else source)._payload
        set_metadata(t, m.shape, m.stride(), m.storage_offset())
        return t

    def inplace_view(self, func, args, kwargs):
        """unsqueeze_, t_, as_strided_, ...: new metadata over the same buffer."""
        t = args[0]
        m = func(self._meta(t), *_walk(args[1:], self._meta), **self._stand_in_kwargs(kwargs))
        set_metadata(t, m.shape, m.stride(), m.storage_offset())
        return t


def _flatten(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)
    else:
        yield value


# The functional collectives (DTensor's, FSDP2's): their host results are waited on before the
# upload (Runner._round_trip), which the C round trip does not do; so they take the runner's.
FUNCTIONAL_COLLECTIVES = frozenset(f"_c10d_functional::{name}" for name in (
    "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_reduce",
    "all_reduce_coalesced", "all_to_all_single", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "broadcast"))

SPECIAL = {
    "aten::empty.memory_format": Runner.empty,
    "aten::empty_strided": Runner.empty_strided,
    "aten::empty_like": Runner.empty_like,
    "aten::copy_": Runner.copy_,
    "aten::_to_copy": Runner.to_copy,
    "aten::clone": Runner.clone,
    "aten::_local_scalar_dense": Runner.local_scalar,
    "aten::_has_compatible_shallow_copy_type": Runner.shallow_copy_compatible,
    "aten::_unsafe_view": Runner.unsafe_view,
    "aten::fill_.Scalar": Runner.fill_,
    "aten::zero_": Runner.zero_,
    "aten::lift_fresh": Runner.itself,
    "aten::detach_": Runner.itself,
    "aten::set_": Runner.set_,
    "aten::set_.source_Tensor": Runner.set_,
    "aten::set_.source_Storage": Runner.set_,
    "aten::set_.source_Storage_storage_offset": Runner.set_,
    **{f"aten::{op}": Runner.inplace_view for op in (
        "unsqueeze_", "squeeze_", "squeeze_.dim", "squeeze_.dims", "t_", "transpose_",
        "as_strided_", "swapdims_", "swapaxes_")},
}


# ---- kernel argument builders: aten arguments -> adapter calling convention -------------
# Each returns (kernel name, inputs, scalars, ints, output shapes, broadcast shape per input or
# None, final output shapes or None[, (allocated strides, final strides) per output, None for
# contiguous]), or None when the call does not fit the convention or its
# shapes are invalid (the host then runs it and raises PyTorch's own error).

def _broadcast(a, b):
    a, b = tuple(a), tuple(b)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    if any(x != y and x != 1 and y != 1 for x, y in zip(a, b)):
        return None
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def _number(value):
    return None if isinstance(value, torch.Tensor) else value


def _binary(runner, name, args, kwargs, with_alpha):
    self, other = args[0], args[1]
    alpha = _number(kwargs.get("alpha", args[2] if len(args) > 2 else 1))
    if not isinstance(self, FlagosTensor) or alpha is None:
        return None
    if isinstance(other, FlagosTensor):
        shape = _broadcast(self.shape, other.shape)
        if shape is None:
            return None
        return name, [self, other], ([alpha] if with_alpha else []), [], [shape], [shape, shape], None
    value = _host_scalar(other)
    if value is None:
        return None
    scalar_name = name.replace(".Tensor", ".Scalar")
    return (scalar_name, [self], ([value, alpha] if with_alpha else [value]), [], [tuple(self.shape)],
            None, None)


def _binary_scalar(runner, name, args, kwargs, with_alpha):
    self, other = args[0], args[1]
    alpha = _number(kwargs.get("alpha", args[2] if len(args) > 2 else 1))
    value = _host_scalar(other)
    if value is None or alpha is None:
        return None
    return name, [self], ([value, alpha] if with_alpha else [value]), [], [tuple(self.shape)], None, None


def _unary(runner, name, args, kwargs):
    return name, [args[0]], [], [], [tuple(args[0].shape)], None, None


def _gelu(runner, name, args, kwargs):
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    return name, [args[0]], [], [1 if approximate == "tanh" else 0], [tuple(args[0].shape)], None, None


def _mm(runner, name, args, kwargs):
    a, b = args[0], args[1]
    if not isinstance(b, FlagosTensor) or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return None
    return name, [a, b], [], [], [(a.shape[0], b.shape[1])], None, None


def _bmm(runner, name, args, kwargs):
    a, b = args[0], args[1]
    if (not isinstance(b, FlagosTensor) or a.dim() != 3 or b.dim() != 3
            or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]):
        return None
    return name, [a, b], [], [], [(a.shape[0], a.shape[1], b.shape[2])], None, None


def _addmm(runner, name, args, kwargs):
    self, mat1, mat2 = args[0], args[1], args[2]
    beta = _number(kwargs.get("beta", args[3] if len(args) > 3 else 1))
    alpha = _number(kwargs.get("alpha", args[4] if len(args) > 4 else 1))
    if (not all(isinstance(t, FlagosTensor) for t in (self, mat1, mat2)) or beta is None
            or alpha is None or mat1.dim() != 2 or mat2.dim() != 2 or mat1.shape[1] != mat2.shape[0]):
        return None
    shape = (mat1.shape[0], mat2.shape[1])
    if _broadcast(self.shape, shape) != shape:
        return None
    return name, [self, mat1, mat2], [beta, alpha], [], [shape], [shape, None, None], None


def _reduce(runner, name, args, kwargs):
    self = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    if kwargs.get("dtype", args[3] if len(args) > 3 else None) is not None:
        return None
    ndim = self.dim()
    if dim and any(not -max(ndim, 1) <= d < max(ndim, 1) for d in dim):
        return None
    if dim and len({d % max(ndim, 1) for d in dim}) != len(dim):
        return None  # a dim named twice (0 and -1 of a 0-dim tensor too): PyTorch's error
    dims = sorted({d % ndim for d in dim} if dim else range(ndim)) if ndim else []
    keep = tuple(1 if i in dims else s for i, s in enumerate(self.shape))
    final = keep if keepdim else tuple(s for i, s in enumerate(self.shape) if i not in dims)
    return name, [self], [], dims, [keep], None, [final]


def _softmax(runner, name, args, kwargs):
    self, dim, half_to_float = args[0], args[1], args[2]
    if half_to_float or self.dim() == 0 or not -self.dim() <= dim < self.dim():
        return None
    return name, [self], [], [dim % self.dim()], [tuple(self.shape)], None, None


def _safe_softmax(runner, name, args, kwargs):
    self, dim = args[0], args[1]
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    if (dtype is not None and dtype != self.dtype) or self.dim() == 0 or not -self.dim() <= dim < self.dim():
        return None
    return name, [self], [], [dim % self.dim()], [tuple(self.shape)], None, None


def _layer_norm(runner, name, args, kwargs):
    inp, normalized_shape, weight, bias, eps = args
    k = len(normalized_shape)
    shape = tuple(inp.shape)
    if not 1 <= k <= len(shape) or shape[len(shape) - k:] != tuple(normalized_shape):
        return None
    for t in (weight, bias):
        if t is not None and (not isinstance(t, FlagosTensor) or tuple(t.shape) != tuple(normalized_shape)):
            return None
    stats = shape[:len(shape) - k] + (1,) * k
    return name, [inp, weight, bias], [eps], [k], [shape, stats, stats], None, None


class _Reshaped:
    """A flagos tensor's buffer seen with other sizes and strides (same offset and dtype): what
    a kernel gets when a convention merges dims, without a view op through the router."""

    def __init__(self, t, shape, stride):
        self._payload, self.dtype, self.shape, self._stride = t._payload, t.dtype, shape, stride
        self._offset, self._neg = t.storage_offset(), t.is_neg()

    def stride(self):
        return self._stride

    def storage_offset(self):
        return self._offset

    def is_neg(self):
        return self._neg


def _channels_last(t) -> bool:
    """A 4-d tensor PyTorch treats as channels_last (its conv, group_norm and upsample results
    then are too, where the kernel-table conventions promise contiguous outputs)."""
    return (t.dim() == 4 and not t.is_contiguous()
            and t.is_contiguous(memory_format=torch.channels_last))


def _channels_last_strides(shape):
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _pair(value):
    return tuple(value) if isinstance(value, (list, tuple)) and len(value) == 2 else None


def _convolution(runner, name, args, kwargs):
    inp, weight, bias, stride, padding, dilation, transposed, _, groups = args
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    if (transposed or not isinstance(weight, FlagosTensor) or inp.dim() != 4 or weight.dim() != 4
            or None in (stride, padding, dilation) or not isinstance(groups, int) or groups < 1
            or min(stride) < 1 or min(dilation) < 1 or min(padding) < 0):
        return None
    n, cin, h, w = inp.shape
    cout, cin_g, kh, kw = weight.shape
    if cin != cin_g * groups or cout % groups or cout == 0 or n == 0 or cin_g == 0:
        return None
    if bias is not None and (not isinstance(bias, FlagosTensor) or tuple(bias.shape) != (cout,)):
        return None
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if oh < 1 or ow < 1:
        return None  # the host raises PyTorch's error
    if _channels_last(inp) or _channels_last(weight):
        # PyTorch's result is channels_last; a kernel writing it so gave results that differed
        # from PyTorch's (at float16 rounding) further down a UNet: the fallback keeps them
        return None
    ints = [*stride, *padding, *dilation, groups]
    return name, [inp, weight, bias], [], ints, [(n, cout, oh, ow)], None, None


def _group_norm(runner, name, args, kwargs):
    inp, weight, bias, n, c, hxw, group, eps = args
    if (inp.dim() < 2 or not isinstance(group, int) or group < 1
            or c % group or tuple(inp.shape[:2]) != (n, c) or inp.numel() != n * c * hxw
            or inp.numel() == 0):
        return None
    for t in (weight, bias):
        if t is not None and (not isinstance(t, FlagosTensor) or tuple(t.shape) != (c,)):
            return None
    # the spatial dims as one: they must merge into a single stride
    inner = expect = None
    for size, st in zip(reversed(inp.shape[2:]), reversed(inp.stride()[2:])):
        if size == 1:
            continue
        if inner is None:
            inner = st
        elif st != expect:
            return None
        expect = st * size
    flat = _Reshaped(inp, (n, c, hxw), (inp.stride(0), inp.stride(1), inner or 1))
    shape = tuple(inp.shape)
    # a channels_last input keeps its layout in the result, as on the CPU
    layout = ((c * hxw, 1, c), _channels_last_strides(shape)) if _channels_last(inp) else (None, None)
    return (name, [flat, weight, bias], [eps], [n, c, hxw, group],
            [(n, c, hxw), (n, group), (n, group)], None, [shape, (n, group), (n, group)],
            [layout, (None, None), (None, None)])


def _upsample_nearest2d(runner, name, args, kwargs):
    inp, size = args[0], _pair(args[1] if len(args) > 1 else kwargs.get("output_size"))
    scales = [kwargs.get(k, args[i] if len(args) > i else None)
              for i, k in ((2, "scales_h"), (3, "scales_w"))]
    if inp.dim() != 4 or size is None or min(size) < 1 or inp.numel() == 0:
        return None
    if any(s is not None and not isinstance(s, (int, float)) for s in scales):
        return None
    out = (*inp.shape[:2], *size)
    layout = _channels_last_strides(out) if _channels_last(inp) else None  # as on the CPU
    return (name, [inp], [float(s) if s is not None else 0.0 for s in scales], list(size),
            [out], None, None, [(layout, None)])


def _embedding(runner, name, args, kwargs):
    weight, indices = args[0], args[1]
    # the output has one dim more than the indices: at most 8 (FLAGOS_MAX_DIMS)
    if (not isinstance(indices, FlagosTensor) or indices.dtype != torch.int64 or weight.dim() != 2
            or indices.dim() > 7 or indices.is_neg()):
        return None
    return name, [weight, indices], [], [], [(*indices.shape, weight.shape[1])], None, None


def _cat(runner, name, args, kwargs):
    tensors = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    # at most 8 tensors: run_kernel's limit (csrc/adapter_kernels.c)
    if (not isinstance(tensors, (list, tuple)) or not 1 <= len(tensors) <= 8
            or not all(isinstance(t, FlagosTensor) for t in tensors) or not isinstance(dim, int)):
        return None
    rank, shape = tensors[0].dim(), list(tensors[0].shape)
    # 0-d tensors, legacy 1-d empty ones mixed with others, mismatched shapes: the host decides
    # (or raises)
    if rank == 0 or not -rank <= dim < rank:
        return None
    dim %= rank
    for t in tensors[1:]:
        if t.dim() != rank or any(a != b for i, (a, b) in enumerate(zip(t.shape, shape)) if i != dim):
            return None
    shape[dim] = sum(t.shape[dim] for t in tensors)
    # channels_last when every input is (PyTorch's rule), else contiguous
    layout = _channels_last_strides(shape) if all(_channels_last(t) for t in tensors) else None
    return name, list(tensors), [], [dim], [tuple(shape)], None, None, [(layout, None)]


# inputs exempt from the one-dtype rule of a kernel call (adapter.h): kernel name -> input
# position -> the dtype it must have
INDEX_INPUTS = {"aten::embedding": {1: torch.int64}}

ELEMENTWISE = frozenset(("aten::add.Tensor", "aten::sub.Tensor", "aten::mul.Tensor", "aten::div.Tensor",
                         "aten::add.Scalar", "aten::sub.Scalar", "aten::mul.Scalar", "aten::div.Scalar",
                         "aten::neg", "aten::relu", "aten::silu", "aten::sigmoid", "aten::tanh",
                         "aten::exp", "aten::gelu"))

KERNEL_BUILDERS = {
    "aten::add.Tensor": lambda r, n, a, k: _binary(r, n, a, k, True),
    "aten::sub.Tensor": lambda r, n, a, k: _binary(r, n, a, k, True),
    "aten::mul.Tensor": lambda r, n, a, k: _binary(r, n, a, k, False),
    "aten::div.Tensor": lambda r, n, a, k: _binary(r, n, a, k, False),
    "aten::add.Scalar": lambda r, n, a, k: _binary_scalar(r, n, a, k, True),
    "aten::sub.Scalar": lambda r, n, a, k: _binary_scalar(r, n, a, k, True),
    "aten::mul.Scalar": lambda r, n, a, k: _binary_scalar(r, n, a, k, False),
    "aten::div.Scalar": lambda r, n, a, k: _binary_scalar(r, n, a, k, False),
    **{op: _unary for op in ("aten::neg", "aten::relu", "aten::silu", "aten::sigmoid",
                             "aten::tanh", "aten::exp")},
    "aten::gelu": _gelu,
    "aten::mm": _mm,
    "aten::bmm": _bmm,
    "aten::addmm": _addmm,
    "aten::sum.dim_IntList": _reduce,
    "aten::sum": lambda r, n, a, k: _reduce(r, "aten::sum.dim_IntList", a, k),  # every dim
    "aten::mean.dim": _reduce,
    "aten::_softmax": _softmax,
    "aten::_safe_softmax": _safe_softmax,
    "aten::native_layer_norm": _layer_norm,
    "aten::convolution": _convolution,
    "aten::native_group_norm": _group_norm,
    "aten::upsample_nearest2d": _upsample_nearest2d,
    "aten::embedding": _embedding,
    "aten::cat": _cat,
}

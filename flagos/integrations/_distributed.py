"""torch.distributed on flagos tensors: the `flagos` process group backend.

`flagos.dist_backend()` names the backend to pass to `init_process_group` for the active chip:
"flagos" in device mode (tensors are flagos tensors), the chip's own collective backend in
native mode (tensors are the chip's own: hccl on npu, gloo on cpu, ...).

The "flagos" backend is a Python `torch.distributed.ProcessGroup` registered for the flagos
device (`Backend.register_backend("flagos", ..., devices=["flagos"])`), so
`init_process_group("flagos")`, `init_process_group()` with no backend (PyTorch asks the
accelerator, which is flagos) and, under the CUDA redirect, `init_process_group("nccl")` make it.
Each collective runs on the chip's own collective backend:

- where the chip's backend serves the payloads' device (cpu chip: gloo on the CPU payloads;
  cuda chip: nccl on the CUDA payloads), on the payloads themselves: no copy, and in-place
  collectives write the flagos tensors' own memory;
- otherwise (C-ABI chips such as sim, whose payloads are adapter buffers, or a chip without a
  collective library), on host copies through gloo, copied back into the flagos tensors after
  the collective (in place, as on any device).

Host tensors given to the same group (object collectives, barrier) go to a gloo group. Every
collective completes before it returns (its Work is already done), so `async_op=True` works and
waits for nothing. docs/parallel.md ("torch.distributed") and docs/design.md §18.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core import _state
from ..runtime._tensor import FlagosTensor

log = logging.getLogger("flagos")

BACKEND = "flagos"
_INNER = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL", "xccl": "ProcessGroupXCCL"}
_registered = False


def dist_backend() -> str:
    """The backend to pass to `torch.distributed.init_process_group` for the active chip:
    "flagos" in device mode, the chip's own collective backend in native mode."""
    state = _state.active()
    if state.mode == "device":
        return BACKEND
    return state.chip.collective_backend or "gloo"


def install() -> None:
    """Register the "flagos" backend with torch.distributed (once per process; device mode)."""
    global _registered
    if _registered or not dist.is_available():
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["flagos"])
    _registered = True


def _create(store, rank: int, world_size: int, timeout: timedelta) -> FlagosProcessGroup:
    return FlagosProcessGroup(store, rank, world_size, timeout)


def _make_inner(name: str, store, rank: int, world_size: int, timeout: timedelta):
    cls = getattr(dist, _INNER.get(name, ""), None)
    if cls is None:
        raise RuntimeError(f"the collective backend {name!r} is not in this PyTorch build "
                           f"(torch.distributed has no {_INNER.get(name, name)})")
    store = dist.PrefixStore(f"flagos/{name}/", store)
    if name == "gloo":
        return cls(store, rank, world_size, timeout)
    opts = cls.Options()
    opts._timeout = timeout
    return cls(store, rank, world_size, opts)


def _payload_route(chip) -> tuple[str, str | None]:
    """(the chip's collective backend, the payload device type it runs on, or None when the
    collectives run on host copies through gloo)."""
    name = chip.collective_backend or "gloo"
    payload_type = getattr(chip, "torch_type", None)  # None: adapter buffers
    if payload_type is None or name not in _INNER:
        return name, None
    if payload_type not in dist.Backend.backend_capability.get(name, ()):
        return name, None
    return name, payload_type


class _Moved:
    """The tensors a collective runs on, for the tensors it was given, and how to write the
    results back into the given ones."""

    def __init__(self, host_copies: bool):
        self.host_copies = host_copies
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def one(self, t: torch.Tensor, written: bool, read: bool = True) -> torch.Tensor:
        """What the collective runs on for `t`: written (results land in it), read (its values
        go in; an output only, such as all_gather's, is not copied to the host)."""
        if not isinstance(t, FlagosTensor):
            return t
        with torch.no_grad():
            if self.host_copies:
                inner = torch.Tensor.cpu(t.detach()).contiguous() if read else \
                    torch.empty(t.shape, dtype=t.dtype)
                target = t
            else:
                target = t._payload
                inner = target if target.is_contiguous() else target.contiguous()
        if written and inner is not target:
            self.back.append((target, inner))
        return inner

    def many(self, ts, written: bool, read: bool = True) -> list:
        return [self.one(t, written, read) for t in ts]

    def nested(self, tss, written: bool, read: bool = True) -> list:
        return [self.many(ts, written, read) for ts in tss]

    def write_back(self) -> None:
        with torch.no_grad():
            for target, inner in self.back:
                target.copy_(inner)
        self.back.clear()


def _done(result) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


class FlagosProcessGroup(dist.ProcessGroup):
    """The "flagos" backend: collectives on flagos tensors through the chip's own backend."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta):
        super().__init__(rank, world_size)
        state = _state.active()
        self._rank, self._world_size = rank, world_size
        self.chip_backend, self.payload_type = _payload_route(state.chip)
        self._host = _make_inner("gloo", store, rank, world_size, timeout)
        if self.payload_type is not None and self.chip_backend != "gloo":
            self._chip = _make_inner(self.chip_backend, store, rank, world_size, timeout)
        else:
            self._chip = self._host
        log.info("flagos process group: rank %d of %d, collectives through %s (%s)", rank,
                 world_size, self.chip_backend if self.payload_type else "gloo",
                 "on the payloads" if self.payload_type else "on host copies")

    # -- which group, which tensors --------------------------------------------------------
    def _route(self, tensors) -> tuple[object, _Moved]:
        on_flagos = any(isinstance(t, FlagosTensor) for t in tensors)
        if not on_flagos:
            t = tensors[0] if tensors else None
            chip = t is not None and self.payload_type is not None and t.device.type == self.payload_type
            return (self._chip if chip else self._host), _Moved(False)
        host = self.payload_type is None
        return (self._host if host else self._chip), _Moved(host)

    @staticmethod
    def _run(work, moved: _Moved, result) -> dist.Work:
        work.wait()
        moved.write_back()
        return _done(result)

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        if not isinstance(opts, dist.AllreduceOptions):  # allreduce(tensors, ReduceOp)
            op, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = op
        group, moved = self._route(tensors)
        return self._run(group.allreduce(moved.many(tensors, True), opts), moved, list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        group, moved = self._route(tensors)
        return self._run(group.allreduce_coalesced(moved.many(tensors, True), opts), moved, list(tensors))

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        group, moved = self._route(tensors)
        return self._run(group.broadcast(moved.many(tensors, True), opts), moved, list(tensors))

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        group, moved = self._route(tensors)
        return self._run(group.reduce(moved.many(tensors, True), opts), moved, list(tensors))

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        group, moved = self._route([*inputs, *(t for ts in output_lists for t in ts)])
        work = group.allgather(moved.nested(output_lists, True, read=False), moved.many(inputs, False), opts)
        return self._run(work, moved, [list(ts) for ts in output_lists])

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        group, moved = self._route([input, output])
        work = group._allgather_base(moved.one(output, True, read=False), moved.one(input, False), opts)
        return self._run(work, moved, [output])

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        group, moved = self._route([*inputs, *(t for ts in output_lists for t in ts)])
        work = group.allgather_coalesced(moved.nested(output_lists, True, read=False), moved.many(inputs, False), opts)
        return self._run(work, moved, [list(ts) for ts in output_lists])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self.all_gather_single(output, input, opts)
        return _done(list(outputs))

    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        group, moved = self._route([*inputs, *(t for ts in output_lists for t in ts)])
        work = group.gather(moved.nested(output_lists, True, read=False), moved.many(inputs, False), opts)
        return self._run(work, moved, [list(ts) for ts in output_lists])

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        group, moved = self._route([*outputs, *(t for ts in input_lists for t in ts)])
        work = group.scatter(moved.many(outputs, True, read=False), moved.nested(input_lists, False), opts)
        return self._run(work, moved, list(outputs))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        group, moved = self._route([*outputs, *(t for ts in input_lists for t in ts)])
        work = group.reduce_scatter(moved.many(outputs, True, read=False), moved.nested(input_lists, False), opts)
        return self._run(work, moved, list(outputs))

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        group, moved = self._route([output, input])
        work = group._reduce_scatter_base(moved.one(output, True, read=False), moved.one(input, False), opts)
        return self._run(work, moved, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(output, input, opts)
        return _done(list(outputs))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        group, moved = self._route([output, input])
        work = group.alltoall_base(moved.one(output, True, read=False), moved.one(input, False),
                                   output_split_sizes, input_split_sizes, opts)
        return self._run(work, moved, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        group, moved = self._route([*outputs, *inputs])
        work = group.alltoall(moved.many(outputs, True, read=False), moved.many(inputs, False), opts)
        return self._run(work, moved, list(outputs))

    def send(self, tensors, dst: int, tag: int = 0):
        group, moved = self._route(tensors)
        return self._run(group.send(moved.many(tensors, False), dst, tag), moved, list(tensors))

    def recv(self, tensors, src: int, tag: int = 0):
        group, moved = self._route(tensors)
        return self._run(group.recv(moved.many(tensors, True, read=False), src, tag), moved, list(tensors))

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        work = self._host.barrier(opts)
        work.wait()
        return _done([])

    # -- what torch.distributed asks of a group --------------------------------------------
    def size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return BACKEND

    # PyTorch keeps a group's name on its C++ backends, which a group made in Python has none
    # of: `group_name` raised "ProcessGroup name not set", and with it DeviceMesh (DTensor,
    # FSDP2) and the functional collectives, which find a group by its name.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_name", None)
        if name is None:
            raise RuntimeError("ProcessGroup name not set")
        return name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_desc", "undefined")

    def _get_backend(self, device):
        """The chip's group for flagos (and its payload device), gloo for the host: what
        init_process_group(device_id=...) and PyTorch's helpers ask a group for."""
        kind = torch.device(device).type
        if kind == "flagos":
            return self._BackendView(self._chip if self.payload_type else self._host)
        return self._chip if kind == self.payload_type else self._host

    class _BackendView:
        """A chip-side backend as seen for flagos tensors: it cannot connect eagerly to a flagos
        device (init_process_group(device_id=flagos:N) asks), as gloo cannot to any device."""

        supports_splitting = False

        def __init__(self, backend):
            self._backend = backend

        def __getattr__(self, name):
            return getattr(self._backend, name)

    @property
    def _device_types(self):
        return [torch.device("flagos"), torch.device("cpu")]  # object collectives: on the host

    def __repr__(self) -> str:
        return (f"FlagosProcessGroup(rank={self._rank}, world_size={self._world_size}, "
                f"through={self.chip_backend if self.payload_type else 'gloo'})")

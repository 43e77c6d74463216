"""A pipeline per device, in one call: `PipelinePool`, one worker process per device.

    from flagos.parallel import PipelinePool

    def build(device):                      # runs in each worker; device is its flagos:0
        return make_pipeline().to(device)

    def run(pipe, seed):                    # runs in a worker for each item
        return pipe(generator=torch.Generator("cpu").manual_seed(seed)).images[0]

    with PipelinePool(build, devices="all", chip="sim") as pool:
        images = pool.map(run, range(8))    # in input order

The one-machine convenience over torch.multiprocessing (spawn), with no scheduler beyond it:
each worker sees only its device, as `flagos:0` (so backward works in every worker: autograd
has a queue for flagos:0 only, docs/parallel.md), builds its pipeline once and serves one
request at a time; `map` hands each idle worker the next request. `build` and `fn` are pickled
by reference: define them at module level. Results come back pickled, every tensor in them
moved to the CPU and detached, whatever holds it.
"""
from __future__ import annotations

import atexit
import os
import signal
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp

from . import _activation
from .chips.adapter import AdapterChip
from .core import _state
from .errors import ConfigError

# How a torch-native chip shows a process some of its devices (the vendor's variable, read by its
# runtime when it starts). cuda and sim are the ones checked here; the others follow the vendors'
# documentation and are not validated on hardware. mps has one device; the host (cpu) is shared.
VISIBLE_VARIABLE = {
    "cuda": "CUDA_VISIBLE_DEVICES",         # NVIDIA; ROCm builds are said to honour it too (unverified)
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
    "mlu": "MLU_VISIBLE_DEVICES",
    "musa": "MUSA_VISIBLE_DEVICES",
    "xpu": "ZE_AFFINITY_MASK",
}
# C-ABI adapters (sim among them) are asked to honour this one, as a driver honours its own.
ADAPTER_VISIBLE_VARIABLE = "FLAGOS_VISIBLE_DEVICES"
# Chips whose work runs on the host's cores: the pool divides the cores among the workers.
HOST_CHIPS = ("cpu", "sim")
CLOSE_GRACE_S = 5.0


class WorkerError(RuntimeError):
    """A worker of a PipelinePool failed: it raised, died, or timed out.

    device: which device the worker served ("sim device 1", "cpu worker 0").
    request: the index of the request in the input of `map` (None when it failed to build).
    worker_traceback: the traceback printed in the worker ("" when the worker died).
    results: when `map` raises it, the whole output: results in input order, and the
    WorkerError of each request that failed in its place.
    """

    def __init__(self, message: str, *, device: str, request: int | None = None,
                 worker_traceback: str = "", results: list | None = None):
        super().__init__(message)
        self.device = device
        self.request = request
        self.worker_traceback = worker_traceback
        self.results = results


@dataclass
class _Worker:
    label: str          # "sim device 1"
    process: object
    conn: object
    job: int | None = None
    started: float = 0.0
    alive: bool = True


def _host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _visible(variable: str, index: int) -> str:
    """The value of `variable` that shows a child the parent's device `index`: the parent's own
    list, when it has one, says which machine device that is."""
    current = os.environ.get(variable, "").strip()
    if current:
        return current.split(",")[index].strip()
    return str(index)


def _host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What unpickles a tensor `_ResultPickler` moved to the host: the tensor itself."""
    return tensor


class _ResultPickler(ForkingPickler):
    """Pickles a worker's result with every tensor in it as a detached CPU tensor, wherever it
    sits (a dict, a namedtuple, a library's output class such as transformers' ModelOutput, an
    object of the user's): the parent need not have flagos active to unpickle it. CPU tensors
    go the way torch.multiprocessing sends them (shared memory)."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or obj.requires_grad):
            return _host_tensor, (obj.detach().cpu(),)
        return NotImplemented


def _serve(conn, build, chip: str, mode, threads, index: int) -> None:
    """The worker: activate flagos on its chip, build once, then answer requests until told
    to stop (None) or until the parent is gone (EOF)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        if threads:
            torch.set_num_threads(threads)
        _activation.activate(chip, mode=mode)
        count = _state.active().device_count
        # The chip shows one device when it honoured the visible-devices variable; an adapter
        # that ignores it shows them all, and the worker uses its own index among them.
        device = _state.device(0 if count == 1 or chip == "cpu" else index)
        obj = build(device)
    except BaseException as e:
        conn.send(("failed", None, f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ready", None, str(device), ""))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job, fn, item = message
        try:
            result = fn(obj, item) if fn is not None else obj(**item)
            conn.send_bytes(_ResultPickler.dumps(("ok", job, result, "")))
        except Exception as e:
            conn.send(("error", job, f"{type(e).__name__}: {e}", traceback.format_exc()))


def _describe_exit(process) -> str:
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class PipelinePool:
    """One worker process per device, each with the pipeline or model `build(device)` made.

    build: a module-level function, called once in each worker with its device (`flagos:0`).
    devices: "all" (every device of the chip; on the cpu chip one worker per core), a number
    of workers (the first N devices; on the cpu chip N workers sharing the host), or a list of
    device indices.
    chip: the chip to activate in the workers; None: the chip flagos is active on in this
    process, else FLAGOS_DEVICE, else "auto". mode: as `flagos.activate`.
    retries: how many times a failed request is tried again on another worker (a worker that
    raised stays in the pool; one that died is gone).
    timeout: seconds a request may take; past it the worker is stopped and the request fails
    (None: no limit; a dead worker is noticed at once either way).
    threads: torch threads per worker; None divides the host's cores among the workers on the
    chips that compute on the host (cpu, sim) and leaves PyTorch's default elsewhere.
    """

    def __init__(self, build, devices="all", *, chip: str | None = None, mode: str | None = None,
                 retries: int = 0, timeout: float | None = None, threads: int | None = None):
        if not callable(build):
            raise ConfigError("PipelinePool(build, ...): build must be a function build(device) "
                              "that returns the pipeline or model (defined at module level)")
        if retries < 0:
            raise ConfigError(f"retries={retries!r}: use 0 or more")
        self.chip, self.mode = self._chip_name(chip), mode
        self.indices = self._indices(devices)
        self.retries, self.timeout = retries, timeout
        if threads is None and self.chip in HOST_CHIPS:
            threads = max(1, _host_cores() // len(self.indices))
        self.threads = threads
        self._workers: list[_Worker] = []
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))
        try:
            self._start(build)
        except BaseException:
            self.close()
            raise

    # ---- choosing the devices --------------------------------------------

    @staticmethod
    def _chip_name(chip: str | None) -> str:
        if chip is None:
            active = _state.active_or_none()
            if active is not None:
                return active.chip.name
            chip = os.environ.get("FLAGOS_DEVICE") or os.environ.get("FLAGOS_DEVICE_BACKEND") or "auto"
        return _activation._pick_chip(chip).name

    def _indices(self, devices) -> list[int]:
        if self.chip == "cpu":
            count = _host_cores()
            if devices == "all":
                return list(range(count))
            if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
                return list(range(devices))
            raise ConfigError(f"devices={devices!r} on the cpu chip: use 'all' (one worker per "
                              f"core, {count} here) or a number of workers, e.g. devices=2")
        count = _activation._pick_chip(self.chip).device_count()
        if devices == "all":
            return list(range(count))
        if isinstance(devices, int) and not isinstance(devices, bool) and 1 <= devices <= count:
            return list(range(devices))
        if (isinstance(devices, (list, tuple)) and devices and len(set(devices)) == len(devices)
                and all(isinstance(i, int) and 0 <= i < count for i in devices)):
            return list(devices)
        raise ConfigError(f"devices={devices!r}: chip {self.chip!r} has {count} device(s) here; use "
                          f"'all', a number from 1 to {count}, or distinct indices from 0 to "
                          f"{count - 1}, e.g. devices=[0, 1]")

    def _label(self, index: int) -> str:
        return f"cpu worker {index}" if self.chip == "cpu" else f"{self.chip} device {index}"

    def _child_env(self, index: int) -> dict:
        """What a worker's environment changes: only its device visible; flagos activated by
        the worker itself, not by autoload at `import torch`."""
        env = {"FLAGOS_DEVICE": None, "FLAGOS_DEVICE_BACKEND": None}
        variable = VISIBLE_VARIABLE.get(self.chip)
        if variable is None and isinstance(_activation._pick_chip(self.chip), AdapterChip):
            variable = ADAPTER_VISIBLE_VARIABLE
        if variable is not None:
            env[variable] = _visible(variable, index)
        return env

    # ---- workers ------------------------------------------------------------

    def _start(self, build) -> None:
        context = mp.get_context("spawn")
        for index in self.indices:
            parent, child = context.Pipe()
            process = context.Process(
                target=_serve, args=(child, build, self.chip, self.mode, self.threads, index),
                name=f"flagos-pool-{self._label(index).replace(' ', '-')}", daemon=True)
            saved = {}
            try:
                for key, value in self._child_env(index).items():
                    saved[key] = os.environ.get(key)
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                process.start()
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            child.close()
            self._workers.append(_Worker(self._label(index), process, parent))
        waiting = {w.conn: w for w in self._workers}
        sentinels = {w.process.sentinel: w for w in self._workers}
        while waiting:
            for ready in wait([*waiting, *(s for s, w in sentinels.items() if w.conn in waiting)]):
                worker = waiting.get(ready) or sentinels[ready]
                if worker.conn not in waiting:
                    continue
                try:
                    kind, _, text, tb = worker.conn.recv()
                except (EOFError, OSError):
                    worker.process.join(1)
                    raise WorkerError(f"flagos.parallel: the worker for {worker.label} "
                                      f"{_describe_exit(worker.process)} before its pipeline was "
                                      f"built", device=worker.label) from None
                if kind == "failed":
                    raise WorkerError(f"flagos.parallel: building the pipeline on {worker.label} "
                                      f"failed: {text}\n--- worker traceback ---\n{tb}",
                                      device=worker.label, worker_traceback=tb)
                del waiting[worker.conn]

    @property
    def devices(self) -> list[str]:
        """The device each live worker serves."""
        return [w.label for w in self._workers if w.alive]

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.alive]

    def __len__(self) -> int:
        return len(self.devices)

    # ---- requests ------------------------------------------------------------

    def map(self, fn_or_kwargs, items=None, *, return_exceptions: bool = False) -> list:
        """Run every request and return the results in input order.

        `map(fn, items)` calls `fn(obj, item)` in a worker for each item (obj: what `build`
        returned); `map(list_of_kwargs)` calls `obj(**kwargs)`. A request that fails (the
        worker raised, died or timed out, after `retries` tries elsewhere) is a WorkerError
        naming the device, with the worker's traceback. The other requests still run. With
        return_exceptions=True the WorkerError stands in the output in the failed request's
        place; otherwise map raises the first one, and its `results` is that whole output.
        """
        if self._closed:
            raise RuntimeError("flagos.parallel: this PipelinePool is closed; make a new one")
        if items is None:
            if callable(fn_or_kwargs):
                raise ConfigError("PipelinePool.map(fn, items): give the items, or call "
                                  "map(list_of_kwargs) to call the built object with each")
            fn, requests = None, list(fn_or_kwargs)
            for kwargs in requests:
                if not isinstance(kwargs, dict):
                    raise ConfigError(f"PipelinePool.map(list_of_kwargs): {kwargs!r} is not a dict; "
                                      f"use map(fn, items) to call fn(obj, item)")
        else:
            fn, requests = fn_or_kwargs, list(items)
        try:
            results = self._run(fn, requests)
        except BaseException:  # Ctrl-C or a broken pipe: no worker outlives the call's owner
            self.close(timeout=0)
            raise
        if not return_exceptions:
            failed = [r for r in results if isinstance(r, WorkerError)]
            if failed:
                first = failed[0]
                first.results = results
                if len(failed) > 1:
                    first.args = (f"{first.args[0]}\n({len(failed) - 1} more request(s) failed: "
                                  f"see .results)",)
                raise first
        return results

    def _run(self, fn, requests: list) -> list:
        pending = list(range(len(requests)))[::-1]  # a stack: pop() gives the lowest index
        results: list = [None] * len(requests)
        tried: dict[int, list] = {i: [] for i in pending}  # devices each failed on
        errors: dict[int, WorkerError] = {}
        done = 0

        def fail(job: int, error: WorkerError, worker: _Worker) -> None:
            nonlocal done
            tried[job].append(worker.label)
            if len(tried[job]) <= self.retries and any(w.alive for w in self._workers):
                pending.append(job)
                errors[job] = error
            else:
                results[job] = error
                done += 1

        while done < len(requests):
            live = [w for w in self._workers if w.alive]
            if not live:
                for job in pending:
                    results[job] = errors.get(job) or WorkerError(
                        f"flagos.parallel: request {job} was not served: every worker is gone",
                        device="", request=job)
                    done += 1
                pending.clear()
                break
            for worker in live:  # hand out work: the lowest pending request this worker has not
                if worker.job is not None or not pending:  # failed; a retry on the same worker
                    continue                               # only when no other can take it
                job = next((j for j in reversed(pending) if worker.label not in tried[j]), None)
                if job is None:
                    others = [w.label for w in live if w is not worker]
                    if any(label not in tried[j] for j in pending for label in others):
                        continue
                    job = pending[-1]
                pending.remove(job)
                worker.conn.send((job, fn, requests[job]))
                worker.job, worker.started = job, time.monotonic()
            busy = [w for w in live if w.job is not None]
            if not busy:  # every idle worker got a request while any were pending
                raise AssertionError(f"flagos.parallel: {len(requests) - done} request(s) "
                                     f"neither pending nor running")
            wait_s = None
            if self.timeout is not None:
                wait_s = max(0.0, min(w.started + self.timeout for w in busy) - time.monotonic())
            ready = set(wait([*(w.conn for w in busy), *(w.process.sentinel for w in busy)], wait_s))
            for worker in busy:
                job = worker.job
                if worker.conn in ready:
                    try:
                        kind, _, value, tb = worker.conn.recv()
                    except (EOFError, OSError):
                        kind = "died"
                    if kind == "ok":
                        results[job], worker.job = value, None
                        errors.pop(job, None)
                        done += 1
                        continue
                    if kind == "error":
                        worker.job = None
                        fail(job, WorkerError(
                            f"flagos.parallel: request {job} failed on {worker.label}: {value}\n"
                            f"--- worker traceback ---\n{tb}",
                            device=worker.label, request=job, worker_traceback=tb), worker)
                        continue
                elif worker.process.sentinel not in ready:
                    if self.timeout is None or time.monotonic() < worker.started + self.timeout:
                        continue
                    self._stop(worker)
                    fail(job, WorkerError(
                        f"flagos.parallel: request {job} on {worker.label} took more than "
                        f"timeout={self.timeout} s; that worker was stopped",
                        device=worker.label, request=job), worker)
                    continue
                # the worker is gone
                worker.process.join(1)
                self._stop(worker)
                fail(job, WorkerError(
                    f"flagos.parallel: the worker for {worker.label} {_describe_exit(worker.process)} "
                    f"while serving request {job}; that device is out of the pool (the other "
                    f"workers go on)", device=worker.label, request=job), worker)
        return results

    # ---- closing --------------------------------------------------------------

    def _stop(self, worker: _Worker, timeout: float = 0.0) -> None:
        worker.alive, worker.job = False, None
        process = worker.process
        if process.is_alive() and timeout:
            process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(1)
        if process.is_alive():
            process.kill()
            process.join(1)
        worker.conn.close()

    def close(self, timeout: float = CLOSE_GRACE_S) -> None:
        """Stop every worker (freeing its device) and wait for it; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            if worker.alive and worker.job is None and timeout:
                try:
                    worker.conn.send(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            if worker.alive:
                self._stop(worker, max(0.0, deadline - time.monotonic()))
            elif worker.process.is_alive():  # only possible if _stop itself was interrupted
                worker.process.kill()
                worker.process.join(1)

    def __enter__(self) -> PipelinePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close(timeout=CLOSE_GRACE_S if exc[0] is None else 0)

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close(timeout=0)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} worker(s): {', '.join(self.devices)}"
        return f"<flagos.parallel.PipelinePool chip={self.chip} {state}>"


def _close_at_exit(ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close(timeout=0)


__all__ = ["PipelinePool", "WorkerError"]

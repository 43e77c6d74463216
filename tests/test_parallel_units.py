"""flagos.parallel.PipelinePool's decisions, each checked exactly and fast: which devices a pool
takes, what each worker's environment shows it, how requests are handed out, retried, timed out
and failed, how the pool closes. The workers here are threads in this process behind real pipes
(their "process" ends when the thread does), so a test can script what each worker does with
each request. test_parallel.py runs real worker processes on cpu and sim."""
import gc
import itertools
import os
import pickle
import re
import signal
import sys
import threading
from collections import OrderedDict, namedtuple
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest
import torch
from conftest import device_mode_only

import flagos
from flagos import parallel
from flagos.chips.adapter import AdapterChip
from flagos.parallel import PipelinePool, WorkerError

_pids = itertools.count(90000)


def noop(obj, item):
    """What the tests pass as `fn`: the fake workers act on their script, not on it."""


class FakeProcess:
    """A worker that is a thread: it answers each request as `script(label, job, item, attempt)`
    says: ("ok", value), ("error", words), "die" (exit by SIGKILL), "hang" (until stopped) or
    "stuck" (a hang that ignores SIGTERM: only SIGKILL ends it).
    Its sentinel is a pipe's read end, ready once the worker has ended, as a process's is."""

    def __init__(self, label, conn, script, ready=("ready", None, "flagos:0", ""), stop_takes=0.0):
        self.label, self.pid, self.exitcode = label, next(_pids), None
        self._stop_takes = stop_takes   # seconds a stop takes (a real worker frees its device)
        self.sentinel, self._alive_fd = os.pipe()
        self._conn, self._script, self._ready = conn, script, ready
        self._stopped = threading.Event()
        self._ignores_sigterm = False
        self.requests, self.got_stop, self.calls = [], False, []   # calls: join and terminate
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self):
        self._thread.start()

    def _serve(self):
        if self._ready is None:   # dies while building
            self.exitcode = -signal.SIGKILL
            self._conn.close()
            os.close(self._alive_fd)
            return
        self._conn.send(self._ready)
        while not self._stopped.is_set():
            try:
                if not self._conn.poll(0.02):   # a stop is seen between polls
                    continue
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message is None:
                self.got_stop = True
                self._stopped.wait(self._stop_takes)   # a SIGTERM meanwhile is its exit code
                if self.exitcode is None:
                    self.exitcode = 0
                break
            job, fn, item = message
            self.requests.append(job)
            outcome = self._script(self.label, job, item, self.requests.count(job))
            if outcome == "die":
                self.exitcode = -signal.SIGKILL
                break
            if outcome in ("hang", "stuck"):
                self._ignores_sigterm = outcome == "stuck"
                self._stopped.wait()
                break
            kind, value = outcome
            self._conn.send((kind, job, value, f"traceback of {job}" if kind == "error" else ""))
        self._conn.close()
        os.close(self._alive_fd)

    def is_alive(self):
        return self._thread.is_alive()

    def join(self, timeout=None):
        self.calls.append(("join", timeout))
        self._thread.join(timeout)

    def terminate(self):
        self.calls.append(("terminate",))
        if self._ignores_sigterm:
            return
        if self.exitcode is None:
            self.exitcode = -signal.SIGTERM
        self._stopped.set()

    def kill(self):
        self.calls.append(("kill",))
        if self.exitcode is None:
            self.exitcode = -signal.SIGKILL
        self._stopped.set()


def serve_all(label, job, item, attempt):
    return ("ok", (label, item))


class ThreeDevices(AdapterChip):
    """An adapter chip with three devices, whatever this machine has."""

    def device_count(self):
        return 3


@pytest.fixture
def fake_pool():
    """fake_pool(n, script, retries=, timeout=): a started pool of n fake workers."""
    made = []

    def make(n, script=serve_all, *, retries=0, timeout=None, chip="sim", stop_takes=0.0):
        pool = PipelinePool.__new__(PipelinePool)
        pool.chip, pool.mode, pool.indices = chip, None, list(range(n))
        pool.retries, pool.timeout, pool.threads = retries, timeout, 1
        pool._workers, pool._closed = [], False
        for index in range(n):
            parent_conn, child_conn = Pipe()
            process = FakeProcess(f"fake {index}", child_conn, script, stop_takes=stop_takes)
            process.start()
            parent_conn.recv()   # its "ready"
            pool._workers.append(parallel._Worker(process.label, process, parent_conn))
        made.append(pool._workers)   # not the pool: a test may let it be collected
        return pool

    yield make
    for workers in made:
        for worker in workers:
            worker.process.terminate()
            worker.process.join(5)
            worker.conn.close()
            os.close(worker.process.sentinel)


def processes(pool):
    return [w.process for w in pool._workers]


# ---- handing out requests ---------------------------------------------------------------

def test_each_idle_worker_takes_the_lowest_pending_request(fake_pool):
    pool = fake_pool(2)
    out = pool.map(noop, ["a", "b", "c", "d", "e"])
    assert [item for _, item in out] == ["a", "b", "c", "d", "e"]   # in input order
    first, second = processes(pool)
    # the first two requests go to the two workers at once, in order; each request runs once
    assert (first.requests[0], second.requests[0]) == (0, 1)
    assert sorted(first.requests + second.requests) == [0, 1, 2, 3, 4]
    assert [label for label, _ in out[:2]] == ["fake 0", "fake 1"]


def test_a_busy_worker_does_not_hold_back_an_idle_one(fake_pool):
    """Worker 0's request waits until worker 1 has served every other: it must be handed them
    while worker 0 is busy (worker 0 gives up after 10 s and says so)."""
    others_done = threading.Event()

    def script(label, job, item, attempt):
        if label == "fake 0":
            return ("ok", ("fake 0", others_done.wait(10)))
        if job == 3:
            others_done.set()
        return ("ok", (label, item))

    pool = fake_pool(2, script)
    assert pool.map(noop, ["a", "b", "c", "d"]) == [("fake 0", True), ("fake 1", "b"),
                                                     ("fake 1", "c"), ("fake 1", "d")]


def test_a_pool_with_a_timeout_waits_for_its_workers_without_polling(fake_pool, monkeypatch):
    """A 0.5 s request under a 60 s timeout: map sleeps in `wait` until the answer comes (a
    handful of calls), not in a loop of zero-second waits."""
    def script(label, job, item, attempt):
        threading.Event().wait(0.5)
        return ("ok", item)

    pool = fake_pool(1, script, timeout=60.0)
    timeouts, real_wait = [], parallel.wait
    monkeypatch.setattr(parallel, "wait", lambda objects, timeout=None: (
        timeouts.append(timeout), real_wait(objects, timeout))[1])
    assert pool.map(noop, ["a"]) == ["a"]
    assert 1 <= len(timeouts) <= 3 and all(55.0 < t <= 60.0 for t in timeouts), timeouts


def test_a_timeout_counts_from_each_requests_own_start(fake_pool):
    """Under a 30 s timeout a 1 s request is served while the other worker's answers arrive."""
    def script(label, job, item, attempt):
        if label == "fake 0":
            threading.Event().wait(1.0)
        return ("ok", (label, item))

    pool = fake_pool(2, script, timeout=30.0)
    assert pool.map(noop, ["a", "b", "c", "d"]) == [("fake 0", "a"), ("fake 1", "b"),
                                                     ("fake 1", "c"), ("fake 1", "d")]
    assert pool.devices == ["fake 0", "fake 1"]


def test_a_list_of_kwargs_is_sent_as_the_request(fake_pool):
    pool = fake_pool(1)
    assert pool.map([{"seed": 1}, {"seed": 2}]) == [("fake 0", {"seed": 1}), ("fake 0", {"seed": 2})]
    assert pool.map(noop, []) == []
    assert pool.map(noop, items=["x"]) == [("fake 0", "x")]   # items by name too
    with pytest.raises(TypeError):
        pool.map(noop, ["x"], True)   # return_exceptions is keyword-only


def failing_on(labels, jobs=None, times=None):
    """A script that raises on the workers `labels` (for `jobs`, its first `times` tries)."""
    def script(label, job, item, attempt):
        if label in labels and (jobs is None or job in jobs) and (times is None or attempt <= times):
            return ("error", f"ValueError: no {item} on {label}")
        return ("ok", (label, item))
    return script


def test_a_failed_request_is_retried_on_another_worker_first(fake_pool):
    pool = fake_pool(2, failing_on({"fake 0"}), retries=1)
    assert [label for label, _ in pool.map(noop, range(6))] == ["fake 1"] * 6
    first, second = processes(pool)
    assert first.requests and sorted(second.requests) == list(range(6))
    # no request went back to the worker that failed it
    assert len(first.requests) == len(set(first.requests))


def test_without_retries_a_failed_request_is_a_worker_error_in_its_place(fake_pool):
    pool = fake_pool(1, failing_on({"fake 0"}, jobs={1, 3}))
    out = pool.map(noop, ["a", "b", "c", "d"], return_exceptions=True)
    assert out[0] == ("fake 0", "a") and out[2] == ("fake 0", "c")
    for job, item in ((1, "b"), (3, "d")):
        error = out[job]
        assert isinstance(error, WorkerError)
        assert (error.request, error.device, error.worker_traceback) == (job, "fake 0", f"traceback of {job}")
        assert str(error) == (f"flagos.parallel: request {job} failed on fake 0: ValueError: no {item} "
                              f"on fake 0\n--- worker traceback ---\ntraceback of {job}")
    with pytest.raises(WorkerError) as raised:
        pool.map(noop, ["a", "b", "c", "d"])
    first = raised.value
    assert first.request == 1 and first.results[1] is first and isinstance(first.results[3], WorkerError)
    assert str(first).endswith("traceback of 1\n(1 more request(s) failed: see .results)")
    with pytest.raises(WorkerError) as raised:
        pool.map(noop, ["a", "b"])
    assert str(raised.value).endswith("traceback of 1")   # one failure: no count
    assert len(pool) == 1    # a worker that raised stays


@pytest.mark.parametrize("retries, served", [(0, False), (1, False), (2, True), (3, True)])
def test_a_lone_worker_retries_on_itself_as_many_times_as_allowed(fake_pool, retries, served):
    pool = fake_pool(1, failing_on({"fake 0"}, jobs={0}, times=2), retries=retries)
    out = pool.map(noop, ["a"], return_exceptions=True)
    (only,) = processes(pool)
    assert only.requests == [0] * min(retries + 1, 3)
    assert (out[0] == ("fake 0", "a")) is served


def dying_on(label, job_to_die):
    def script(who, job, item, attempt):
        return "die" if (who, job) == (label, job_to_die) else ("ok", (who, item))
    return script


def test_a_worker_that_dies_leaves_the_pool_and_the_others_go_on(fake_pool):
    pool = fake_pool(2, dying_on("fake 0", 0))
    out = pool.map(noop, ["a", "b", "c"], return_exceptions=True)
    assert str(out[0]) == ("flagos.parallel: the worker for fake 0 was killed by SIGKILL while serving "
                           "request 0; that device is out of the pool (the other workers go on)")
    assert (out[0].device, out[0].request) == ("fake 0", 0)
    assert out[1:] == [("fake 1", "b"), ("fake 1", "c")]
    assert pool.devices == ["fake 1"] and len(pool) == 1 and pool.pids == [processes(pool)[1].pid]


def test_a_request_whose_worker_died_is_retried_elsewhere(fake_pool):
    pool = fake_pool(2, dying_on("fake 0", 0), retries=1)
    assert pool.map(noop, ["a", "b"]) == [("fake 1", "a"), ("fake 1", "b")]


def test_when_every_worker_is_gone_the_rest_is_not_served(fake_pool):
    pool = fake_pool(1, dying_on("fake 0", 1), retries=3)
    out = pool.map(noop, ["a", "b", "c"], return_exceptions=True)
    assert out[0] == ("fake 0", "a")
    assert "was killed by SIGKILL while serving request 1" in str(out[1])   # nowhere to retry
    assert str(out[2]) == "flagos.parallel: request 2 was not served: every worker is gone"
    assert (out[2].request, out[2].device) == (2, "")
    assert pool.map(noop, ["x"], return_exceptions=True)[0].request == 0


def test_a_request_waiting_for_its_retry_keeps_its_error_when_the_pool_empties(fake_pool):
    """Request 0 fails on worker 0 and waits for worker 1 (retries=1); worker 1 dies serving
    request 1, then worker 0 dies serving it: request 0 fails with its own error."""
    def script(label, job, item, attempt):
        if (label, job) == ("fake 0", 0):
            return ("error", "ValueError: not here")
        if job == 1:
            return "die"
        return ("ok", (label, item))
    pool = fake_pool(2, script, retries=1)
    out = pool.map(noop, ["a", "b"], return_exceptions=True)
    assert str(out[0]).startswith("flagos.parallel: request 0 failed on fake 0: ValueError: not here")
    assert "while serving request 1" in str(out[1]) and pool.devices == []


def test_a_request_past_the_timeout_stops_its_worker(fake_pool):
    def script(label, job, item, attempt):
        return "hang" if (label, job) == ("fake 0", 0) else ("ok", (label, item))
    pool = fake_pool(2, script, timeout=2.0)
    out = pool.map(noop, ["a", "b", "c"], return_exceptions=True)
    assert str(out[0]) == ("flagos.parallel: request 0 on fake 0 took more than timeout=2.0 s; "
                           "that worker was stopped")
    assert out[1:] == [("fake 1", "b"), ("fake 1", "c")]
    stopped = processes(pool)[0]
    assert stopped.exitcode == -signal.SIGTERM and not stopped.is_alive()
    assert stopped.calls[0] == ("terminate",)   # stopped at once, not waited for first
    assert pool.devices == ["fake 1"]


def test_a_timed_out_worker_that_ignores_sigterm_is_killed(fake_pool):
    def script(label, job, item, attempt):
        return "stuck" if job == 0 else ("ok", (label, item))
    pool = fake_pool(2, script, timeout=1.0)
    out = pool.map(noop, ["a", "b"], return_exceptions=True)
    assert "took more than timeout=1.0 s" in str(out[0]) and out[1] == ("fake 1", "b")
    stuck = processes(pool)[0]
    assert stuck.calls == [("terminate",), ("join", 1), ("kill",), ("join", 1)]
    assert stuck.exitcode == -signal.SIGKILL and not stuck.is_alive()


# ---- closing --------------------------------------------------------------------------

def record_stop_graces(pool, monkeypatch):
    """The grace period each `_stop` call is given, in order; the stops themselves still run."""
    given, stop = [], pool._stop

    def recording_stop(worker, timeout=0.0):
        given.append(timeout)
        return stop(worker, timeout)

    monkeypatch.setattr(pool, "_stop", recording_stop)
    return given


def test_close_asks_idle_workers_to_stop_and_stops_the_rest(fake_pool):
    pool = fake_pool(2, stop_takes=0.3)
    pool.close()
    assert [p.got_stop for p in processes(pool)] == [True, True]
    assert [p.exitcode for p in processes(pool)] == [0, 0]
    # waited for (the second ended while the first was), none terminated
    assert processes(pool)[0].calls[0][0] == "join"
    assert [("terminate",) in p.calls for p in processes(pool)] == [False, False]
    assert repr(pool) == "<flagos.parallel.PipelinePool chip=sim closed>"
    pool.close()   # a second close does nothing
    with pytest.raises(RuntimeError, match="this PipelinePool is closed; make a new one"):
        pool.map(noop, [1])


def test_close_gives_the_workers_five_seconds_together(fake_pool, monkeypatch):
    """The grace period is one deadline for all workers (a frozen clock: each gets all of it)."""
    pool = fake_pool(2)
    given = record_stop_graces(pool, monkeypatch)
    monkeypatch.setattr(parallel, "time", SimpleNamespace(monotonic=lambda: 50.0))
    pool.close()
    assert given == [5.0, 5.0] and parallel.CLOSE_GRACE_S == 5.0


def test_close_past_its_deadline_waits_for_no_one(fake_pool, monkeypatch):
    """A clock that jumps past the grace period once it is set: the workers left are stopped
    with no wait at all (not a second each, not a negative wait)."""
    pool = fake_pool(2)
    given = record_stop_graces(pool, monkeypatch)
    clock = iter([50.0])   # parallel's own clock only: the worker threads' waits read the real one
    monkeypatch.setattr(parallel, "time", SimpleNamespace(monotonic=lambda: next(clock, 60.0)))
    pool.close()
    assert given == [0.0, 0.0]


def test_leaving_the_block_on_an_error_stops_the_workers_at_once(fake_pool):
    pool = fake_pool(2)
    assert repr(pool) == "<flagos.parallel.PipelinePool chip=sim 2 worker(s): fake 0, fake 1>"
    with pytest.raises(KeyError):
        with pool:
            raise KeyError("user code")
    assert [p.got_stop for p in processes(pool)] == [False, False]
    assert [p.exitcode for p in processes(pool)] == [-signal.SIGTERM] * 2


def test_an_interrupted_map_stops_every_worker_at_once(fake_pool, monkeypatch):
    """Ctrl-C while map waits: no worker, idle or busy, is asked to stop and waited for."""
    pool = fake_pool(2)
    given = record_stop_graces(pool, monkeypatch)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(parallel, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.map(noop, ["a"])    # one busy worker, one idle
    assert pool._closed and given == [0.0, 0.0]
    assert [p.got_stop for p in processes(pool)] == [False, False]
    assert [p.exitcode for p in processes(pool)] == [-signal.SIGTERM] * 2


def test_close_copes_with_a_worker_gone_unnoticed(fake_pool):
    """A worker that died while idle (its pipe broken): close still stops the others."""
    pool = fake_pool(2)
    first, second = processes(pool)
    first.terminate()
    first.join(5)
    pool.close()
    assert second.got_stop and pool._closed


def test_a_pool_dropped_without_close_stops_its_workers(fake_pool):
    pool = fake_pool(2)
    workers = processes(pool)
    del pool
    gc.collect()
    assert [p.exitcode for p in workers] == [-signal.SIGTERM] * 2


def test_a_pool_that_failed_to_start_is_collected_quietly(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    try:
        PipelinePool("not a function", 1, chip="cpu")
    except flagos.ConfigError:
        pass
    gc.collect()
    assert unraisable == []


def test_the_exit_hook_closes_a_pool_still_open(fake_pool):
    pool = fake_pool(1)
    parallel._close_at_exit(lambda: pool)
    assert pool._closed and processes(pool)[0].exitcode == -signal.SIGTERM
    parallel._close_at_exit(lambda: None)   # a pool already collected


@pytest.mark.parametrize("exitcode, words", [
    (None, "stopped answering"), (-signal.SIGKILL, "was killed by SIGKILL"),
    (-signal.SIGTERM, "was killed by SIGTERM"), (-signal.SIGHUP, "was killed by SIGHUP"),
    (-200, "was killed by signal 200"),
    (0, "exited with status 0"), (3, "exited with status 3")])
def test_how_a_worker_ended_in_words(exitcode, words):
    assert parallel._describe_exit(SimpleNamespace(exitcode=exitcode)) == words


# ---- starting -----------------------------------------------------------------------

class FakeContext:
    """What `mp.get_context("spawn")` gives `_start`: fake workers that record the environment
    they were started with."""

    def __init__(self, ready_for=lambda index: ("ready", None, "flagos:0", "")):
        self.started, self.ready_for = [], ready_for

    @staticmethod
    def Pipe():
        return Pipe()

    def Process(self, target, args, name, daemon):
        child, build, chip, mode, threads, index = args
        assert target is parallel._serve and daemon
        # the worker's own end of the pipe: the pool closes its copy once the worker started
        own = Connection(os.dup(child.fileno()))
        process = FakeProcess(name, own, serve_all, ready=self.ready_for(index))
        start = process.start

        def start_recording():
            self.started.append((name, index, chip, mode, threads,
                                 {k: os.environ.get(k) for k in
                                  ("FLAGOS_DEVICE", "FLAGOS_DEVICE_BACKEND", "FLAGOS_VISIBLE_DEVICES")}))
            start()
        process.start = start_recording
        return process


def test_each_worker_is_started_seeing_only_its_device(monkeypatch):
    context = FakeContext()
    monkeypatch.setattr(parallel.mp, "get_context", lambda kind: context)
    monkeypatch.setattr(parallel._activation, "_pick_chip", lambda name: ThreeDevices("sim"))
    monkeypatch.setenv("FLAGOS_DEVICE", "sim")
    monkeypatch.setenv("FLAGOS_VISIBLE_DEVICES", "4,6,7")
    monkeypatch.delenv("FLAGOS_DEVICE_BACKEND", raising=False)
    pool = PipelinePool(noop, devices=[2, 0], chip="sim", mode="device", threads=3)
    try:
        assert context.started == [
            ("flagos-pool-sim-device-2", 2, "sim", "device", 3,
             {"FLAGOS_DEVICE": None, "FLAGOS_DEVICE_BACKEND": None, "FLAGOS_VISIBLE_DEVICES": "7"}),
            ("flagos-pool-sim-device-0", 0, "sim", "device", 3,
             {"FLAGOS_DEVICE": None, "FLAGOS_DEVICE_BACKEND": None, "FLAGOS_VISIBLE_DEVICES": "4"})]
        # this process's environment is as it was
        assert (os.environ["FLAGOS_DEVICE"], os.environ["FLAGOS_VISIBLE_DEVICES"]) == ("sim", "4,6,7")
        assert "FLAGOS_DEVICE_BACKEND" not in os.environ
        assert pool.devices == ["sim device 2", "sim device 0"]
        assert pool.map(noop, [5]) == [("flagos-pool-sim-device-2", 5)]
    finally:
        pool.close()


def test_a_build_that_fails_is_reported_and_every_worker_stopped(monkeypatch):
    context = FakeContext(lambda index: ("failed", None, "RuntimeError: no memory", "its traceback")
                          if index == 1 else ("ready", None, "flagos:0", ""))
    monkeypatch.setattr(parallel.mp, "get_context", lambda kind: context)
    monkeypatch.setattr(parallel._activation, "_pick_chip", lambda name: ThreeDevices("sim"))
    with pytest.raises(WorkerError) as raised:
        PipelinePool(noop, devices=2, chip="sim")
    assert str(raised.value) == ("flagos.parallel: building the pipeline on sim device 1 failed: "
                                 "RuntimeError: no memory\n--- worker traceback ---\nits traceback")
    assert (raised.value.device, raised.value.request, raised.value.worker_traceback) == \
        ("sim device 1", None, "its traceback")


def test_a_worker_that_dies_while_building_is_reported(monkeypatch):
    context = FakeContext(lambda index: None if index == 0 else ("ready", None, "flagos:0", ""))
    monkeypatch.setattr(parallel.mp, "get_context", lambda kind: context)
    monkeypatch.setattr(parallel._activation, "_pick_chip", lambda name: ThreeDevices("sim"))
    with pytest.raises(WorkerError) as raised:
        PipelinePool(noop, devices=[0, 2], chip="sim")
    assert str(raised.value) == ("flagos.parallel: the worker for sim device 0 was killed by SIGKILL "
                                 "before its pipeline was built")
    assert (raised.value.device, raised.value.request, raised.value.worker_traceback) == ("sim device 0", None, "")


# ---- the devices a pool takes --------------------------------------------------------

@pytest.fixture
def three_devices(monkeypatch):
    monkeypatch.setattr(parallel._activation, "_pick_chip", lambda name: ThreeDevices("sim"))
    pool = PipelinePool.__new__(PipelinePool)
    pool.chip = "sim"
    return pool


@pytest.mark.parametrize("devices, indices", [
    ("all", [0, 1, 2]), (1, [0]), (3, [0, 1, 2]), ([2], [2]), ([2, 0], [2, 0]), ((1, 2), [1, 2])])
def test_the_devices_a_pool_takes(three_devices, devices, indices):
    assert three_devices._indices(devices) == indices


@pytest.mark.parametrize("devices", [0, 4, -1, True, [], [3], [-1], [0, 0], ["0"], [0.0], "0", None])
def test_devices_the_chip_does_not_have_are_refused_with_the_choices(three_devices, devices):
    with pytest.raises(flagos.ConfigError) as refused:
        three_devices._indices(devices)
    assert str(refused.value) == (f"devices={devices!r}: chip 'sim' has 3 device(s) here; use 'all', a "
                                  f"number from 1 to 3, or distinct indices from 0 to 2, e.g. devices=[0, 1]")


def test_on_the_cpu_chip_a_pool_takes_workers_not_devices(monkeypatch):
    monkeypatch.setattr(parallel, "_host_cores", lambda: 4)
    pool = PipelinePool.__new__(PipelinePool)
    pool.chip = "cpu"
    assert (pool._indices("all"), pool._indices(1), pool._indices(6)) == ([0, 1, 2, 3], [0], list(range(6)))
    for devices in (0, True, [0], "2"):
        with pytest.raises(flagos.ConfigError, match=rf"^devices={re.escape(repr(devices))} on the cpu chip: use 'all' "
                                                      r"\(one worker per core, 4 here\)"):
            pool._indices(devices)
    assert pool._label(1) == "cpu worker 1" and pool._child_env(1) == \
        {"FLAGOS_DEVICE": None, "FLAGOS_DEVICE_BACKEND": None}


def test_the_host_cores_are_those_this_process_may_run_on(monkeypatch):
    assert parallel._host_cores() == len(os.sched_getaffinity(0))
    # this process's own set (pid 0), not another's
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 2, 5} if pid == 0 else {0})
    assert parallel._host_cores() == 3
    # where there is no affinity (not Linux): every core, or 1 when even that is unknown
    monkeypatch.delattr(parallel.os, "sched_getaffinity")
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: 6)
    assert parallel._host_cores() == 6
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: None)
    assert parallel._host_cores() == 1


@pytest.mark.parametrize("chip, cores, devices, threads", [
    ("cpu", 8, 2, 4), ("cpu", 8, 3, 2), ("cpu", 2, 4, 1), ("sim", 8, 1, 8), ("npu", 8, 2, None)])
def test_threads_divide_the_host_cores_on_chips_that_compute_on_the_host(monkeypatch, chip, cores,
                                                                        devices, threads):
    monkeypatch.setattr(parallel, "_host_cores", lambda: cores)
    monkeypatch.setattr(PipelinePool, "_chip_name", staticmethod(lambda name: name))
    monkeypatch.setattr(PipelinePool, "_indices", lambda self, n: list(range(n)))
    monkeypatch.setattr(PipelinePool, "_start", lambda self, build: None)
    pool = PipelinePool(noop, devices, chip=chip)
    assert pool.threads == threads
    assert PipelinePool(noop, devices, chip=chip, threads=5).threads == 5
    pool.close()


def test_bad_build_or_retries_are_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(PipelinePool, "_start", lambda self, build: pytest.fail("started"))
    with pytest.raises(flagos.ConfigError, match="build must be a function build"):
        PipelinePool("not callable", 1, chip="cpu")
    with pytest.raises(flagos.ConfigError, match=r"^retries=-1: use 0 or more$"):
        PipelinePool(noop, 1, chip="cpu", retries=-1)


def test_the_variable_that_shows_a_worker_its_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert parallel._visible("CUDA_VISIBLE_DEVICES", 1) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 3, 5 ,9")
    assert [parallel._visible("CUDA_VISIBLE_DEVICES", i) for i in range(3)] == ["3", "5", "9"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " ")
    assert parallel._visible("CUDA_VISIBLE_DEVICES", 2) == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    pool = PipelinePool.__new__(PipelinePool)
    pool.chip = "cuda"
    assert pool._child_env(1) == {"FLAGOS_DEVICE": None, "FLAGOS_DEVICE_BACKEND": None,
                                  "CUDA_VISIBLE_DEVICES": "5"}
    monkeypatch.setattr(parallel._activation, "_pick_chip",
                        lambda name: AdapterChip.__new__(AdapterChip))
    pool.chip = "opencl"
    monkeypatch.delenv("FLAGOS_VISIBLE_DEVICES", raising=False)
    assert pool._child_env(2)["FLAGOS_VISIBLE_DEVICES"] == "2"


def test_the_chip_of_a_pool_without_one_named(monkeypatch):
    monkeypatch.setattr(parallel._state, "active_or_none", lambda: None)
    monkeypatch.setattr(parallel._activation, "_pick_chip", lambda name: SimpleNamespace(name=f"picked {name}"))
    monkeypatch.delenv("FLAGOS_DEVICE", raising=False)
    monkeypatch.delenv("FLAGOS_DEVICE_BACKEND", raising=False)
    assert PipelinePool._chip_name(None) == "picked auto"
    monkeypatch.setenv("FLAGOS_DEVICE_BACKEND", "npu")
    assert PipelinePool._chip_name(None) == "picked npu"
    monkeypatch.setenv("FLAGOS_DEVICE", "mlu")
    assert PipelinePool._chip_name(None) == "picked mlu"
    assert PipelinePool._chip_name("sim") == "picked sim"
    monkeypatch.setattr(parallel._state, "active_or_none",
                        lambda: SimpleNamespace(chip=SimpleNamespace(name="cpu")))
    assert PipelinePool._chip_name(None) == "cpu"


# ---- results --------------------------------------------------------------------------

Pair = namedtuple("Pair", "a b")


class Holder:
    """A user's object holding a tensor."""

    def __init__(self, tensor):
        self.tensor = tensor


@device_mode_only
def test_a_result_comes_back_with_every_tensor_on_the_host_whatever_holds_it():
    """What a worker sends: every tensor detached and on the CPU, inside the containers and
    objects that held it, each of its own type (a plain dict, a namedtuple, an OrderedDict as
    transformers' outputs are, a user's object), so a parent without flagos can read it."""
    device = flagos.device()
    w = torch.ones(2, device=device, requires_grad=True)
    y = w * 3
    on_host = torch.arange(3.0)
    result = {"y": y, "more": [w, (y, 1)], "pair": Pair(y, 2), "ordered": OrderedDict(y=y),
              "held": Holder(y), "host": on_host, "n": 2}
    back = pickle.loads(parallel._ResultPickler.dumps(result))
    moved = (back["y"], back["more"][0], back["more"][1][0], back["pair"].a, back["ordered"]["y"],
             back["held"].tensor, back["host"])
    for t in moved:
        assert type(t) is torch.Tensor and t.device.type == "cpu" and not t.requires_grad
    assert torch.equal(back["y"], torch.full((2,), 3.0)) and torch.equal(back["more"][0], torch.ones(2))
    assert torch.equal(back["host"], on_host) and back["more"][1][1] == 1 and back["n"] == 2
    assert (type(back["pair"]), back["pair"].b, type(back["ordered"]), type(back["held"])) == \
        (Pair, 2, OrderedDict, Holder)
    assert y.device == device and y.requires_grad   # the worker's own tensors are left alone

"""flagos.parallel.PipelinePool: a worker process per device, results in input order equal to
one plain-CPU process with the same seeds, failures that name their device, no process left.

Each pool costs seconds (every worker imports torch), so the tests share one pool per chip."""
import collections
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import device_mode_only

import flagos
from flagos.parallel import PipelinePool, WorkerError

pytestmark = device_mode_only

SEEDS = [11, 3, 7, 5, 2]


class Model:
    """What `build` returns: a seeded linear layer; a call is one training step's gradients."""

    def __init__(self, device):
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(6, 4).to(device)
        self.device = device

    def __call__(self, seed):
        x = torch.randn(3, 6, generator=torch.Generator("cpu").manual_seed(seed)).to(self.device)
        self.layer.zero_grad()
        y = self.layer(x)
        y.square().sum().backward()
        name = flagos.info()["devices"][0] if flagos.core._state.active_or_none() else "cpu"
        return {"y": y, "grad": self.layer.weight.grad, "device": str(self.device), "name": name,
                "pid": os.getpid(), "threads": torch.get_num_threads()}


def build(device):
    return Model(device)


def call(model, seed):
    return model(seed)


def fail_on_device_0(model, seed):
    if os.environ.get("FLAGOS_VISIBLE_DEVICES") == "0":
        raise ValueError(f"seed {seed} refused here")
    return model(seed)


def raise_for_seed(model, seed):
    if seed == 7:
        raise ValueError("seed 7 is not welcome")
    return model(seed)


def kill_for_seed(model, seed):
    if seed == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return model(seed)


Pair = collections.namedtuple("Pair", "y grad")


def call_in_containers(model, seed):
    """The result in containers of other types than dict and list: as a library's output is."""
    out = model(seed)
    return collections.OrderedDict(out=Pair(out["y"], out["grad"]))


def sleep_for(model, seconds):
    time.sleep(seconds)


def build_fails(device):
    raise RuntimeError(f"no pipeline on {device}")


def start(chip, **env):
    """A pool of 2 workers, started with these variables set (the workers inherit them)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return PipelinePool(build, devices=2, chip=chip)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module", params=["cpu", "sim"])
def pool(request):
    p = start(request.param, FLAGOS_SIM_DEVICES="2")
    yield p
    p.close()


def spawned_children() -> set:
    """Processes started by multiprocessing's spawn below this one (not its resource tracker,
    which multiprocessing starts once and keeps)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def expected(seed):
    return Model(torch.device("cpu"))(seed)


def test_results_in_input_order_match_one_cpu_process(pool):
    results = pool.map(call, SEEDS)
    assert [r["device"] for r in results] == ["flagos:0"] * len(SEEDS)
    for seed, got in zip(SEEDS, results):
        want = expected(seed)
        torch.testing.assert_close(got["y"], want["y"])
        torch.testing.assert_close(got["grad"], want["grad"])  # backward ran in the worker
    assert len({r["pid"] for r in results}) == 2  # both workers served
    # each worker runs the threads the pool gave it (the host's cores shared between them)
    assert pool.threads == max(1, len(os.sched_getaffinity(0)) // 2)
    assert {r["threads"] for r in results} == {pool.threads}
    if pool.chip == "sim":  # the first two requests go to the two workers at once
        assert results[0]["name"] == "flagos sim device 0"
        assert results[1]["name"] == "flagos sim device 1"  # its flagos:0, backward included


def test_results_in_any_container_come_back_on_the_host(pool):
    """An OrderedDict of namedtuples (transformers' outputs are OrderedDicts) of flagos tensors:
    the parent gets CPU tensors in the same containers."""
    (got,) = pool.map(call_in_containers, SEEDS[:1])
    assert type(got) is collections.OrderedDict and type(got["out"]) is Pair
    want = expected(SEEDS[0])
    for name in ("y", "grad"):
        t = getattr(got["out"], name)
        assert t.device.type == "cpu" and not t.requires_grad
        torch.testing.assert_close(t, want[name].detach())


def test_list_of_kwargs_calls_the_built_object(pool):
    results = pool.map([{"seed": s} for s in SEEDS[:3]])
    for seed, got in zip(SEEDS, results):
        torch.testing.assert_close(got["y"], expected(seed)["y"])


def test_worker_exception_names_its_device_and_traceback(pool):
    with pytest.raises(WorkerError) as info:
        pool.map(raise_for_seed, SEEDS)
    e = info.value
    assert e.request == 2 and e.device in pool.devices
    assert f"request 2 failed on {e.device}: ValueError: seed 7 is not welcome" in str(e)
    assert "--- worker traceback ---" in str(e) and "in raise_for_seed" in e.worker_traceback
    assert e.results[2] is e  # the other requests still ran
    for i, seed in enumerate(SEEDS):
        if i != 2:
            torch.testing.assert_close(e.results[i]["y"], expected(seed)["y"])
    assert len(pool) == 2  # a worker that raised stays


def test_retry_serves_the_request_on_another_device(pool):
    if pool.chip != "sim":
        pytest.skip("the failing device is told by FLAGOS_VISIBLE_DEVICES, set on C-ABI chips")
    pool.retries = 1
    try:
        results = pool.map(fail_on_device_0, SEEDS)
    finally:
        pool.retries = 0
    assert {r["name"] for r in results} == {"flagos sim device 1"}
    torch.testing.assert_close(results[0]["y"], expected(SEEDS[0])["y"])
    out = pool.map(fail_on_device_0, SEEDS[:2], return_exceptions=True)
    assert isinstance(out[0], WorkerError) and out[0].device == "sim device 0"
    assert out[1]["name"] == "flagos sim device 1"


def test_bad_arguments_are_clear(pool):
    with pytest.raises(flagos.ConfigError, match="give the items"):
        pool.map(call)
    with pytest.raises(flagos.ConfigError, match="is not a dict"):
        pool.map([3])
    with pytest.raises(flagos.ConfigError, match="devices=9"):
        PipelinePool(build, devices=9, chip="sim")


def test_killed_worker_names_its_device_others_come_back_nothing_left():
    pool = start("cpu")
    pids = pool.pids
    try:
        with pytest.raises(WorkerError) as info:
            pool.map(kill_for_seed, SEEDS)
        e = info.value
        assert re.search(r"the worker for cpu worker [01] was killed by SIGKILL while serving "
                         r"request 2", str(e)), str(e)
        assert e.device in ("cpu worker 0", "cpu worker 1") and e.results[2] is e
        for i, seed in enumerate(SEEDS):
            if i != 2:
                torch.testing.assert_close(e.results[i]["y"], expected(seed)["y"])
        assert pool.devices == [d for d in ("cpu worker 0", "cpu worker 1") if d != e.device]
        last = pool.devices[0]
        pool.timeout = 1  # a request that hangs: its worker is stopped, map returns
        out = pool.map(sleep_for, [60, 0], return_exceptions=True)
        assert isinstance(out[0], WorkerError) and out[0].device == last
        assert f"request 0 on {last} took more than timeout=1 s" in str(out[0])
        assert isinstance(out[1], WorkerError) and "every worker is gone" in str(out[1])
        assert pool.devices == []
    finally:
        pool.close()
    pool.close()  # idempotent
    assert not spawned_children() & set(pids)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.map(call, SEEDS)


def test_failed_build_names_the_device_and_leaves_nothing():
    before = spawned_children()
    with pytest.raises(WorkerError) as info:
        PipelinePool(build_fails, devices=[1], chip="sim")
    assert "building the pipeline on sim device 1 failed: RuntimeError: no pipeline on flagos:0" in str(info.value)
    assert "in build_fails" in info.value.worker_traceback
    assert spawned_children() <= before


def test_ctrl_c_stops_the_workers():
    """SIGINT to the parent while map waits: KeyboardInterrupt there, and no worker is left."""
    code = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from flagos.parallel import PipelinePool
import test_parallel
pool = PipelinePool(test_parallel.build, devices=1, chip="cpu")
print("PIDS", *pool.pids, flush=True)
try:
    pool.map(test_parallel.sleep_for, [60])
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
    raise
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    # SIGINT as a terminal gives it, even where the suite runs as a background job (which
    # starts children with SIGINT ignored, and Python then keeps it ignored)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), (line, proc.stderr.read() if proc.poll() is not None else "")
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(1)  # the request is running
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "INTERRUPTED" in out and "KeyboardInterrupt" in err
    assert not any(psutil.pid_exists(pid) for pid in pids)

"""torch.distributed on flagos tensors, two processes each: the "flagos" backend's collectives
against the same collectives on CPU tensors (gloo), DDP for three steps against one process over
the same data on plain CPU, and Diffusers' accelerate recipe (examples/distributed_inference.py
under `accelerate launch`) against the same images made on plain CPU.
Runs on the suite's chip (cpu, and sim with FLAGOS_TEST_CHIP=sim): on sim, rank r uses flagos:r
for collectives and inference, and flagos:0 of its own sim for DDP (docs/parallel.md)."""
from __future__ import annotations

import datetime
import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import CHIP, device_mode_only, run_python, runs_once

import flagos
from flagos.integrations import _distributed

pytestmark = [device_mode_only,
              pytest.mark.skipif(not dist.is_available(), reason="this PyTorch has no torch.distributed")]

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORLD = 2
TIMEOUT = 240  # seconds for a whole two-process run; a hang fails the test instead
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def spawn(fn, *args) -> None:
    """Run fn(rank, *args) in WORLD fresh processes; an error in one (its traceback) or a run
    past TIMEOUT fails the test, and no process outlives it."""
    context = mp.start_processes(fn, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                pytest.fail(f"{fn.__name__}: the processes ran past {TIMEOUT} s (a hung collective?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _start(rank: int, store_path: str, chip: str, device_index: int,
           sim_devices: int = WORLD) -> torch.device:
    """Activate flagos on `chip` in this worker and join the flagos process group."""
    os.environ.setdefault("FLAGOS_FALLBACK", "allow")
    os.environ["FLAGOS_SIM_DEVICES"] = str(sim_devices)
    flagos.activate(chip)
    torch.flagos.set_device(device_index)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group(flagos.dist_backend(), store=store, rank=rank, world_size=WORLD,
                            timeout=COLLECTIVE_TIMEOUT)
    assert dist.get_backend() == "flagos"
    return flagos.device()


# ---- the five collectives -------------------------------------------------------------

def _values(rank: int, n: int = 6) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + rank / 4


def _collectives(rank: int, dev, group=None) -> dict[str, torch.Tensor]:
    """all_reduce, all_gather, broadcast, reduce_scatter, barrier (and their tensor forms) on
    tensors of `dev`, through `group`; the results as host tensors. In-place results are
    checked to be the caller's own tensor objects."""
    out = {}
    t = _values(rank).to(dev)
    same = t
    dist.all_reduce(t, group=group)
    assert t is same
    out["all_reduce"] = t
    m = _values(rank, 8).to(dev).reshape(2, 4).t()  # not contiguous: the result lands in the view
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    out["all_reduce_max_strided"] = m
    gathered = [torch.empty(6, device=dev) for _ in range(WORLD)]
    dist.all_gather(gathered, _values(rank).to(dev), group=group)
    out["all_gather"] = torch.stack(gathered)
    flat = torch.empty(WORLD * 6, device=dev)
    dist.all_gather_into_tensor(flat, _values(rank).to(dev), group=group)
    out["all_gather_into_tensor"] = flat
    b = _values(rank).to(dev)
    work = dist.broadcast(b, src=1, group=group, async_op=True)
    work.wait()
    out["broadcast"] = b
    r = torch.empty(3, device=dev)
    dist.reduce_scatter(r, [_values(rank, 3).to(dev) + i for i in range(WORLD)], group=group)
    out["reduce_scatter"] = r
    r_max = torch.empty(3, device=dev)
    dist.reduce_scatter(r_max, [-_values(rank, 3).to(dev) * (i + 1) for i in range(WORLD)],
                        op=dist.ReduceOp.MAX, group=group)
    out["reduce_scatter_max"] = r_max
    rt = torch.empty(3, device=dev)
    dist.reduce_scatter_tensor(rt, _values(rank).to(dev), group=group)
    out["reduce_scatter_tensor"] = rt
    pair = [_values(rank, 4).to(dev), -_values(rank, 2).to(dev)]
    with warnings.catch_warnings():  # PyTorch marks the coalesced form as going away
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced(pair, op=dist.ReduceOp.MAX, group=group)
    out["all_reduce_coalesced_max"] = torch.cat(pair)
    # the coalesced forms (FSDP-style code): one call per kind for a list of tensors
    firsts, seconds = torch.empty(WORLD * 2, device=dev), torch.empty(WORLD * 3, device=dev)
    with dist._coalescing_manager(group=group):
        dist.all_gather_into_tensor(firsts, _values(rank, 2).to(dev), group=group)
        dist.all_gather_into_tensor(seconds, -_values(rank, 3).to(dev), group=group)
    out["all_gather_into_tensor_coalesced"] = torch.cat([firsts, seconds])
    halves, thirds = torch.empty(2, device=dev), torch.empty(3, device=dev)
    with dist._coalescing_manager(group=group):
        dist.reduce_scatter_tensor(halves, _values(rank, 2 * WORLD).to(dev), op=dist.ReduceOp.MAX, group=group)
        dist.reduce_scatter_tensor(thirds, -_values(rank, 3 * WORLD).to(dev), op=dist.ReduceOp.MAX, group=group)
    out["reduce_scatter_tensor_coalesced_max"] = torch.cat([halves, thirds])
    lists = [[torch.empty(2, device=dev), torch.empty(3, device=dev)] for _ in range(WORLD)]  # per rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_coalesced(lists, [_values(rank, 2).to(dev), -_values(rank, 3).to(dev)], group=group)
    out["all_gather_coalesced"] = torch.cat([t for ts in lists for t in ts])
    i = torch.tensor([rank + 1, 10 * rank], dtype=torch.int64, device=dev)
    dist.all_reduce(i, group=group)
    out["all_reduce_int64"] = i
    red = _values(rank).to(dev)
    dist.reduce(red, dst=1, group=group)  # to rank 1 (what rank 0's tensor holds after is unspecified)
    out["reduce_to_1"] = red if rank == 1 else torch.zeros(6)
    parts = [torch.empty(2, device=dev) for _ in range(WORLD)]
    dist.all_to_all(parts, list(_values(rank, 2 * WORLD).to(dev).split(2)), group=group)
    out["all_to_all"] = torch.cat(parts)
    single = torch.empty(2 * WORLD, device=dev)
    dist.all_to_all_single(single, _values(rank, 2 * WORLD).to(dev), group=group)
    out["all_to_all_single"] = single
    gathered_at_0 = [torch.empty(6, device=dev) for _ in range(WORLD)] if rank == 0 else None
    dist.gather(_values(rank).to(dev), gathered_at_0, dst=0, group=group)
    out["gather"] = torch.stack(gathered_at_0) if rank == 0 else torch.zeros(WORLD, 6)
    gathered_at_1 = [torch.empty(2, device=dev) for _ in range(WORLD)] if rank == 1 else None
    dist.gather(-_values(rank, 2).to(dev), gathered_at_1, dst=1, group=group)
    out["gather_to_1"] = torch.stack(gathered_at_1) if rank == 1 else torch.zeros(WORLD, 2)
    scattered = torch.empty(6, device=dev)
    dist.scatter(scattered, [_values(1, 6).to(dev) + i for i in range(WORLD)] if rank == 1 else None,
                 src=1, group=group)
    out["scatter"] = scattered
    # point to point with the default tag on both sides: rank 0 sends, rank 1 receives
    message = _values(rank, 4).to(dev) if rank == 0 else torch.empty(4, device=dev)
    if rank == 0:
        version = message._version
        dist.send(message, dst=1, group=group)
        assert message._version == version  # what is sent is only read
    else:
        with flagos.track() as report:
            dist.recv(message, src=0, group=group)
        calls = {row["op"]: sum(row["calls"].values()) for row in report.to_dict()["ops"]}
        assert "aten::_to_copy" not in calls, calls  # a receive buffer is written, never read
    out["send_recv"] = message
    dist.barrier(group=group)
    return {k: v.cpu() for k, v in out.items()}


def _collectives_worker(rank: int, store_path: str, chip: str, result_dir: str) -> None:
    dev = _start(rank, store_path, chip, device_index=rank if chip == "sim" else 0)
    assert dev == torch.device("flagos", rank if chip == "sim" else 0)
    gloo = dist.new_group(backend="gloo")  # the reference: the same collectives on CPU tensors
    on_flagos = _collectives(rank, dev)
    on_cpu = _collectives(rank, torch.device("cpu"), group=gloo)
    objects = [None] * WORLD
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": 0}, {"rank": 1}]
    torch.save({"flagos": on_flagos, "cpu": on_cpu}, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_collectives_match_the_same_on_cpu_tensors(tmp_path):
    spawn(_collectives_worker, str(tmp_path / "store"), CHIP, str(tmp_path))
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["flagos"].keys() == got["cpu"].keys()
        for name, expected in got["cpu"].items():
            torch.testing.assert_close(got["flagos"][name], expected, rtol=0, atol=0, msg=name)
    # and the reference itself is what the collectives mean
    r0, r1 = torch.load(tmp_path / "rank0.pt")["cpu"], torch.load(tmp_path / "rank1.pt")["cpu"]
    torch.testing.assert_close(r0["all_reduce"], _values(0) + _values(1))
    torch.testing.assert_close(r0["broadcast"], _values(1))
    torch.testing.assert_close(r0["all_reduce_coalesced_max"], torch.cat([_values(1, 4), -_values(0, 2)]))
    gathered = torch.cat([_values(0, 2), _values(1, 2), -_values(0, 3), -_values(1, 3)])
    torch.testing.assert_close(r1["all_gather_into_tensor_coalesced"], gathered)
    torch.testing.assert_close(r0["reduce_scatter_tensor_coalesced_max"],
                               torch.cat([_values(1, 4)[:2], -_values(0, 6)[:3]]))
    torch.testing.assert_close(r1["all_gather_coalesced"],
                               torch.cat([_values(0, 2), -_values(0, 3), _values(1, 2), -_values(1, 3)]))
    torch.testing.assert_close(r1["reduce_scatter"], _values(0, 3) + _values(1, 3) + 2)
    torch.testing.assert_close(r1["reduce_to_1"], _values(0) + _values(1))
    torch.testing.assert_close(r1["all_to_all"], torch.cat([_values(0, 4)[2:], _values(1, 4)[2:]]))
    torch.testing.assert_close(r1["scatter"], _values(1, 6) + 1)
    torch.testing.assert_close(r0["gather"], torch.stack([_values(0), _values(1)]))
    torch.testing.assert_close(r1["reduce_scatter_max"], -_values(0, 3) * 2)
    torch.testing.assert_close(r1["gather_to_1"], -torch.stack([_values(0, 2), _values(1, 2)]))
    torch.testing.assert_close(r1["send_recv"], _values(0, 4))


# ---- DDP ---------------------------------------------------------------------------------

STEPS, BATCH = 3, 8


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(STEPS, BATCH, 4, generator=g), torch.randn(STEPS, BATCH, 2, generator=g)


def _train(model, rank: int, world: int, dev) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = _data()
    for step in range(STEPS):
        x, y = xs[step].chunk(world)[rank].to(dev), ys[step].chunk(world)[rank].to(dev)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _ddp_worker(rank: int, store_path: str, chip: str, result_dir: str) -> None:
    # backward runs on flagos:0 only (docs/design.md §15): on sim each process trains on the
    # one device of its own sim (every process has its own sim memory).
    dev = _start(rank, store_path, chip, device_index=0, sim_devices=1)
    model = _model().to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    _train(ddp, rank, WORLD, dev)
    results = {"ddp": {k: v.cpu() for k, v in model.state_dict().items()}}
    # the same through accelerate, as a launcher's process (LOCAL_RANK set) would run it
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD))
    from accelerate import Accelerator

    accelerator = Accelerator()
    assert accelerator.num_processes == WORLD and accelerator.device == dev
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(prepared, torch.nn.parallel.DistributedDataParallel)
    xs, ys = _data()
    for step in range(STEPS):
        x = xs[step].chunk(WORLD)[rank].to(accelerator.device)
        y = ys[step].chunk(WORLD)[rank].to(accelerator.device)
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(prepared(x), y))
        optimizer.step()
    results["accelerate"] = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_three_steps_match_one_process_on_the_whole_data(tmp_path):
    """DDP directly and through accelerate's Accelerator.prepare, each rank on half of every
    batch: both ranks' weights equal one process's on plain CPU over the whole batches."""
    pytest.importorskip("accelerate")
    spawn(_ddp_worker, str(tmp_path / "store"), CHIP, str(tmp_path))
    single = _model()
    _train(single, 0, 1, torch.device("cpu"))
    before = _model().state_dict()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for how in ("ddp", "accelerate"):
            for name, expected in single.state_dict().items():
                assert not torch.equal(expected, before[name]), name  # the steps did change it
                torch.testing.assert_close(got[how][name], expected, rtol=1e-5, atol=1e-6,
                                           msg=f"{how}, rank {rank}: {name}")


# ---- DeviceMesh, DTensor and FSDP2 ---------------------------------------------------------

def _mesh_worker(rank: int, store_path: str, chip: str, result_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dev = _start(rank, store_path, chip, device_index=0, sim_devices=1)
    mesh = init_device_mesh(dev.type, (WORLD,))
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    sharded = distribute_tensor(whole.to(dev), mesh, [Shard(0)])
    results = {"local": sharded.to_local().cpu(),
               "replicated": sharded.redistribute(mesh, [Replicate()]).to_local().cpu(),
               "column_sums": sharded.sum(0).full_tensor().cpu()}
    assert sharded.to_local().device == dev
    # every functional collective's result was waited on (none left registered to the end)
    assert torch._C._distributed_c10d._get_work_registry_size() == 0
    if isinstance(torch.ones(1, device=dev)._payload, torch.Tensor):
        # FSDP2 frees a parameter by resizing its storage to 0: torch-native chips only
        # (docs/design.md §8, "Storages on C-ABI chips")
        from torch.distributed.fsdp import fully_shard

        model = _model().to(dev)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, rank, WORLD, dev)
        results["fsdp"] = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}
    torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_device_mesh_dtensor_and_fsdp2_match_one_process(tmp_path):
    """A DeviceMesh over the flagos group (PyTorch finds a group by its name, which a group
    made in Python kept nowhere: "ProcessGroup name not set"), DTensors sharded, redistributed
    and reduced on it against the tensor they came from (on a C-ABI chip through the host round
    trip, whose collective results are waited on and handed over as plain tensors), and on
    torch-native chips FSDP2
    (`fully_shard`), each rank on half of every batch, against one process on plain CPU over
    the whole batches."""
    spawn(_mesh_worker, str(tmp_path / "store"), CHIP, str(tmp_path))
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    single = _model()
    _train(single, 0, 1, torch.device("cpu"))
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["local"], whole.chunk(WORLD)[rank])
        assert torch.equal(got["replicated"], whole) and torch.equal(got["column_sums"], whole.sum(0))
        if CHIP == "cpu":
            for name, expected in single.named_parameters():
                torch.testing.assert_close(got["fsdp"][name], expected.detach(), rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank}: {name}")


# ---- the accelerate recipe ------------------------------------------------------------

SEEDS = (0, 1, 2, 3)


def _launch(cmd: list[str], env: dict) -> str:
    """Run a launcher (and the processes it starts) to the end; its output. A failure or a run
    past TIMEOUT fails the test, and the whole process group goes with it."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{cmd[2]} ran past {TIMEOUT} s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    return output


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    env.update(FLAGOS_FALLBACK="allow", FLAGOS_SIM_DEVICES=str(WORLD),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), **extra)
    return env


def _example():
    spec = importlib.util.spec_from_file_location(
        "distributed_inference", ROOT / "examples" / "distributed_inference.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_recipe_two_processes_match_one_process(tmp_path):
    """examples/distributed_inference.py (Diffusers' accelerate recipe) under `accelerate
    launch` with 2 processes: each process on its own flagos device, half the seeds each, and
    every image equal to the one plain CPU makes in one process for its seed."""
    pytest.importorskip("accelerate")
    pytest.importorskip("diffusers")
    out = tmp_path / "images"
    # Without a named accelerator accelerate launch starts one process unless told --multi_gpu
    # (docs/parallel.md); the other flags only silence its warning about defaults.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           str(WORLD), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           str(ROOT / "examples" / "distributed_inference.py"), "--device", CHIP,
           "--seeds", ",".join(map(str, SEEDS)), "--steps", "3", "--out", str(out)]
    output = _launch(cmd, _env())
    assert f"2 process(es) on chip {CHIP}, backend flagos" in output, output[-2000:]
    example = _example()
    pipeline = example.build_pipeline()  # plain CPU, one process: the reference
    ranks = {}
    for seed in SEEDS:
        rank, world, device, chip = (out / f"seed_{seed}.txt").read_text().split()
        assert (world, chip) == (str(WORLD), CHIP)
        assert device == f"flagos:{rank if CHIP == 'sim' else 0}", (seed, rank, device)
        ranks.setdefault(rank, []).append(seed)
        expected = example.generate(pipeline, seed, 3)
        np.testing.assert_allclose(np.load(out / f"seed_{seed}.npy"), expected, rtol=1e-4, atol=1e-5)
    assert ranks == {"0": [0, 1], "1": [2, 3]}  # split_between_processes: half each


# Diffusers' torch.distributed recipe ("Distributed inference", PyTorch Distributed section),
# written for CUDA: only the pipeline is this test's small one (and saved as arrays).
TORCH_RECIPE = """
import sys
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed_inference import build_pipeline, generate

sd = build_pipeline()

def run_inference(rank, world_size):
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    sd.to(rank)

    if torch.distributed.get_rank() == 0:
        seed = 0
    elif torch.distributed.get_rank() == 1:
        seed = 1

    image = generate(sd, seed, 3)
    np.save(f"{sys.argv[1]}/seed_{seed}.npy", image)
    with open(f"{sys.argv[1]}/seed_{seed}.txt", "w") as f:
        f.write(f"{sd.device} {dist.get_backend()}")

def main():
    world_size = 2
    mp.spawn(run_inference, args=(world_size,), nprocs=world_size, join=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.skipif(CHIP == "cpu", reason="sd.to(rank) asks for device 1, and the cpu chip has "
                    "one (as a one-GPU machine has): the accelerate recipe is the one for N "
                    "processes on one device")
def test_torch_distributed_recipe_under_the_cuda_redirect(tmp_path):
    """Written for CUDA ("nccl", sd.to(rank)), run with FLAGOS_DEVICE and FLAGOS_REDIRECT_CUDA=1:
    rank r on flagos:r through the flagos backend, images equal to plain CPU's."""
    pytest.importorskip("diffusers")
    if torch.flagos.device_count() < WORLD:  # opencl on PoCL: one CPU device
        pytest.skip(f"sd.to(rank) asks for device {WORLD - 1}, and this {CHIP} machine has "
                    f"{torch.flagos.device_count()}")
    script = tmp_path / "recipe.py"
    script.write_text(TORCH_RECIPE)
    out = tmp_path / "images"
    out.mkdir()
    env = _env(FLAGOS_DEVICE=CHIP, FLAGOS_REDIRECT_CUDA="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples"), env["PYTHONPATH"]])
    _launch([sys.executable, str(script), str(out)], env)
    example = _example()
    pipeline = example.build_pipeline()
    for seed in range(WORLD):
        assert (out / f"seed_{seed}.txt").read_text() == f"flagos:{seed} flagos"
        np.testing.assert_allclose(np.load(out / f"seed_{seed}.npy"), example.generate(pipeline, seed, 3),
                                   rtol=1e-4, atol=1e-5)


# ---- in this process ----------------------------------------------------------------------

def test_dist_backend_names_the_flagos_backend():
    assert flagos.dist_backend() == "flagos"
    assert dist.Backend.default_device_backend_map.get("flagos") == "flagos"
    assert "flagos" in dist.Backend.backend_list


def test_installing_the_backend_again_changes_nothing():
    """Activation registers the backend once per process; asking again (a second activation
    path, a library calling install) neither fails nor registers it twice."""
    before = list(dist.Backend.backend_list)
    _distributed.install()
    _distributed.install()
    assert dist.Backend.backend_list == before and flagos.dist_backend() == "flagos"


def test_native_mode_backend_is_the_chips_own_or_gloo(monkeypatch):
    """In native mode: the chip's collective backend (hccl, cncl, ...), gloo for a chip that
    names none."""
    def backend_of(mode, collective):
        state = types.SimpleNamespace(mode=mode, chip=types.SimpleNamespace(collective_backend=collective))
        monkeypatch.setattr(_distributed._state, "active", lambda: state)
        return _distributed.dist_backend()

    assert backend_of("native", "hccl") == "hccl"
    assert backend_of("native", None) == "gloo"
    assert backend_of("device", "hccl") == "flagos"


def test_payload_route_per_chip():
    """Collectives run on the payloads where the chip's backend serves them, on host copies
    through gloo otherwise."""
    cpu, sim = flagos.chips.profile("cpu"), flagos.chips.profile("sim")
    assert _distributed._payload_route(cpu) == ("gloo", "cpu")
    assert _distributed._payload_route(sim) == ("gloo", None)


def test_payload_route_of_vendor_chips(monkeypatch):
    """A backend flagos can build a group of (gloo, nccl, xccl) for a payload device it serves
    runs on the payloads; a vendor backend flagos cannot build (hccl, cncl), even one
    registered for the device, goes through host copies and gloo's group; a chip that names no
    backend is gloo's."""
    def chip(backend, torch_type):
        return types.SimpleNamespace(collective_backend=backend, torch_type=torch_type)

    monkeypatch.setitem(dist.Backend.backend_capability, "vendorccl", ["flagosfake"])
    monkeypatch.setitem(dist.Backend.backend_capability, "gloo",
                        [*dist.Backend.backend_capability["gloo"], "flagosfake"])
    assert _distributed._payload_route(chip("vendorccl", "flagosfake")) == ("vendorccl", None)
    assert _distributed._payload_route(chip("gloo", "flagosfake")) == ("gloo", "flagosfake")
    assert _distributed._payload_route(chip(None, "cpu")) == ("gloo", "cpu")
    assert _distributed._payload_route(chip("gloo", "meta")) == ("gloo", None)  # not one gloo serves


def test_one_process_group_and_a_hashstore(dev):
    """init_process_group() without a backend picks flagos (PyTorch asks the accelerator), and
    device_id=flagos:0 is accepted."""
    for kwargs in ({}, {"backend": "flagos", "device_id": dev}):
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        try:
            t = torch.arange(4.0, device=dev)
            dist.all_reduce(t)
            assert t.device == dev and t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
            assert isinstance(dist.distributed_c10d._get_default_group(), _distributed.FlagosProcessGroup)
        finally:
            dist.destroy_process_group()


def test_the_group_says_how_its_collectives_run(dev, caplog):
    """The log names the backend the collectives go through and whether they run on the
    payloads (the cpu chip: gloo on its CPU tensors) or on host copies (sim's buffers)."""
    with caplog.at_level("INFO", logger="flagos"):
        dist.init_process_group(backend="flagos", store=dist.HashStore(), rank=0, world_size=1)
        dist.destroy_process_group()
    how = "on the payloads" if CHIP == "cpu" else "on host copies"
    assert f"flagos process group: rank 0 of 1, collectives through gloo ({how})" in caplog.text


def test_the_group_describes_itself_as_pytorchs_own_groups_do(dev):
    """PyTorch names and describes the default group, and its helpers ask a group for its
    backend per device: the flagos group answers as a gloo group does (its description and
    name as strings, gloo itself for host tensors), and for flagos tensors with the chip's."""
    answers = {}
    for backend in ("gloo", "flagos"):
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            answers[backend] = (group.group_desc, group.group_name,
                                type(group._get_backend(torch.device("cpu"))).__name__)
            if backend == "flagos":
                assert group._get_backend(dev) is not group._get_backend(torch.device("cpu"))
        finally:
            dist.destroy_process_group()
    assert answers["flagos"] == answers["gloo"] == ("default_pg", "0", "ProcessGroupGloo")


def test_a_collective_on_a_non_contiguous_view_writes_into_the_view(dev):
    """Collectives need contiguous memory: a transposed view runs on a contiguous copy whose
    result is written back into the view, as on a CPU tensor."""
    dist.init_process_group(backend="flagos", store=dist.HashStore(), rank=0, world_size=1)
    try:
        base = torch.arange(6.0).reshape(2, 3).to(dev)
        view = base.t()
        assert not view.is_contiguous()
        dist.all_reduce(view)
        dist.broadcast(view, src=0)
        torch.testing.assert_close(base.cpu(), torch.arange(6.0).reshape(2, 3))
        gathered = torch.zeros(3, 2).to(dev).t()  # an output view: the result lands in it
        dist.all_gather([gathered], torch.arange(6.0).reshape(2, 3).to(dev))
        torch.testing.assert_close(gathered.cpu(), torch.arange(6.0).reshape(2, 3))
    finally:
        dist.destroy_process_group()


def test_a_collective_leaves_its_inputs_alone(dev):
    """A collective's read-only input is not written: its version stays, so autograd can still
    use it where it was saved for backward (sin saves its input), and the gradient is CPU's."""
    dist.init_process_group(backend="flagos", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = []
        for device in ("cpu", dev):
            w = torch.linspace(-1, 1, 6, device=device).requires_grad_()
            x = (w.reshape(2, 3) * 2).t()  # a view that is not contiguous: copied for gloo
            y = x.sin()
            version = x._version
            gathered = torch.empty(3, 2, device=device)
            dist.all_gather([gathered], x)
            whole = torch.empty(3, 2, device=device)
            dist.all_gather_into_tensor(whole, x)
            lists = [[torch.empty(3, 2, device=device)]]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_coalesced(lists, [x])
            at_0 = [torch.empty(3, 2, device=device)]
            dist.gather(x, at_0, dst=0)
            dense = x.contiguous()  # gloo's scatter and all_to_all_single take contiguous inputs only
            scattered = torch.empty(3, 2, device=device)
            dist.scatter(scattered, [dense], src=0)
            reduced = torch.empty(3, 2, device=device)
            dist.reduce_scatter(reduced, [x])
            reduced_whole = torch.empty(3, 2, device=device)
            dist.reduce_scatter_tensor(reduced_whole, x)
            parts = [torch.empty(3, 2, device=device)]
            dist.all_to_all(parts, [x])
            single = torch.empty(3, 2, device=device)
            dist.all_to_all_single(single, dense)
            assert x._version == version and dense._version == 0
            for result in (lists[0][0], at_0[0], scattered, reduced, reduced_whole, parts[0], single):
                torch.testing.assert_close(result.cpu(), x.detach().cpu())
            y.sum().backward()
            grads.append(w.grad.cpu())
            torch.testing.assert_close(gathered.cpu(), x.detach().cpu())
            torch.testing.assert_close(whole.cpu(), x.detach().cpu())
        torch.testing.assert_close(grads[1], grads[0])
        torch.testing.assert_close(grads[0], 2 * torch.cos(2 * torch.linspace(-1, 1, 6)))
    finally:
        dist.destroy_process_group()


def test_a_collective_copies_its_inputs_to_the_host_and_its_results_back_only(dev):
    """On a chip whose collectives run on host copies, an output a collective only writes
    (gathers, scatters, reduce-scatters, all-to-all) is never read: the input goes to the host
    (one copy), the result comes back (one copy_), and the output's old contents stay where
    they are. On a chip whose collectives run on the payloads, nothing is copied through
    flagos at all."""
    dist.init_process_group(backend="flagos", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.arange(6.0).to(dev)
        out = torch.full((6,), -1.0).to(dev)
        collectives = {
            "all_gather": lambda: dist.all_gather([out], x),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
            "all_gather_coalesced": lambda: dist.all_gather_coalesced([[out]], [x]),
            "gather": lambda: dist.gather(x, [out], dst=0),
            "scatter": lambda: dist.scatter(out, [x], src=0),
            "reduce_scatter": lambda: dist.reduce_scatter(out, [x]),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, x),
            "all_to_all": lambda: dist.all_to_all([out], [x]),
            "all_to_all_single": lambda: dist.all_to_all_single(out, x),
        }
        copies = 1 if _distributed._payload_route(flagos.chips.profile(CHIP))[1] is None else 0
        for name, collective in collectives.items():
            out.fill_(-1.0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # all_gather_coalesced's deprecation
                with flagos.track() as report:
                    collective()
            calls = {row["op"]: sum(row["calls"].values()) for row in report.to_dict()["ops"]}
            assert calls.get("aten::_to_copy", 0) == copies, (name, calls)
            assert calls.get("aten::copy_", 0) == copies, (name, calls)
            torch.testing.assert_close(out.cpu(), torch.arange(6.0), msg=name)
    finally:
        dist.destroy_process_group()


@runs_once
def test_native_mode_names_the_chips_own_backend():
    """In native mode tensors are the chip's own, and so is the backend (gloo for cpu); before
    activation the question has no answer and says what to do."""
    proc = run_python("""
        import flagos
        try:
            flagos.dist_backend()
        except RuntimeError as e:
            print("inactive:", e)
        flagos.activate("cpu", mode="native")
        print("native:", flagos.dist_backend())
    """)
    assert "native: gloo" in proc.stdout
    assert "inactive: flagos is not active: call flagos.activate() first" in proc.stdout


@runs_once
def test_accelerate_launched_process_backend_choice():
    """A launched process (LOCAL_RANK set) asking accelerate for another backend is told the one
    to use; "nccl" under the CUDA redirect is accepted (init_process_group maps it)."""
    pytest.importorskip("accelerate")
    env = dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               FLAGOS_FALLBACK="allow")
    proc = run_python("""
        import flagos
        flagos.activate("cpu")
        from accelerate import PartialState
        try:
            PartialState(backend="gloo")
        except ValueError as e:
            print("error:", e)
    """, env={**env, "MASTER_PORT": str(_free_port())})
    assert "error: Your assigned backend gloo is not available, please use flagos" in proc.stdout
    proc = run_python("""
        import flagos, torch
        flagos.activate("cpu", redirect_cuda=True)
        from accelerate import PartialState
        state = PartialState(backend="nccl")
        print("state:", state.device, torch.distributed.get_backend())
    """, env={**env, "MASTER_PORT": str(_free_port())})
    assert "state: flagos:0 flagos" in proc.stdout

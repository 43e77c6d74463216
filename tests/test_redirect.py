"""redirect_cuda: code written for CUDA runs unchanged on the active chip.

Every entry point in `_redirect.ENTRY_POINTS` has a check here (a missing one fails), and two
scripts written for CUDA (a Diffusers DDPM pipeline, a transformers training loop with autocast
and GradScaler) run unchanged with FLAGOS_REDIRECT_CUDA=1 and match the same script run on plain
CPU with "cuda" replaced by "cpu"."""
from __future__ import annotations

import datetime
import inspect
import io
import os
import pickle
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
from conftest import CHIP, device_mode_only, run_python, runs_once

import flagos
from flagos import chips
from flagos.chips.base import HostGenerator, TorchChip
from flagos.core import _state
from flagos.integrations import _redirect
from flagos.report import _probe

pytestmark = [device_mode_only, pytest.mark.skipif(
    CHIP == "cuda", reason="on the cuda chip 'cuda' is the chip already: redirect_cuda does nothing "
                           "there (test_the_cuda_chip_has_nothing_to_redirect)")]


@pytest.fixture
def redirect():
    assert flagos.activate(CHIP, redirect_cuda=True)["redirect_cuda"] is True  # installs only
    assert _redirect.is_installed()
    yield flagos.device()
    _redirect.uninstall()
    _state.active().redirect_cuda = False


def _on_chip(t, dev):
    assert isinstance(t, torch.Tensor) and t.device == dev, (t.device, dev)


DEVICES = ("cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0))
_x = torch.arange(4, dtype=torch.float32)
FACTORY_CALLS = {
    "empty": lambda d: torch.empty(2, device=d),
    "empty_strided": lambda d: torch.empty_strided((2, 2), (2, 1), device=d),
    "zeros": lambda d: torch.zeros(2, device=d),
    "ones": lambda d: torch.ones(2, device=d),
    "full": lambda d: torch.full((2,), 3.0, device=d),
    "rand": lambda d: torch.rand(2, device=d),
    "randn": lambda d: torch.randn(2, device=d),
    "randint": lambda d: torch.randint(0, 5, (2,), device=d),
    "randperm": lambda d: torch.randperm(4, device=d),
    "arange": lambda d: torch.arange(3, device=d),
    "linspace": lambda d: torch.linspace(0, 1, 3, device=d),
    "logspace": lambda d: torch.logspace(0, 1, 3, device=d),
    "eye": lambda d: torch.eye(2, device=d),
    "tensor": lambda d: torch.tensor([1.0, 2.0], device=d),
    "as_tensor": lambda d: torch.as_tensor([1.0, 2.0], device=d),
    "scalar_tensor": lambda d: torch.scalar_tensor(1.0, device=d),
    "normal": lambda d: torch.normal(0.0, 1.0, (2,), device=d),
    "empty_like": lambda d: torch.empty_like(_x, device=d),
    "zeros_like": lambda d: torch.zeros_like(_x, device=d),
    "ones_like": lambda d: torch.ones_like(_x, device=d),
    "full_like": lambda d: torch.full_like(_x, 2.0, device=d),
    "rand_like": lambda d: torch.rand_like(_x, device=d),
    "randn_like": lambda d: torch.randn_like(_x, device=d),
    "randint_like": lambda d: torch.randint_like(_x, 5, device=d),
    "tril_indices": lambda d: torch.tril_indices(3, 3, device=d),
    "triu_indices": lambda d: torch.triu_indices(3, 3, device=d),
}
NEW_CALLS = {
    "new_empty": lambda x, d: x.new_empty(2, device=d),
    "new_zeros": lambda x, d: x.new_zeros(2, device=d),
    "new_ones": lambda x, d: x.new_ones(2, device=d),
    "new_full": lambda x, d: x.new_full((2,), 1.5, device=d),
    "new_tensor": lambda x, d: x.new_tensor([1.0, 2.0], device=d),
}


def _check_factory(name, dev):
    for d in DEVICES:
        _on_chip(FACTORY_CALLS[name](d), dev)
    if name in ("tensor", "as_tensor"):
        assert torch.tensor([1.0, 2.0], device="cuda").cpu().tolist() == [1.0, 2.0]


def _check_new(name, dev):
    for d in DEVICES:
        _on_chip(NEW_CALLS[name](_x, d), dev)


def _check_to(dev):
    for d in DEVICES + (0,):
        y = _x.to(d)
        _on_chip(y, dev)
        assert torch.equal(y.cpu(), _x)
    y = _x.to(device="cuda", dtype=torch.float16)
    _on_chip(y, dev)
    assert y.dtype == torch.float16


def _check_cuda(dev):
    for args in ((), (0,), ("cuda",), (torch.device("cuda", 0),)):
        _on_chip(_x.cuda(*args), dev)
    assert torch.equal(_x.cuda().cpu(), _x)


def _check_module_cuda(dev):
    lin = torch.nn.Linear(3, 2)
    ref = lin.weight.detach().clone()
    assert lin.cuda() is lin
    _on_chip(lin.weight, dev)
    assert torch.equal(lin.weight.detach().cpu(), ref)
    out = lin(torch.ones(1, 3, device="cuda"))
    torch.testing.assert_close(out.cpu(), torch.ones(1, 3) @ ref.T + lin.bias.detach().cpu())


def _check_load(dev):
    buf = io.BytesIO()
    torch.save({"w": _x}, buf)
    for loc in ("cuda", "cuda:0", torch.device("cuda"), {"cpu": "cuda:0"}):
        buf.seek(0)
        w = torch.load(buf, map_location=loc)["w"]
        _on_chip(w, dev)
        assert torch.equal(w.cpu(), _x)
        buf.seek(0)
        w = torch.load(buf, loc, weights_only=True)["w"]   # map_location given positionally
        _on_chip(w, dev)
        assert torch.equal(w.cpu(), _x)
        buf.seek(0)
        w = torch.load(buf, loc, pickle, weights_only=False)["w"]   # and pickle_module too
        _on_chip(w, dev)
        assert torch.equal(w.cpu(), _x)
    with pytest.raises(TypeError, match="positional argument"):   # PyTorch's own error
        torch.load(buf, "cuda", pickle, "one too many")


def _check_generator(dev):
    for d in DEVICES:
        g = torch.Generator(d)
        assert g.device == dev and isinstance(g, torch.Generator)
    a = torch.randn(4, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    b = torch.randn(4, device=dev, generator=torch.Generator(dev).manual_seed(3))
    assert torch.equal(a.cpu(), b.cpu())
    assert isinstance(torch.default_generator, torch.Generator)
    assert issubclass(torch._C.Generator, torch.Generator) and not issubclass(int, torch.Generator)

    class Seeded(torch.Generator):   # a library's own generator class is built as it asks
        pass
    own = Seeded("cpu")
    assert type(own) is Seeded and own.device == torch.device("cpu")


def _check_set_default_device(dev):
    for d in DEVICES:
        torch.set_default_device(d)
        try:
            _on_chip(torch.ones(2), dev)
        finally:
            torch.set_default_device(None)
    assert torch.ones(2).device == torch.device("cpu")


def _check_autocast(dev):
    a = torch.randn(4, 4, device="cuda")
    for ctx in (torch.autocast("cuda", dtype=torch.float16),
                torch.autocast(device_type="cuda", dtype=torch.float16),
                torch.amp.autocast("cuda", dtype=torch.float16)):
        with ctx:
            assert ctx.device == dev.type
            assert (a @ a).dtype == torch.float16


def _scaler_step(scaler, dev):
    lin = torch.nn.Linear(3, 1).cuda()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    before = lin.weight.detach().cpu().clone()
    loss = lin(torch.ones(2, 3, device="cuda")).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler._device == dev.type
    assert not torch.equal(lin.weight.detach().cpu(), before)  # the step ran (no inf found)


def _check_amp_grad_scaler(dev):
    _scaler_step(torch.amp.GradScaler("cuda"), dev)
    _scaler_step(torch.amp.GradScaler(device="cuda"), dev)


def _check_cuda_amp_grad_scaler(dev):
    with pytest.warns(FutureWarning):  # PyTorch's own deprecation
        _scaler_step(torch.cuda.amp.GradScaler(), dev)


def _check_init_process_group(dev):
    """"nccl" (positional, keyword, or in "device:backend" pairs) is the chip's backend
    (flagos.dist_backend()), and a collective on "cuda" tensors runs on the chip."""
    for args, kwargs in ((("nccl",), {}), ((), {"backend": "nccl"}),
                         (("cpu:gloo,cuda:nccl",), {}), ((), {"backend": "nccl", "device_id": 0}),
                         ((), {"backend": "nccl", "device_id": torch.device("cuda", 0)}),
                         (("nccl", None, datetime.timedelta(seconds=60)), {})):   # more given positionally
        dist.init_process_group(*args, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        try:
            backend = dist.get_backend()
            chip_backend = flagos.dist_backend()
            # "cuda:nccl" pairs become the chip's: "cpu:gloo,flagos:flagos" in device mode
            want = f"cpu:gloo,{dev.type}:{chip_backend}" if args and ":" in args[0] else chip_backend
            assert backend == want, backend
            t = torch.arange(3.0, device="cuda")
            dist.all_reduce(t)
            _on_chip(t, dev)
            assert t.cpu().tolist() == [0.0, 1.0, 2.0]
        finally:
            dist.destroy_process_group()


def _check_cuda_module(name, dev):
    state = _state.active()
    chip = state.chip
    c = torch.cuda
    if name in ("is_available", "is_initialized"):
        assert getattr(c, name)() is True
    elif name == "device_count":
        assert c.device_count() == state.device_count
    elif name == "current_device":
        assert c.current_device() == dev.index
    elif name == "set_device":
        c.set_device(0)
        c.set_device("cuda:0")
        c.set_device(torch.device("cuda", 0))
        assert c.current_device() == 0
    elif name == "device":
        with c.device(0):
            assert c.current_device() == 0
    elif name == "synchronize":
        c.synchronize()
        c.synchronize("cuda:0")
    elif name in ("manual_seed", "manual_seed_all"):
        getattr(c, name)(5)
        a = torch.randn(4, device="cuda")
        getattr(c, name)(5)
        b = torch.randn(4, device="cuda")
        assert torch.equal(a.cpu(), b.cpu())
        torch.flagos.manual_seed(5)
        assert torch.equal(torch.randn(4, device=dev).cpu(), a.cpu())
    elif name == "get_rng_state":
        assert torch.equal(c.get_rng_state(), torch.flagos.get_rng_state())
    elif name == "set_rng_state":
        s = c.get_rng_state()
        a = torch.randn(3, device="cuda")
        c.set_rng_state(s)
        assert torch.equal(torch.randn(3, device="cuda").cpu(), a.cpu())
    elif name in ("CUDAGraph", "graph", "make_graphed_callables", "graph_pool_handle"):
        args = {"graph": (None,), "make_graphed_callables": (torch.nn.Linear(2, 2).cuda(),
                                                            (torch.ones(1, 2, device="cuda"),))}
        with pytest.raises(RuntimeError, match=rf"CUDA graphs are not available under "
                                               rf"redirect_cuda: chip '{chip.name}'.*eagerly"):
            getattr(c, name)(*args.get(name, ()))
        assert torch.ones(2, device="cuda").sum().item() == 2.0   # and the process goes on
        if name in ("CUDAGraph", "graph"):   # classes still: libraries annotate with them at import
            assert isinstance(getattr(c, name), type) and (getattr(c, name) | None)
    elif name in ("get_rng_state_all", "set_rng_state_all"):
        states = c.get_rng_state_all()
        assert len(states) == state.device_count
        assert all(torch.equal(s, torch.flagos.get_rng_state(i)) for i, s in enumerate(states))
        a = torch.randn(3, device="cuda")
        c.set_rng_state_all(states)
        assert torch.equal(torch.randn(3, device="cuda").cpu(), a.cpu())
    elif name in ("seed", "seed_all"):
        c.manual_seed(5)
        getattr(c, name)()
        assert c.initial_seed() == torch.flagos.initial_seed() != 5   # a new random seed (1 in 2**64 to fail)
    elif name == "initial_seed":
        c.manual_seed(7)
        assert c.initial_seed() == torch.flagos.initial_seed() == 7
    elif name == "random":
        real = sys.modules["torch.cuda"].random
        for fn in _redirect.RANDOM_FUNCTIONS:
            assert getattr(c.random, fn) is getattr(torch.flagos, fn) is not getattr(real, fn), fn
        c.random.manual_seed(3)
        s = c.random.get_rng_state()
        a = torch.randn(3, device="cuda")
        c.random.set_rng_state(s)
        assert torch.equal(torch.randn(3, device="cuda").cpu(), a.cpu())
        assert c.random.initial_seed() == 3
        assert c.random.Tensor is real.Tensor   # any other name: PyTorch's
    elif name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                  "max_memory_reserved"):
        assert getattr(c, name)() == getattr(torch.flagos, name)(0)
        assert getattr(c, name)("cuda:0") == getattr(torch.flagos, name)(0)
    elif name == "reset_peak_memory_stats":
        c.reset_peak_memory_stats()
    elif name == "memory_stats":
        assert c.memory_stats() == torch.flagos.memory_stats()
    elif name == "mem_get_info":
        free, total = c.mem_get_info()
        assert 0 <= free <= total
    elif name == "empty_cache":
        c.empty_cache()
    elif name == "get_device_name":
        assert c.get_device_name() == c.get_device_name(0) == chip.device_name(0)
    elif name == "get_device_properties":
        props = c.get_device_properties(0)
        assert props.name == chip.device_name(0) and props.total_memory == chip.total_memory(0)
        # no CUDA architecture and no streaming multiprocessors to count: zeros, never a guess
        assert (props.major, props.minor, props.multi_processor_count) == (0, 0, 0)
        assert props.type == chip.name
    elif name == "is_bf16_supported":
        assert c.is_bf16_supported() is ("bfloat16" in chip.native_dtypes)
    elif name == "Event":
        assert c.Event is torch.flagos.Event   # the chip's own events, in device mode
        start, end = c.Event(enable_timing=True), c.Event(enable_timing=True)
        start.record()
        torch.ones(8, device="cuda").sum()
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) >= 0
    elif name == "Stream":
        s = c.Stream()
        assert s.device == dev
    elif name == "stream":
        s = c.Stream()
        with c.stream(s):
            assert c.current_stream() == s
    elif name == "current_stream":
        assert c.current_stream().device == dev
    elif name == "default_stream":
        assert c.default_stream().device == dev
    elif name == "get_device_capability":
        assert c.get_device_capability() == c.get_device_capability("cuda:0") == (0, 0)
        props = c.get_device_properties(0)
        assert (props.major, props.minor) == (0, 0)  # the same answer both ways
        with pytest.raises(ValueError, match="does not exist"):
            c.get_device_capability(state.device_count)
    elif name == "init":
        c.init()
        assert c.is_initialized()
    elif name == "is_current_stream_capturing":
        assert c.is_current_stream_capturing() is False
    elif name == "ipc_collect":
        before = torch.flagos.memory_allocated()
        c.ipc_collect()
        assert torch.flagos.memory_allocated() == before
    elif name == "set_per_process_memory_fraction":
        for fraction in (0.5, 0.0, 1.0):  # the ends of the range are allowed, as on CUDA
            with pytest.warns(UserWarning, match=f"not enforced on chip '{chip.name}'") as caught:
                here = inspect.currentframe().f_lineno + 1
                c.set_per_process_memory_fraction(fraction)
            # the warning names the line that asked, as PyTorch's warnings do
            assert (caught[0].filename, caught[0].lineno) == (__file__, here)
        with pytest.raises(ValueError, match=r"Invalid fraction value: 1\.5\. Allowed range: 0~1"):
            c.set_per_process_memory_fraction(1.5)
        with pytest.raises(ValueError, match="Invalid fraction value: -0.1"):
            c.set_per_process_memory_fraction(-0.1)
        with pytest.raises(TypeError, match="Invalid type for fraction argument, must be `float`"):
            c.set_per_process_memory_fraction(1)
    elif name == "memory_summary":
        keep = torch.ones(1 << 18, device="cuda")  # 1 MiB
        text = c.memory_summary()
        allocated = torch.flagos.memory_allocated() / 2**20
        assert f"allocated: {allocated:,.1f} MiB" in text and chip.name in text, text
        del keep
    elif name == "nvtx":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            assert c.nvtx.range_push("outer") == 0
            with c.nvtx.range("inner {}", 1):
                (torch.ones(4, device="cuda") * 2).sum()
            assert c.nvtx.range_pop() == 0
            c.nvtx.mark("point")
        assert c.nvtx.range_pop() == -1
        names = {e.name for e in prof.events()}
        assert {"outer", "inner 1", "point"} <= names, names
    elif name in _redirect.LEGACY_TYPES:
        kind, dtype = getattr(c, name), _redirect.LEGACY_TYPES[name]
        made = kind(2, 3)                                         # sizes: uninitialized
        assert made.shape == (2, 3) and made.dtype == dtype and made.device == dev
        assert kind(torch.Size([4])).shape == (4,)
        data = kind([1, 0, 1])                                    # data: copied
        assert data.dtype == dtype and data.device == dev
        assert torch.equal(data.cpu(), getattr(torch, name)([1, 0, 1]))
        assert kind().shape == (0,) and kind().device == dev
        assert isinstance(data, kind) and not isinstance(data.cpu(), kind)
        other = torch.float64 if dtype != torch.float64 else torch.float32
        assert not isinstance(data.to(other), kind)
    else:
        raise AssertionError(f"no check for torch.cuda.{name}")


def _check_type(dev):
    """`x.type(torch.cuda.LongTensor)` and `x.type("torch.cuda.HalfTensor")` move to the chip in
    that dtype; PyTorch's own answers otherwise."""
    host = torch.tensor([1.5, -2.0])
    as_long = host.type(torch.cuda.LongTensor)
    assert as_long.device == dev and torch.equal(as_long.cpu(), host.long())
    as_half = host.type("torch.cuda.HalfTensor")
    assert as_half.device == dev and as_half.dtype == torch.float16
    back = as_half.type(torch.cuda.FloatTensor)
    assert back.device == dev and back.dtype == torch.float32 and as_half.type().endswith("HalfTensor")
    assert host.type(torch.float64).dtype == torch.float64 and host.type().startswith("torch.")
    assert host.type("torch.DoubleTensor").device.type == "cpu"
    # help(x.type) and tools reading the signature see PyTorch's method
    assert torch.Tensor.type.__name__ == "type" and torch.Tensor.type.__doc__ == torch._C.TensorBase.type.__doc__


def _check(entry: str, dev) -> None:
    parts = entry.split(".")
    if entry.startswith("torch.cuda.amp."):
        return _check_cuda_amp_grad_scaler(dev)
    if entry.startswith("torch.cuda."):
        return _check_cuda_module(parts[-1], dev)
    if entry.startswith("torch.Tensor."):
        name = parts[-1]
        return {"to": _check_to, "cuda": _check_cuda, "type": _check_type}.get(
            name, lambda d: _check_new(name, d))(dev)
    if len(parts) == 2 and parts[1] in FACTORY_CALLS:
        return _check_factory(parts[1], dev)
    return {
        "torch.nn.Module.cuda": _check_module_cuda,
        "torch.load": _check_load,
        "torch.Generator": _check_generator,
        "torch.set_default_device": _check_set_default_device,
        "torch.autocast": _check_autocast,
        "torch.amp.GradScaler": _check_amp_grad_scaler,
        "torch.distributed.init_process_group": _check_init_process_group,
    }[entry](dev)


CHECKED = (
    {f"torch.{n}" for n in FACTORY_CALLS} | {f"torch.Tensor.{n}" for n in NEW_CALLS}
    | {"torch.Tensor.to", "torch.Tensor.cuda", "torch.nn.Module.cuda", "torch.load",
       "torch.Generator", "torch.set_default_device", "torch.autocast", "torch.amp.GradScaler", "torch.cuda.amp.GradScaler",
       "torch.distributed.init_process_group"}
    | {f"torch.cuda.{n}" for n in _redirect.CUDA_FUNCTIONS} | {"torch.Tensor.type"}
    | {f"torch.cuda.{n}" for n in _redirect.LEGACY_TYPES}
)


def test_every_entry_point_has_a_check():
    assert set(_redirect.ENTRY_POINTS) == CHECKED
    assert len(set(_redirect.ENTRY_POINTS)) == len(_redirect.ENTRY_POINTS)


@pytest.mark.parametrize("entry", _redirect.ENTRY_POINTS)
def test_entry_point_runs_on_the_active_chip(redirect, entry):
    _check(entry, redirect)


def test_transformers_offloaded_kv_cache_generates_as_without_offloading(redirect):
    """transformers' offloaded KV caches order their copies with `torch.cuda.default_stream`
    (CUDA's only, whatever the model's device: without the redirect, "Torch not compiled with
    CUDA enabled" on any other device): under the redirect they generate the tokens the
    ordinary cache does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 100, (2, 8))
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    model.cuda()
    for cache in ("offloaded", "offloaded_static"):
        tokens = model.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), max_new_tokens=5,
                                do_sample=False, cache_implementation=cache)
        assert tokens.device == redirect and torch.equal(tokens.cpu(), expected), cache


def _trainer_with_checkpoints(out, use_cpu, resume_from=None):
    """A tiny BERT classifier (dropout on) trained for 4 steps by transformers' Trainer, which
    checkpoints at step 2 with the RNG states (torch.cuda.random's on a CUDA machine); resumed
    from `resume_from` if given. Its classifier weights."""
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32, num_labels=2,
                                     hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)
    model = transformers.BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (16, 6), generator=generator)
    labels = torch.randint(0, 2, (16,), generator=generator)
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=4, save_steps=2,
        learning_rate=1e-2, report_to=[], seed=0, use_cpu=use_cpu, dataloader_pin_memory=False,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume_from)
    return args.device, model.classifier.weight.detach().cpu()


def test_trainer_checkpoints_and_resumes_a_cuda_script_as_on_cpu(redirect, tmp_path):
    """transformers' Trainer saves torch.cuda.random's RNG state in each checkpoint and restores
    it on resume when torch.cuda.is_available(): under the redirect that is the chip's (it asked
    PyTorch's CUDA: "Torch not compiled with CUDA enabled" at the first checkpoint). A run
    resumed from step 2 ends where the uninterrupted one does, and both where plain CPU's does."""
    device, weight = _trainer_with_checkpoints(tmp_path / "chip", use_cpu=False)
    assert device == redirect
    saved = torch.load(tmp_path / "chip" / "checkpoint-2" / "rng_state.pth", weights_only=False)
    if isinstance(_state.active().chip, HostGenerator):   # its random ops use the host's generator
        assert torch.equal(saved["cuda"], saved["cpu"])
    _, resumed = _trainer_with_checkpoints(tmp_path / "chip", use_cpu=False,
                                           resume_from=str(tmp_path / "chip" / "checkpoint-2"))
    cpu_device, expected = _trainer_with_checkpoints(tmp_path / "cpu", use_cpu=True)
    assert cpu_device == torch.device("cpu")
    torch.testing.assert_close(weight, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(resumed, weight, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(CHIP != "sim", reason="needs a chip with two devices (sim has two)")
def test_a_cuda_index_is_the_chips_device_of_that_index(redirect):
    """"cuda:1" and torch.device("cuda", 1) are flagos:1, whichever device is current; "cuda"
    without an index is the current one."""
    one = torch.device("flagos", 1)
    for d in ("cuda:1", torch.device("cuda", 1)):
        _on_chip(torch.ones(2, device=d), one)
        _on_chip(_x.to(d), one)
        _on_chip(_x.new_zeros(2, device=d), one)
    _on_chip(_x.cuda(1), one)
    torch.flagos.set_device(1)
    try:
        _on_chip(torch.ones(2, device="cuda"), one)
        _on_chip(_x.cuda(), one)  # .cuda() with no device: the current one, as on CUDA
        _on_chip(torch.nn.Linear(2, 2).cuda().weight, one)
        _on_chip(torch.ones(2, device="cuda:0"), torch.device("flagos", 0))
    finally:
        torch.flagos.set_device(0)


def test_every_entry_point_is_replaced(redirect):
    replaced = {(id(owner), name) for owner, name, _ in _redirect._saved}
    for name in _redirect.FACTORIES:
        assert (id(torch), name) in replaced
    for name in _redirect.TENSOR_METHODS:
        assert (id(torch.Tensor), name) in replaced
    for owner, name in ((torch.nn.Module, "cuda"), (torch, "load"), (torch, "Generator"),
                        (torch.amp.autocast_mode.autocast, "__init__"),
                        (torch.amp.grad_scaler.GradScaler, "__init__"),
                        (dist, "init_process_group"), (torch, "cuda")):
        assert (id(owner), name) in replaced, (owner, name)
    real = sys.modules["torch.cuda"]
    for name in _redirect.CUDA_FUNCTIONS:
        assert getattr(torch.cuda, name) is not getattr(real, name), name


def _replaced_original(owner, name):
    """What `owner.name` was before the redirect: its own attribute, or the inherited one."""
    for saved_owner, saved_name, original in _redirect._saved:
        if (saved_owner, saved_name) == (owner, name) and original is not _redirect._ABSENT:
            return original
    return getattr(owner.__mro__[1], name)


def test_redirected_functions_keep_pytorchs_names_docs_and_signatures(redirect):
    """Libraries read them: transformers asks `inspect.signature(torch.load)` whether it takes
    `weights_only`, `help(torch.zeros)` shows PyTorch's text."""
    assert "weights_only" in inspect.signature(torch.load).parameters
    wrapped = [(torch, n) for n in (*_redirect.FACTORIES, "load", "set_default_device")]
    wrapped += [(torch.Tensor, n) for n in _redirect.TENSOR_METHODS if n != "cuda"]
    wrapped += [(torch.amp.autocast_mode.autocast, "__init__"), (torch.amp.grad_scaler.GradScaler, "__init__"),
                (dist, "init_process_group")]
    for owner, name in wrapped:
        now, before = getattr(owner, name), _replaced_original(owner, name)
        assert now is not before and now.__wrapped__ is before, name
        assert (now.__name__, now.__qualname__, now.__doc__) == \
            (before.__name__, before.__qualname__, before.__doc__), name
        try:
            signature = inspect.signature(before)
        except ValueError:  # a builtin without one
            continue
        assert inspect.signature(now) == signature, name


def test_installing_again_changes_nothing_and_says_it_is_installed(redirect):
    saved, zeros = list(_redirect._saved), torch.zeros
    assert _redirect.install(_state.active()) is True
    assert _redirect._saved == saved and torch.zeros is zeros


def test_uninstall_gives_everything_back(redirect):
    before = torch.zeros
    _redirect.uninstall()
    assert torch.zeros is not before and torch.cuda is sys.modules["torch.cuda"]
    assert "to" not in vars(torch.Tensor) and "cuda" not in vars(torch.Tensor)
    flagos.activate(CHIP, redirect_cuda=True)   # the fixture uninstalls again


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a PyTorch without CUDA")
def test_redirect_off_cuda_stays_cuda():
    assert not _redirect.is_installed()
    assert torch.cuda.is_available() is False
    with pytest.raises((AssertionError, RuntimeError), match="not compiled with CUDA"):
        torch.zeros(1, device="cuda")
    with pytest.raises((AssertionError, RuntimeError), match="not compiled with CUDA"):
        torch.zeros(1).cuda()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a PyTorch without CUDA")
def test_detection_never_trusts_the_redirect(redirect):
    assert torch.cuda.is_available() is True
    assert chips.profile("cuda").detect() is False
    assert _probe.chip_status("cuda")["status"] != _probe.AVAILABLE


def test_no_op_on_the_cuda_chip():
    state = _state.Active(chip=chips.profile("cuda"), mode="native", device_count=1)
    assert _redirect.install(state) is False
    assert not _redirect.is_installed()


# ---- scripts written for CUDA, run unchanged ----------------------------------------

UNET = """UNet2DModel(
    sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
    block_out_channels=(16, 32), norm_num_groups=8,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"))"""

DDPM_SCRIPT = f"""
import sys
import torch
from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

assert torch.cuda.is_available()
torch.manual_seed(0)
torch.cuda.manual_seed(0)
unet = {UNET}
pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=100))
pipe.set_progress_bar_config(disable=True)
pipe.to("cuda")
generator = torch.Generator("cuda").manual_seed(0)
images = pipe(batch_size=1, generator=generator, num_inference_steps=4, output_type="np").images
torch.cuda.manual_seed(1)
noise = torch.randn(1, 3, 16, 16, device="cuda")
with torch.no_grad():
    eps = pipe.unet(noise, torch.tensor([10], device="cuda")).sample
torch.cuda.synchronize()
torch.save({{"images": torch.from_numpy(images), "noise": noise.cpu(), "eps": eps.cpu()}}, sys.argv[1])
"""

TRAIN_SCRIPT = """
import sys
import torch
from transformers import BertConfig, BertForSequenceClassification

torch.manual_seed(0)
torch.cuda.manual_seed_all(0)
device = torch.device("cuda")
config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=64, num_labels=3)
model = BertForSequenceClassification(config).cuda()
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
ids = torch.randint(0, 128, (4, 12), device=device)
labels = torch.randint(0, 3, (4,), device="cuda")
mask = torch.ones(4, 12, dtype=torch.long).to(device)
losses = []
for step in range(3):
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    scaler.scale(out.loss).backward()
    scaler.step(opt)
    scaler.update()
    losses.append(out.loss.item())
torch.cuda.synchronize()
torch.save({"losses": torch.tensor(losses), "weight": model.classifier.weight.detach().cpu(),
            "ids": ids.cpu()}, sys.argv[1])
"""

# A checkpoint saved and loaded straight onto the device, as a CUDA user loads one from the hub
LOAD_SCRIPT = """
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LlamaForCausalLM(config).save_pretrained(sys.argv[1] + ".model")
model = LlamaForCausalLM.from_pretrained(sys.argv[1] + ".model", device_map="cuda")
ids = torch.tensor([[1, 5, 9, 3]], device="cuda")
tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
with torch.no_grad():
    logits = model(ids).logits
torch.save({"tokens": tokens.cpu(), "logits": logits.cpu()}, sys.argv[1])
"""


# An older script's idiom (a GAN training step as the PyTorch-GAN collection writes it): the
# legacy CUDA tensor types as constructors and as `.type()` targets.
GAN_SCRIPT = """
import sys
import numpy as np
import torch

cuda = True if torch.cuda.is_available() else False
Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor
torch.manual_seed(0)
np.random.seed(0)
generator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 4), torch.nn.Tanh())
discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 1), torch.nn.Sigmoid())
adversarial_loss = torch.nn.BCELoss()
if cuda:
    generator.cuda()
    discriminator.cuda()
    adversarial_loss.cuda()
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-3)
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-3)
losses = []
for step in range(3):
    imgs = torch.from_numpy(np.random.uniform(-1, 1, (6, 4))).double()
    valid = Tensor(imgs.size(0), 1).fill_(1.0)
    fake = Tensor(imgs.size(0), 1).fill_(0.0)
    real_imgs = imgs.type(Tensor)
    opt_g.zero_grad()
    z = Tensor(np.random.normal(0, 1, (imgs.shape[0], 8)))
    gen_imgs = generator(z)
    g_loss = adversarial_loss(discriminator(gen_imgs), valid)
    g_loss.backward()
    opt_g.step()
    opt_d.zero_grad()
    d_loss = (adversarial_loss(discriminator(real_imgs), valid)
              + adversarial_loss(discriminator(gen_imgs.detach()), fake)) / 2
    d_loss.backward()
    opt_d.step()
    assert isinstance(real_imgs, Tensor) and real_imgs.dtype == torch.float32
    losses.append([g_loss.item(), d_loss.item()])
labels = torch.cuda.LongTensor([1, 0, 2]) if cuda else torch.LongTensor([1, 0, 2])
torch.save({"losses": torch.tensor(losses), "weight": generator[0].weight.detach().cpu(),
            "labels": labels.cpu()}, sys.argv[1])
"""


def _as_cpu_script(script: str) -> str:
    """The plain-CPU version of a CUDA script: "cuda" -> "cpu" (torch.cpu has no seeding
    functions; torch.manual_seed seeds the CPU generator; the legacy CUDA tensor types are
    the host's, torch.FloatTensor)."""
    for seeding in ("torch.cuda.manual_seed_all(", "torch.cuda.manual_seed("):
        script = script.replace(seeding, "torch.manual_seed(")
    for name in _redirect.LEGACY_TYPES:
        script = script.replace(f"torch.cuda.{name}", f"torch.{name}")
    return script.replace("cuda", "cpu")


def _run(script: str, out: str, env: dict) -> dict:
    path = out + ".py"
    with open(path, "w") as f:
        f.write(script)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGOS_")}
    full_env.update(FLAGOS_FALLBACK="allow", **env)
    proc = subprocess.run([sys.executable, path, out], env=full_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return torch.load(out)


_ON_PLAIN_CPU: dict = {}


def _on_plain_cpu(cuda_script: str, out: str) -> dict:
    """The script's plain-CPU version's results: one run per script text in this process (the
    device-mode and native-mode tests of a script compare against the same run)."""
    if cuda_script not in _ON_PLAIN_CPU:
        _ON_PLAIN_CPU[cuda_script] = _run(_as_cpu_script(cuda_script), out, {})
    return _ON_PLAIN_CPU[cuda_script]


# device_map="cuda" names the chip's device the same way on every chip; loading and generating on
# sim's memory through device_map is test_accelerate.py's, in the sim run
LOADS_ONCE = pytest.mark.skipif(CHIP != "cpu", reason="the name is translated the same on every chip; "
                                "device_map loading on sim: test_accelerate.py")


@pytest.mark.parametrize("script", ["ddpm", "train", pytest.param("load", marks=LOADS_ONCE), "gan"])
def test_cuda_script_runs_unchanged(tmp_path, script):
    text = {"ddpm": DDPM_SCRIPT, "train": TRAIN_SCRIPT, "load": LOAD_SCRIPT, "gan": GAN_SCRIPT}[script]
    assert 'to("cuda")' in text or ".cuda()" in text or 'device_map="cuda"' in text
    got = _run(text, str(tmp_path / "script_chip"), {"FLAGOS_DEVICE": CHIP, "FLAGOS_REDIRECT_CUDA": "1"})
    want = _on_plain_cpu(text, str(tmp_path / "script_cpu"))
    assert got.keys() == want.keys()
    tol = dict(rtol=1e-4, atol=1e-5) if CHIP == "cpu" else dict(rtol=2e-3, atol=2e-4)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **tol, msg=key)


ONCE = pytest.mark.skipif(CHIP != "cpu", reason="activates the cpu chip itself: runs once, in the cpu run")


@ONCE
def test_cuda_script_runs_unchanged_in_native_mode(tmp_path):
    """Native mode: "cuda" means the chip's own device type (cpu for the cpu chip)."""
    got = _run(TRAIN_SCRIPT, str(tmp_path / "script_chip"),
               {"FLAGOS_DEVICE": "cpu", "FLAGOS_MODE": "native", "FLAGOS_REDIRECT_CUDA": "1"})
    want = _on_plain_cpu(TRAIN_SCRIPT, str(tmp_path / "script_cpu"))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)


@ONCE
def test_native_mode_entry_points_and_deactivate():
    proc = run_python("""
        import sys
        import torch
        import flagos
        flagos.activate("cpu", mode="native", redirect_cuda=True)
        cpu = torch.device("cpu")
        assert torch.randn(3, device="cuda").device == cpu
        assert torch.zeros(2).cuda().device == cpu
        assert torch.nn.Linear(2, 2).cuda().weight.device == cpu
        # an index is a CUDA index: the chip's device of that index (the host for the cpu chip)
        assert torch.zeros(2).cuda(0).device == cpu and torch.zeros(2).to(0).device == cpu
        assert torch.nn.Linear(2, 2).cuda(0).weight.device == cpu
        assert torch.Generator("cuda").device == cpu
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert (torch.ones(2, 2, device="cuda") @ torch.ones(2, 2)).dtype == torch.bfloat16
        assert torch.amp.GradScaler("cuda")._device == "cpu"
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        # torch.cpu has no default_stream: that name is PyTorch's own, the ones after it the chip's
        assert torch.cuda.get_device_capability() == (0, 0) and torch.cuda.init() is None
        assert torch.cuda.is_current_stream_capturing() is False
        assert "flagos memory summary" in torch.cuda.memory_summary()
        # detection asks PyTorch's own torch.cuda, never the redirect standing in for it
        assert not flagos.chips.profile("cuda").detect()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); end.record(); end.synchronize()
        assert start.elapsed_time(end) >= 0
        flagos.deactivate()
        assert torch.cuda is sys.modules["torch.cuda"] and not torch.cuda.is_available()
        try:
            torch.zeros(1, device="cuda")
        except (AssertionError, RuntimeError) as e:
            assert "not compiled with CUDA" in str(e), e
        else:
            raise AssertionError("'cuda' still redirected after deactivate()")
        print("ok")
    """)
    assert proc.stdout.strip().endswith("ok")


def test_host_events_time_in_milliseconds(monkeypatch):
    """torch.cuda.Event of the cpu chip in native mode reads the host clock at record():
    elapsed_time is the milliseconds between two readings, and asks for both."""
    readings = iter([10.0, 10.0025])
    monkeypatch.setattr(_redirect, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    start, end = _redirect._HostEvent(enable_timing=True), _redirect._HostEvent(enable_timing=True)
    with pytest.raises(RuntimeError, match="both events must be recorded"):
        start.elapsed_time(end)
    start.record()
    with pytest.raises(RuntimeError, match="both events must be recorded"):
        start.elapsed_time(end)   # the end not yet
    with pytest.raises(RuntimeError, match="both events must be recorded"):
        end.elapsed_time(start)   # nor the start
    assert start.query() is True and end.query() is True   # host work is done when issued
    end.record()
    assert start.elapsed_time(end) == pytest.approx(2.5, rel=1e-9)


@runs_once
def test_the_cuda_chip_has_nothing_to_redirect():
    """On the cuda chip (or a vendor's chip behind torch.cuda) install() changes nothing and
    says so: `info()["redirect_cuda"]` stays False and torch's CUDA entry points stay PyTorch's."""
    cuda_like = _state.Active(chip=chips.profile("cuda"), mode="device", device_count=1)
    before = (torch.zeros, torch.Tensor.to, torch.Tensor.cuda, torch.cuda)
    assert _redirect.install(cuda_like) is False
    # a vendor's chip whose PyTorch device is cuda (a ROCm or DCU build) has nothing to redirect
    behind_cuda = TorchChip(name="dcu", torch_type="cuda", vendor="hygon", collective_backend="nccl")
    assert _redirect.install(_state.Active(chip=behind_cuda, mode="native", device_count=1)) is False
    assert not _redirect.is_installed()
    assert (torch.zeros, torch.Tensor.to, torch.Tensor.cuda, torch.cuda) == before

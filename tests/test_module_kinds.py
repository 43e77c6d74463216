"""Modules that PyTorch builds in ways of their own, moved to flagos as users move them: lazy
modules (parameters without a shape until the first forward), scripted and traced modules
(parameters in C++ slots) and DataParallel wrappers, each compared with the same module on
plain CPU, seeded alike.
Runs on the suite's chip (cpu, and sim with FLAGOS_TEST_CHIP=sim)."""
import copy
import io

import pytest
import torch
from conftest import device_mode_only
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, is_lazy

import flagos

pytestmark = device_mode_only

_KINDS = ["Conv2d", "BatchNorm2d", "ReLU", "Flatten", "Linear"]


def _lazy_net(**factory):
    return torch.nn.Sequential(torch.nn.LazyConv2d(4, 3, **factory), torch.nn.LazyBatchNorm2d(**factory),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(5, **factory))


def _train_step(model, device, dtype=torch.float32):
    """One forward, backward and SGD step on a fixed batch: the output and the module's state."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1), dtype=dtype)
    out = model(x.to(device))
    out.square().mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return [out.detach().cpu()] + [t.detach().cpu() for t in model.state_dict().values()]


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["module.to", "factory device", "to, cpu, to", "double"])
def test_a_lazy_module_moved_before_its_first_forward_trains_as_on_cpu(dev, how):
    dtype = torch.float64 if how == "double" else torch.float32
    torch.manual_seed(0)
    expected = _train_step(_lazy_net().to(dtype), "cpu", dtype)
    torch.manual_seed(0)
    if how == "factory device":
        model = _lazy_net(device=dev)
    elif how == "to, cpu, to":
        model = _lazy_net().to(dev).cpu()
        assert all(is_lazy(p) and p.device.type == "cpu" for p in model.parameters())
        assert type(model[0].weight) is UninitializedParameter  # PyTorch's own class off flagos
        model = model.to(dev)
    else:
        model = _lazy_net().to(dev).to(dtype)
    assert all(is_lazy(t) and t.device == dev for t in [*model.parameters(), *model.buffers()][:4])
    assert isinstance(model[0].weight, UninitializedParameter)
    assert isinstance(model[1].running_mean, UninitializedBuffer)
    if how == "factory device":  # made there: marked a Buffer as on the CPU (a move drops it there too)
        assert isinstance(model[1].running_mean, torch.nn.Buffer)
    got = _train_step(model, dev, dtype)
    _assert_same(got, expected)
    assert [type(m).__name__ for m in model] == _KINDS
    assert all(isinstance(p, torch.nn.Parameter) and not is_lazy(p) and p.device == dev
               for p in model.parameters())
    assert all(b.device == dev and not is_lazy(b) for b in model.buffers())


def test_a_lazy_module_on_flagos_loads_a_state_dict_as_on_cpu(dev):
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.Flatten(), torch.nn.Linear(64, 5))
    model = _lazy_net().to(dev)
    model.load_state_dict(source.state_dict())
    for name, value in source.state_dict().items():
        loaded = model.state_dict()[name]
        assert loaded.device == dev and not is_lazy(loaded), name
        torch.testing.assert_close(loaded.cpu(), value)
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(model.eval()(x.to(dev)).cpu(), source.eval()(x), rtol=1e-5, atol=1e-6)


def test_a_lazy_module_on_flagos_loads_a_lazy_state_dict_and_trains_as_on_cpu(dev):
    """A lazy module's state dict saved before its first forward holds uninitialized
    parameters; loading it copies each into the module's own (`copy_`, which
    UninitializedParameter allows, of nothing into nothing). On C-ABI chips the copy asked the
    uninitialized parameter for its .shape, which it refuses ("Can't access the shape of an
    uninitialized parameter")."""
    torch.manual_seed(0)
    expected_model = _lazy_net()
    expected_model.load_state_dict(_lazy_net().state_dict())
    expected = _train_step(expected_model, "cpu")
    torch.manual_seed(0)
    model = _lazy_net().to(dev)
    model.load_state_dict(_lazy_net().state_dict())
    assert all(is_lazy(p) and p.device == dev for p in model.parameters())
    _assert_same(_train_step(model, dev), expected)


def test_an_uninitialized_parameter_on_flagos_refuses_use_and_saves_as_on_cpu(dev):
    model = torch.nn.LazyLinear(3).to(dev)
    with pytest.raises(ValueError, match="Attempted to use an uninitialized parameter"):
        model.weight + 1
    with pytest.raises(RuntimeError, match="Can't access the shape of an uninitialized parameter"):
        _ = model.weight.shape
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert type(saved["weight"]) is UninitializedParameter  # what CPU saves: no device, no shape
    copied = copy.deepcopy(model)
    assert is_lazy(copied.weight) and copied.weight.device == dev and copied.weight is not model.weight
    torch.manual_seed(0)
    copied(torch.randn(2, 4).to(dev))
    assert copied.weight.shape == (3, 4) and is_lazy(model.weight)


def _scripted_net():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


@pytest.mark.filterwarnings("ignore:`torch.jit.[a-z_]+` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("compile_with", ["script", "trace"])
def test_a_scripted_module_moved_to_flagos_runs_and_trains_as_on_cpu(dev, compile_with):
    def compiled(net):
        if compile_with == "script":
            return torch.jit.script(net)
        return torch.jit.trace(net, torch.randn(3, 4, generator=torch.Generator().manual_seed(2)))

    torch.manual_seed(0)
    reference = compiled(_scripted_net())
    torch.manual_seed(0)
    model = compiled(_scripted_net())
    params = list(model.parameters())
    model.to(dev)
    assert all(p.device == dev for p in model.parameters())
    assert all(p is q for p, q in zip(model.parameters(), params))  # the objects an optimizer holds
    x = torch.randn(3, 4)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for m, device in ((reference, "cpu"), (model, dev)):
        m(x.to(device)).square().sum().backward()
    for optimizer in optimizers:
        optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(x.to(dev)).detach().cpu(), reference(x).detach(), rtol=1e-5, atol=1e-6)
    model.cpu()
    assert all(p.device.type == "cpu" and p is q for p, q in zip(model.parameters(), params))
    torch.testing.assert_close(model(x), reference(x))


def test_data_parallel_runs_a_model_over_the_flagos_devices_as_on_cpu(dev):
    """nn.DataParallel (a CUDA-written script wraps its model when it sees several devices)
    over every flagos device: outputs from flagos and host inputs are CPU's; training runs where
    the engine allows (one device), and with several it says why (NoEngineQueueError: backward
    on flagos:1), the process going on. Its copies failed: "module 'torch._C' has no attribute
    '_scatter'"."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = copy.deepcopy(reference).to(dev)
    wrapped = torch.nn.DataParallel(model)
    count = torch.flagos.device_count()
    assert wrapped.device_ids == list(range(count))
    x = torch.randn(6, 4)
    expected = reference(x)
    for given in (x.to(dev), x):
        out = wrapped(given)
        assert out.device == dev
        torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    if count > 1:
        with pytest.raises(flagos.NoEngineQueueError, match="flagos:1"):
            wrapped(x.to(dev)).square().sum().backward()
        model.zero_grad()
        wrapped = model  # one device trains
    wrapped(x.to(dev)).square().sum().backward()
    expected.square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Using -1 to represent CPU:FutureWarning")
def test_data_parallel_copies_between_flagos_devices_called_directly(dev):
    """torch.nn.parallel.comm's copies, as a program calls them itself, over flagos tensors:
    broadcast (one tensor and coalesced lists of one), scatter with chunk sizes, gather to a
    device, to the current one and to the host."""
    from torch.nn.parallel import comm

    devices = list(range(torch.flagos.device_count()))
    x = torch.arange(12.0).reshape(6, 2)
    on = x.to(dev)
    copies = comm.broadcast(on, devices)
    assert copies[0] is on and all(c.device.index == d and torch.equal(c.cpu(), x) for c, d in zip(copies, devices))
    (only,), *rest = comm.broadcast_coalesced([on], devices)
    assert only is on and all(r[0].device.index == d for r, d in zip(rest, devices[1:]))
    sizes = [6 - len(devices) + 1] + [1] * (len(devices) - 1)
    chunks = comm.scatter(on, devices, chunk_sizes=sizes)
    assert [c.shape[0] for c in chunks] == sizes and [c.device.index for c in chunks] == devices
    last = comm.gather(chunks, destination=devices[-1])
    assert last.device.index == devices[-1] and torch.equal(last.cpu(), x)
    for destination, want in ((None, dev), ("cpu", torch.device("cpu")), (-1, torch.device("cpu"))):
        gathered = comm.gather(chunks, destination=destination)
        assert gathered.device == want and torch.equal(gathered.cpu(), x)

"""The flagos device behaves like any PyTorch device (device mode, cpu chip)."""
import inspect
import io
import pathlib
import re
import types
import zipfile

import pytest
import torch
from conftest import CHIP, assert_close, device_mode_only, reference_device, run_python

import flagos
from flagos import _C
from flagos.chips.adapter import AdapterChip
from flagos.runtime._tensor import wrap

pytestmark = device_mode_only
README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_to_and_back(dev):
    x = torch.randn(3, 4)
    f = x.to(dev)
    assert f.device == dev and f.is_flagos and isinstance(f, flagos.FlagosTensor)
    back = f.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu"
    assert torch.equal(back, x)
    assert torch.equal(x.flagos().cpu(), x)
    assert f.to("cpu", torch.float64).dtype == torch.float64


def test_factories_on_flagos(dev):
    torch.manual_seed(3)
    a = torch.randn(2, 3, device="flagos")
    torch.manual_seed(3)
    b = torch.randn(2, 3, device=reference_device())   # the payload device's random numbers
    assert a.device == dev
    assert_close(a, b, atol=0, rtol=0)
    assert torch.equal(torch.ones(2, device=dev).cpu(), torch.ones(2))
    r = torch.arange(5, device=dev)  # an out= op that resizes its output
    assert r.shape == (5,) and torch.equal(r.cpu(), torch.arange(5))
    assert torch.equal(torch.full((2, 2), 7.0, device=dev).cpu(), torch.full((2, 2), 7.0))
    assert torch.tensor([1, 2], device=dev).device == dev
    assert torch.zeros_like(a).device == dev
    assert torch.empty(0, device=dev).numel() == 0


def test_elementwise_and_reductions_match_cpu(dev):
    x = torch.randn(4, 5)
    y = torch.randn(4, 5)
    fx, fy = x.to(dev), y.to(dev)
    for fn in (torch.add, torch.mul, torch.maximum, torch.atan2):
        assert_close(fn(fx, fy), fn(x, y))
    assert_close(fx.softmax(-1), x.softmax(-1))
    assert_close(fx.sum(0), x.sum(0))
    assert_close(fx @ fy.t(), x @ y.t())
    assert fx.sum().item() == pytest.approx(x.sum().item(), rel=1e-6)


def test_print(dev):
    text = repr(torch.tensor([1.0, 2.0], device=dev))
    assert text.startswith("tensor([1., 2.]") and "device='flagos:0'" in text
    assert "requires_grad=True" in repr(torch.ones(2, device=dev, requires_grad=True))
    assert "grad_fn=<MulBackward0>" in str(torch.ones(2, device=dev, requires_grad=True) * 2)


def test_views_alias_their_base(dev):
    a = torch.arange(12.0, device=dev).view(3, 4)
    row = a[1]
    row.mul_(10)
    assert a.cpu()[1].tolist() == [40.0, 50.0, 60.0, 70.0]
    t = a.t()
    assert t.stride() == (1, 4) and not t.is_contiguous()
    t[0, 0] = -1
    assert a.cpu()[0, 0].item() == -1
    assert a.view(-1).cpu()[0].item() == -1
    parts = a.split(1)
    parts[2].zero_()
    assert a.cpu()[2].sum().item() == 0


def test_inplace_view_ops_update_the_tensor(dev):
    b = torch.zeros(3, device=dev)
    b.unsqueeze_(0)
    assert b.shape == (1, 3) and b.cpu().shape == (1, 3)
    m = torch.arange(4.0, device=dev).view(2, 2)
    m.t_()
    assert m.stride() == (1, 2) and m.cpu().tolist() == [[0.0, 2.0], [1.0, 3.0]]


def test_inplace_and_out(dev):
    a = torch.ones(3, device=dev)
    same = a.add_(2)
    assert same is a and a.cpu().tolist() == [3.0, 3.0, 3.0]
    out = torch.empty(3, device=dev)
    res = torch.mul(a, 2, out=out)
    assert res is out and out.cpu().tolist() == [6.0, 6.0, 6.0]
    values, indices = torch.empty(0, device=dev), torch.empty(0, dtype=torch.long, device=dev)
    torch.max(torch.tensor([[1.0, 5.0], [7.0, 2.0]], device=dev), 1, out=(values, indices))
    assert values.cpu().tolist() == [5.0, 7.0] and indices.cpu().tolist() == [1, 0]


def test_autograd_matches_cpu(dev):
    torch.manual_seed(0)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    fw = w.detach().to(dev).requires_grad_()
    loss = torch.nn.functional.gelu(x @ w).pow(2).mean()
    floss = torch.nn.functional.gelu(x.to(dev) @ fw).pow(2).mean()
    loss.backward()
    floss.backward()
    assert fw.grad.device == dev
    assert_close(fw.grad, w.grad)


def test_module_and_optimizer_step(dev):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8),
                              torch.nn.Linear(8, 2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 2)).flagos()
    assert all(p.device == dev and isinstance(p, torch.nn.Parameter) for p in model.parameters())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    x = torch.randn(6, 4)
    for _ in range(3):
        for m, opt, inp in ((ref, opts[0], x), (model, opts[1], x.to(dev))):
            opt.zero_grad()
            m(inp).pow(2).mean().backward()
            opt.step()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert_close(q, p, atol=1e-6)


def test_save_and_load(dev, tmp_path):
    a = torch.randn(3, 3, device=dev)
    state = torch.nn.Linear(3, 2).to(dev).state_dict()
    path = tmp_path / "t.pt"
    torch.save({"a": a, "state": state}, path)
    on_cpu = torch.load(path, map_location="cpu")
    assert on_cpu["a"].device.type == "cpu" and torch.equal(on_cpu["a"], a.cpu())
    back = torch.load(path)
    assert back["a"].device == dev and torch.equal(back["a"].cpu(), a.cpu())
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, map_location=dev).cpu(), a.cpu())


def _saved_records(buf: io.BytesIO) -> list[int]:
    """The sizes of the storages a torch.save file holds."""
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        return sorted(i.file_size for i in z.infolist() if "/data/" in i.filename)


def _saved_state(device):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head).to(device)
    x = torch.arange(24.0).reshape(4, 6).to(device)
    p = torch.nn.Parameter(torch.randn(3).to(device))
    p.note = "kept"
    return {"x": x, "slice": x[1:3, 2:], "xt": x.t(), "p": p, "model": model,
            "state": model.state_dict()}


def test_save_writes_each_memory_once_and_parameters_stay_parameters(dev):
    """torch.save of flagos tensors as of CPU ones: tensors over one memory (a slice, a
    transpose, tied weights in a state dict) are written once, and load with map_location="cpu"
    sharing it; a Parameter, alone or in a saved module, loads as a Parameter with its
    attributes, on flagos and on the host."""
    files = {}
    for device in ("cpu", dev):
        buf = io.BytesIO()
        torch.save(_saved_state(device), buf)
        files[str(device)] = buf
    ref, got = files["cpu"], files[str(dev)]
    assert _saved_records(got) == _saved_records(ref)  # x once, p, the tied weight once
    ref.seek(0)
    want = torch.load(ref, weights_only=False)
    for location in ("cpu", None):
        got.seek(0)
        out = torch.load(got, map_location=location, weights_only=False)
        on = torch.device("cpu") if location == "cpu" else dev
        for key in ("x", "slice", "xt", "p"):
            assert out[key].device == on and torch.equal(out[key].cpu(), want[key].detach()), key
        assert isinstance(out["p"], torch.nn.Parameter) and out["p"].note == "kept"
        assert not isinstance(out["x"], torch.nn.Parameter)
        model = out["model"]
        assert all(isinstance(q, torch.nn.Parameter) and q.device == on for q in model.parameters())
        assert model[0].weight is model[1].weight
        tokens = torch.tensor([1, 3])
        assert_close(model(tokens.to(on)), want["model"](tokens))
        assert sorted(out["state"]) == sorted(want["state"])
    tensors = _saved_state(dev)
    del tensors["model"]
    got = io.BytesIO()
    torch.save(tensors, got)
    got.seek(0)
    out = torch.load(got, map_location="cpu", weights_only=True)  # PyTorch's own rebuilds only
    out["x"].add_(1)  # one host storage, as CPU's load gives
    assert torch.equal(out["slice"], want["slice"] + 1) and torch.equal(out["xt"], want["xt"] + 1)
    assert out["state"]["0.weight"].data_ptr() == out["state"]["1.weight"].data_ptr()
    assert isinstance(out["p"], torch.nn.Parameter)



@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_a_saved_flagos_checkpoint_loads_back_as_on_cpu_in_either_format(dev, zip_format):
    """A file of flagos tensors in the zip format or the legacy one
    (`_use_new_zipfile_serialization=False`), loaded in place, onto the host or onto flagos:
    the values CPU's file gives, tensors that shared memory sharing it again (tied weights, a
    slice, a transpose), Parameters kept. The legacy format's rebuild ran before the values
    were read (whatever the memory held) and ignored map_location; tensors loaded onto flagos
    each got memory of their own."""
    files = {}
    for device in ("cpu", dev):
        buf = io.BytesIO()
        state = _saved_state(device)
        state["held"] = types.SimpleNamespace(mask=state["x"][0])  # an object of the program's
        torch.save(state, buf, _use_new_zipfile_serialization=zip_format)
        files[str(device)] = buf
    files["cpu"].seek(0)
    want = torch.load(files["cpu"], weights_only=False)
    got = files[str(dev)]
    for location, on in ((None, dev), ("cpu", torch.device("cpu")), ({str(dev): "cpu"}, torch.device("cpu")),
                         (dev, dev)):
        got.seek(0)
        out = torch.load(got, map_location=location, weights_only=False)
        for key in ("x", "slice", "xt", "p"):
            assert out[key].device == on and torch.equal(out[key].detach().cpu(), want[key].detach()), (location, key)
        mask = out["held"].mask  # where no walk of the result reaches: on the device too
        assert mask.device == on and torch.equal(mask.cpu(), want["held"].mask)
        assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad and out["p"].note == "kept"
        model = out["model"]
        assert model[0].weight is model[1].weight and model[0].weight.device == on
        assert_close(model(torch.tensor([1, 3]).to(on)), want["model"](torch.tensor([1, 3])))
        state = out["state"]
        assert state["0.weight"].data_ptr() == state["1.weight"].data_ptr()  # tied in the file
        with torch.no_grad():
            out["x"].add_(1)  # one memory, as CPU's load gives
        assert torch.equal(out["slice"].cpu(), want["slice"] + 1)
        assert torch.equal(out["xt"].cpu(), want["xt"] + 1)
    got.seek(0)
    out = torch.load(got, "cpu", weights_only=False)  # map_location given by position
    assert out["x"].device.type == "cpu" and torch.equal(out["x"], want["x"])


def test_conjugate_and_negative_views_saved_from_flagos_load_with_their_values(dev):
    """A conjugate view and a negative one (`z.conj()`, `z.conj().imag`) are saved with the
    values they show, not the memory they read, as from the CPU."""
    z = torch.complex(torch.arange(3.0), torch.arange(3.0) + 1)
    views = {"conj": z.conj(), "neg": z.conj().imag, "plain": z.real}
    for device in (dev, "cpu"):
        on = z.to(device)
        for key, view in (("conj", on.conj()), ("neg", on.conj().imag), ("plain", on.real)):
            buf = io.BytesIO()  # one file each: a file may not view one memory as two dtypes
            torch.save(view, buf)
            buf.seek(0)
            out = torch.load(buf, map_location="cpu", weights_only=True)
            want = views[key]
            assert torch.equal(out.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg()), (device, key)


class _DeviceRecord:
    """Unpickles as PyTorch's record of a tensor on a device without storages, its host data of
    another dtype than the tensor's (as other writers than flagos may make it)."""

    def __init__(self, device):
        self.device = device

    def __reduce__(self):
        return torch._utils._rebuild_device_tensor_from_cpu_tensor, (
            torch.arange(4, dtype=torch.int32), torch.float64, self.device, False)


def test_a_device_record_of_another_dtype_loads_as_pytorchs_rebuild_makes_it(dev):
    """PyTorch's rebuild converts a record's host data to the record's dtype on its device;
    inside a load flagos shares one copy per storage, but not for data of another dtype."""
    for device, on in (("cpu", torch.device("cpu")), (str(dev), dev)):
        buf = io.BytesIO()
        torch.save([_DeviceRecord(device)], buf)
        buf.seek(0)
        (out,) = torch.load(buf, weights_only=False)
        assert out.device == on and out.dtype == torch.float64
        assert torch.equal(out.cpu(), torch.arange(4, dtype=torch.float64))


def test_weights_only_load_of_flagos_tensors_after_one_before_activation():
    """A `weights_only=True` load keeps the functions it may call from its first use: a
    checkpoint loaded before flagos was active must not keep PyTorch's rebuild in flagos's stead
    (each tensor then got memory of its own: views of one tensor no longer shared it)."""
    proc = run_python(f"""
import io, torch
buf = io.BytesIO(); torch.save({{"w": torch.ones(2)}}, buf); buf.seek(0)
torch.load(buf, weights_only=True)
import flagos
flagos.activate("{CHIP}")
w = torch.arange(3.0).to(flagos.device())
buf = io.BytesIO(); torch.save({{"w": w, "tail": w[1:]}}, buf); buf.seek(0)
out = torch.load(buf, weights_only=True)
out["w"].add_(1)  # flagos's rebuild: the two share memory again, as a CPU checkpoint's do
print("LOADED", out["w"].device, out["tail"].tolist())
""", env={"FLAGOS_FALLBACK": "allow"}, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "LOADED flagos:0 [2.0, 3.0]" in proc.stdout


def test_save_and_load_keep_pytorchs_names_and_documentation():
    """flagos wraps torch.save and torch.load (one memory written once, tensors restored onto
    flagos): help() and tools that read signatures see PyTorch's."""
    for wrapped, name in ((torch.save, "save"), (torch.load, "load")):
        assert wrapped.__name__ == name and wrapped.__doc__ and "torch" in wrapped.__doc__
        assert inspect.signature(wrapped) == inspect.signature(getattr(wrapped, "__flagos_" + name + "__"))


def test_load_with_map_location_flagos_lands_on_the_device(dev):
    """A host checkpoint loaded with map_location naming flagos is on flagos, as with "cuda":
    tensors that shared a storage share one (tied weights, a transpose, a slice), with their
    strides, requires_grad and Parameter class; nothing else is moved."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    w = torch.randn(4, 6)
    state = {"w": w, "wt": w.t(), "slice": w[1:3, 2:], "p": torch.nn.Parameter(torch.randn(3)),
             "g": torch.randn(2, requires_grad=True), "i": torch.arange(5),
             "half": torch.randn(3).half(), "nested": [torch.ones(2), (torch.zeros(1),)],
             "model": torch.nn.Sequential(emb, head)}
    state["p"].note = "kept"  # a Parameter's Python attributes, saved with it
    buf = io.BytesIO()
    torch.save(state, buf)
    for location in ("flagos", dev, str(dev), {"cpu": "flagos"}, {"cpu": dev}):
        buf.seek(0)
        out = torch.load(buf, map_location=location, weights_only=False)
        for key in ("w", "wt", "slice", "p", "g", "i", "half"):
            got, want = out[key], state[key]
            assert got.device == dev and torch.equal(got.cpu(), want.detach()), key
            assert (got.stride(), got.requires_grad, got.is_leaf) == (want.stride(), want.requires_grad, True), key
        assert isinstance(out["p"], torch.nn.Parameter) and not isinstance(out["w"], torch.nn.Parameter)
        assert out["p"].note == "kept"
        assert out["nested"][0].device == dev and out["nested"][1][0].device == dev
        out["w"].add_(1)  # one storage: the transpose and the slice see the write
        assert torch.equal(out["wt"].cpu(), (w + 1).t()) and torch.equal(out["slice"].cpu(), (w + 1)[1:3, 2:])
        model = out["model"]
        assert model[0].weight.device == dev and model[0].weight is model[1].weight
        tokens = torch.tensor([1, 2])
        torch.testing.assert_close(model(tokens.to(dev)).cpu(), state["model"](tokens))
    for location in ("cpu", None, {"cuda:0": "flagos"}):  # the map keeps them on the host
        buf.seek(0)
        assert torch.load(buf, map_location=location, weights_only=False)["w"].device.type == "cpu"
    with pytest.raises(RuntimeError, match="Make a tensor instead"):
        torch.UntypedStorage(8).to(device="flagos")


class _HoldsACheckpoint:
    """Unpickled by loading a checkpoint of its own: a torch.load inside a torch.load."""

    def __init__(self, blob: bytes):
        self.blob = blob

    def __reduce__(self):
        return _load_inner, (self.blob,)


def _load_inner(blob: bytes):
    holder = _HoldsACheckpoint(blob)
    holder.tensor = torch.load(io.BytesIO(blob), map_location="cpu")
    holder.on_flagos = torch.load(io.BytesIO(blob), map_location="flagos")
    return holder


def test_a_load_inside_a_load_moves_what_each_asked_for(dev):
    inner, outer = io.BytesIO(), io.BytesIO()
    torch.save(torch.arange(3.0), inner)
    torch.save({"holder": _HoldsACheckpoint(inner.getvalue()), "w": torch.ones(2)}, outer)
    outer.seek(0)
    out = torch.load(outer, map_location="flagos", weights_only=False)
    assert out["w"].device == dev
    assert out["holder"].tensor.device.type == "cpu" and out["holder"].on_flagos.device == dev
    assert torch.equal(out["holder"].on_flagos.cpu(), torch.arange(3.0))


def test_torch_load_keeps_its_name_and_signature(dev):
    """Libraries read torch.load's signature (transformers asks whether it takes
    weights_only): the wrapper that lands checkpoints on flagos must not hide it."""
    original = torch.load.__flagos_load__
    assert torch.load is not original  # the wrapper is installed
    assert torch.load.__name__ == "load" and torch.load.__doc__ == original.__doc__
    assert inspect.signature(torch.load) == inspect.signature(original)
    assert "weights_only" in inspect.signature(torch.load).parameters


def test_device_module(dev):
    m = torch.flagos
    count = len([d for d in flagos.list_devices() if d.chip == CHIP])
    assert m.is_available() and m.device_count() == count >= 1 and m.current_device() == 0
    m.set_device(0)
    with m.device(0):
        assert m.current_device() == 0
    m.synchronize()
    base = m.memory_allocated()
    held = torch.empty(1000, device=dev)
    # sim counts its pool byte for byte, opencl its size classes (512-byte steps), and it keeps
    # freed buffers for reuse; PyTorch keeps no allocator statistics for the CPU (0)
    grown = {"sim": 4000, "opencl": 4096}.get(CHIP, 0)
    assert m.memory_allocated() == base + grown and m.max_memory_allocated() >= base + grown
    if CHIP != "opencl":
        assert m.memory_reserved() == m.memory_allocated()
    del held
    assert m.memory_allocated() == base
    assert m.memory_reserved() >= m.memory_allocated()
    m.reset_peak_memory_stats()
    m.empty_cache()
    free, total = m.mem_get_info()
    assert 0 < free <= total
    m.manual_seed(7)
    a = torch.randn(3, device=dev)
    state = m.get_rng_state()
    b = torch.randn(3, device=dev)
    m.set_rng_state(state)
    assert torch.equal(torch.randn(3, device=dev).cpu(), b.cpu())
    m.manual_seed_all(7)
    assert torch.equal(torch.randn(3, device=dev).cpu(), a.cpu())
    assert m.info()["chip"] == CHIP
    with pytest.raises(ValueError, match="does not exist"):
        m.set_device(count)
    for missing in (count, -1):  # an index past the end or below zero names the device
        with pytest.raises(ValueError, match=f"flagos:{missing} does not exist"):
            m.memory_allocated(missing)


def test_accelerator_reports_flagos(dev):
    if not hasattr(torch, "accelerator"):
        pytest.skip("torch.accelerator needs PyTorch >= 2.6")
    assert torch.accelerator.current_accelerator().type == "flagos"


def test_public_api(dev):
    info = flagos.activate(CHIP)  # same chip again: no-op
    assert info["chip"] == CHIP and info["mode"] == "device" and info["device"] == "flagos:0"
    assert flagos.device() == torch.device("flagos", 0) == flagos.device(0)
    devices = flagos.list_devices()
    mine = [d for d in devices if d.chip == CHIP]
    assert mine and mine[0].available and mine[0].total_memory > 0 and "float32" in mine[0].native_dtypes
    assert len(mine) == info["device_count"]
    assert all(d.available for d in devices)   # absent chips' rows only when asked for
    absent = [d for d in flagos.list_devices(include_unavailable=True) if not d.available]
    assert absent and all(d.chip not in ("cpu", CHIP) for d in absent)   # no machine has every vendor
    for row in absent:   # a torch-native chip's dtypes are its profile's; an adapter's come from its library
        profile = flagos.chips.profile(row.chip)
        assert row.native_dtypes == (() if isinstance(profile, AdapterChip) else profile.native_dtypes)
        assert (row.name, row.total_memory, row.index) == ("not found", 0, 0)
    low, high = re.search(r"flagos accepts PyTorch (\d+\.\d+) to (\d+\.\d+)", README).groups()
    assert flagos.info()["torch_tested"] == f"{low} to {high}"  # what README.md promises


def test_info_says_what_flagos_runs_on_and_how_it_is_configured(dev, monkeypatch):
    monkeypatch.delenv("FLAGOS_FALLBACK", raising=False)
    monkeypatch.delenv("FLAGOS_REPORT", raising=False)
    info = flagos.info()
    chip = flagos.chips.profile(CHIP)
    assert (info["active"], info["fallback"], info["report_path"]) == (True, "warn", None)
    assert (info["dtype_policy"], info["downcast_to"], info["redirect_cuda"], info["backward"]) == \
        ("strict", None, False, True)
    assert info["devices"] == [chip.device_name(i) for i in range(info["device_count"])]
    assert (info["vendor"], info["collective_backend"]) == (chip.vendor, chip.collective_backend)
    assert info["native_dtypes"] == list(chip.native_dtypes)
    monkeypatch.setenv("FLAGOS_FALLBACK", "error")
    monkeypatch.setenv("FLAGOS_REPORT", "/tmp/flagos-report.json")
    info = flagos.info()
    assert (info["fallback"], info["report_path"]) == ("error", "/tmp/flagos-report.json")


@pytest.mark.skipif(flagos.chips.profile(CHIP).torch_type is None,
                    reason="a C-ABI chip's payloads are adapter buffers, not torch tensors")
def test_wrap_puts_a_payload_behind_a_flagos_tensor_and_refuses_anything_else(dev):
    """The C wrap that every compiled graph's output passes through: the payload's layout,
    conjugate bit and requires_grad, on the payload's own flagos device or the one asked for;
    a clear error for anything but a chip tensor or a device that does not exist."""
    base = torch.randn(4, 6, device=reference_device())
    for payload in (base, base.t(), base[1:, ::2], torch.randn(3, dtype=torch.complex64).conj()):
        w = wrap(payload)
        assert isinstance(w, flagos.FlagosTensor) and w.device == dev and w._payload is payload
        assert (w.shape, w.stride(), w.storage_offset(), w.dtype) == (
            payload.shape, payload.stride(), payload.storage_offset(), payload.dtype)
        assert (w.is_conj(), w.requires_grad) == (payload.is_conj(), False)
        assert torch.equal(w.cpu(), payload.cpu())
    leaf = wrap(torch.randn(2, device=reference_device(), requires_grad=True))
    assert leaf.requires_grad and leaf.is_leaf
    assert wrap(base, 0).device == torch.device("flagos", 0)
    with pytest.raises(RuntimeError, match=f"chip device {torch.flagos.device_count()} has no flagos device"):
        wrap(base, torch.flagos.device_count())
    for bad in ((3,), (wrap(base),), (base, "0"), ()):
        with pytest.raises(TypeError, match=r"wrap"):
            _C.wrap(*bad)


def test_the_compiled_call_counter_counts_and_resets():
    """The report's count of compiled-graph calls lives in C (each compiled graph's code calls
    count_compiled_call): read, read and reset, then counting from zero again."""
    _C.compiled_calls(True)
    for _ in range(3):
        _C.count_compiled_call()
    assert _C.compiled_calls() == 3 and flagos.fallback_report().compiled_calls == 3
    assert _C.compiled_calls(True) == 3 and _C.compiled_calls() == 0
    with pytest.raises(TypeError, match=r"compiled_calls\(reset=False\)"):
        _C.compiled_calls(True, False)


def test_torch_dispatch_called_directly_takes_its_optional_arguments(dev):
    """`FlagosTensor.__torch_dispatch__(func, types, args=(), kwargs=None)` as PyTorch's protocol
    writes it: called by hand (a library forwarding an op), args and kwargs may be left out."""
    a, b = torch.arange(3.0), torch.ones(3)
    cls = type(a.to(dev))
    dispatch = cls.__torch_dispatch__
    assert dispatch(torch.ops.aten.add.Tensor, (cls,), (a.to(dev), b.to(dev))).cpu().tolist() == (a + b).tolist()
    assert dispatch(torch.ops.aten.add.Tensor, (cls,), (a.to(dev), b.to(dev)),
                    {"alpha": 2}).cpu().tolist() == torch.add(a, b, alpha=2).tolist()
    made = dispatch(torch.ops.aten.ones.default, (cls,), ([2],), {"device": dev})
    assert made.device == dev and made.cpu().tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match="dispatch"):
        dispatch(torch.ops.aten.add.Tensor)

"""The libraries' own workflows on flagos, compared with the same run on plain CPU."""
import copy
import hashlib
import io
import json
import os
import warnings

import numpy
import pytest
import torch
from conftest import CHIP, device_mode_only, run_python

import flagos

pytestmark = device_mode_only


def saved(folder) -> dict:
    """Every file a save wrote under folder: relative name -> bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_storage_names_the_memory_a_tensor_views(dev):
    """What safetensors, huggingface_hub and transformers ask to find tensors that share memory
    (tied weights): views of one flagos tensor have one storage, other tensors have others."""
    base = torch.arange(12.0).to(dev)
    twin = torch.arange(12.0).to(dev)  # equal values, its own memory
    storage = base.untyped_storage()
    assert storage.nbytes() == 48 and storage.data_ptr() != 0
    assert base.data_ptr() == storage.data_ptr()
    for view in (base[4:], base.view(3, 4).t(), base.detach(), base.view(2, 6)[1]):
        assert view.untyped_storage().data_ptr() == storage.data_ptr()
        assert view.untyped_storage().nbytes() == 48
        assert view.data_ptr() == storage.data_ptr() + view.storage_offset() * 4
    for other in (twin, base.clone(), base[4:].contiguous().add(0)):
        assert other.untyped_storage().data_ptr() != storage.data_ptr()
    assert base[4:].contiguous().untyped_storage().nbytes() == 48  # still a view: already contiguous
    assert base[4:].clone().untyped_storage().nbytes() == 32
    if CHIP == "sim":  # it names the buffer and holds no data: reading through it is an error
        with pytest.raises(RuntimeError):
            copy.deepcopy(storage)
        # that says what it is and what to use instead (PyTorch's own words were "Trying to
        # resize storage that is not resizable" and a meta error)
        for use in (storage.tolist, storage.cpu, storage.clone, lambda: storage.fill_(0),
                    lambda: storage[0], base.storage().tolist, lambda: base.storage().__setitem__(0, 1.0)):
            with pytest.raises(RuntimeError, match=r"holds none of its memory: read and write the tensor instead \(tensor\.cpu\(\)"):
                use()
        with pytest.raises(RuntimeError, match="FSDP2, which resizes its parameters' storages, needs a torch-native chip"):
            storage.resize_(0)
        assert base.tolist() == list(range(12))  # the tensor itself is untouched
    tied = torch.nn.Linear(4, 4).to(dev)
    state = {"a": tied.weight, "b": tied.weight.detach(), "c": tied.bias}
    ids = {k: (v.untyped_storage().data_ptr(), v.untyped_storage().nbytes()) for k, v in state.items()}
    assert ids["a"] == ids["b"] != ids["c"]


def test_other_storages_keep_pytorchs_own_errors_and_methods():
    """flagos words a C-ABI chip's stand-in storage failing; a host storage that cannot resize
    (numpy's memory) and a plain meta storage (no address) fail in PyTorch's own words, and
    the guarded methods keep PyTorch's names and docs."""
    host = torch.from_numpy(numpy.zeros(4, dtype=numpy.float32)).untyped_storage()
    with pytest.raises(RuntimeError, match="Trying to resize storage that is not resizable"):
        host.resize_(64)
    meta = torch.empty(4, device="meta").untyped_storage()
    assert meta.data_ptr() == 0
    with pytest.raises((RuntimeError, NotImplementedError)) as raised:
        meta.tolist()
    assert "C-ABI chip" not in str(raised.value)
    for name in ("tolist", "resize_", "fill_", "cpu"):
        assert getattr(torch.UntypedStorage, name).__name__ == name
        assert getattr(torch.UntypedStorage, name).__doc__ == getattr(torch._C.StorageBase, name, getattr(torch.UntypedStorage, name)).__doc__


def test_huggingface_hub_judges_flagos_views_as_it_judges_cpu_ones(dev):
    """Whether a tensor covers its whole storage (huggingface_hub clones the ones that do not
    before saving), its storage's size and which tensors share one: the answers for views of
    a flagos tensor are those for the same views of a CPU tensor."""
    hub = pytest.importorskip("huggingface_hub.serialization._torch")

    def views(base):
        return [base, base[0], base[1], base.t(), base.view(-1)[:5], base.view(-1), base.detach()]

    cpu, on_dev = torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3).to(dev)
    assert [hub._is_complete(v) for v in views(on_dev)] == [hub._is_complete(v) for v in views(cpu)] == \
        [True, False, False, True, False, True, True]
    assert [hub.get_torch_storage_size(v) for v in views(on_dev)] == [24] * 7
    ids = [hub._get_unique_id(v) for v in views(on_dev)] + [hub._get_unique_id(on_dev.clone())]
    assert len(set(ids[:-1])) == 1 and ids[-1] != ids[0]


def test_safetensors_save_file_writes_the_bytes_of_a_cpu_save(dev, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    tensors = {"w": torch.randn(3, 4), "half": torch.randn(5).half(), "bf16": torch.randn(2, 3).bfloat16(),
               "i": torch.arange(5), "flag": torch.tensor([True, False]), "scalar": torch.tensor(3.5)}
    metadata = {"format": "pt"}
    safetensors_torch.save_file(tensors, tmp_path / "cpu.safetensors", metadata=metadata)
    safetensors_torch.save_file({k: v.to(dev) for k, v in tensors.items()}, tmp_path / "dev.safetensors",
                                metadata=metadata)
    assert (tmp_path / "dev.safetensors").read_bytes() == (tmp_path / "cpu.safetensors").read_bytes()
    loaded = safetensors_torch.load_file(tmp_path / "dev.safetensors")
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tensors.items())
    # a tensor and a view of it share memory, as on CPU; equal values in two tensors do not
    base = torch.randn(4, 4).to(dev)
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors_torch.save_file({"a": base, "b": base[0]}, tmp_path / "shared.safetensors")
    safetensors_torch.save_file({"a": base, "b": base.clone()}, tmp_path / "apart.safetensors")
    # save_model keeps one name of a tied weight, the one CPU keeps
    torch.manual_seed(0)
    tied = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Linear(4, 6, bias=False))
    tied[1].weight = tied[0].weight
    safetensors_torch.save_model(tied, tmp_path / "tied-cpu.safetensors")
    safetensors_torch.save_model(tied.to(dev), tmp_path / "tied-dev.safetensors")
    written = (tmp_path / "tied-dev.safetensors").read_bytes()
    assert written == (tmp_path / "tied-cpu.safetensors").read_bytes()
    assert len(safetensors_torch.load_file(tmp_path / "tied-dev.safetensors")) == 1


def test_huggingface_hub_shards_a_flagos_state_dict_as_a_cpu_one(dev, tmp_path):
    """Shard sizes, the shared tensors kept once, the files and the index: all as on CPU."""
    hub = pytest.importorskip("huggingface_hub")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 64))
    model[2].weight = model[0].weight
    (tmp_path / "cpu").mkdir()
    (tmp_path / "dev").mkdir()
    state = model.state_dict()
    expected = hub.split_torch_state_dict_into_shards(state, max_shard_size="6KB")
    hub.save_torch_state_dict(dict(state), tmp_path / "cpu", max_shard_size="6KB")
    state = model.to(dev).state_dict()
    split = hub.split_torch_state_dict_into_shards(state, max_shard_size="6KB")
    assert split.filename_to_tensors == expected.filename_to_tensors and split.is_sharded
    assert split.metadata == expected.metadata
    hub.save_torch_state_dict(dict(state), tmp_path / "dev", max_shard_size="6KB")
    assert saved(tmp_path / "dev") == saved(tmp_path / "cpu")
    assert hub.get_torch_storage_id(state["0.weight"]) == hub.get_torch_storage_id(state["2.weight"])
    assert hub.get_torch_storage_id(state["1.weight"]) != hub.get_torch_storage_id(state["2.weight"])
    assert hub.get_torch_storage_size(state["1.weight"]) == 32 * 32 * 4


def tiny_transformer(arch: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "bert":
        config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, intermediate_size=64,
                                         max_position_embeddings=32)
        return transformers.BertModel(config).eval()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("arch,dtype", [("bert", torch.float32), ("llama-tied", torch.float32),
                                        ("llama-tied", torch.bfloat16)],
                         ids=["bert", "llama-tied", "llama-tied-bf16"])
def test_transformers_save_pretrained_writes_the_files_of_a_cpu_save(dev, tmp_path, arch, dtype):
    model = tiny_transformer(arch).to(dtype)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # a live graph would keep module.to() from swapping the parameters
        expected = model(input_ids=ids)[0]
    model.save_pretrained(tmp_path / "cpu", max_shard_size="20KB")
    model.to(dev).save_pretrained(tmp_path / "dev", max_shard_size="20KB")
    files = saved(tmp_path / "dev")
    assert files == saved(tmp_path / "cpu")
    assert sum(name.endswith(".safetensors") for name in files) > 1  # sharded, with an index
    back = type(model).from_pretrained(tmp_path / "dev", dtype=dtype)
    if arch == "llama-tied":  # the tied head was saved once, as on CPU, and is tied again
        assert "lm_head.weight" not in json.loads(files["model.safetensors.index.json"])["weight_map"]
        assert back.lm_head.weight is back.model.embed_tokens.weight
    back = back.to(dev).eval()
    with torch.no_grad():
        actual = back(input_ids=ids.to(dev))[0].cpu()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 if dtype == torch.float32 else 1e-2)


def tiny_diffusers_model(kind: str):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    if kind == "unet":
        return diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                     block_out_channels=(8, 16), norm_num_groups=4,
                                     down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                     up_block_types=("AttnUpBlock2D", "UpBlock2D")).eval()
    return diffusers.AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3,
                                   latent_channels=4, norm_num_groups=4, layers_per_block=1,
                                   down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2).eval()


def run_diffusers_model(model, x):
    with torch.no_grad():
        return model(x, 10).sample if hasattr(model, "time_embedding") else model(x).sample


@pytest.mark.parametrize("kind", ["unet", "vae"])
@pytest.mark.parametrize("dtype,variant", [(torch.float32, None), (torch.float16, "fp16"),
                                           (torch.bfloat16, None)], ids=["fp32", "fp16-variant", "bf16"])
def test_diffusers_save_pretrained_writes_the_files_of_a_cpu_save(dev, tmp_path, kind, dtype, variant):
    model = tiny_diffusers_model(kind).to(dtype)
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    expected = run_diffusers_model(model, x) if dtype == torch.float32 else None
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "cpu", variant=variant, max_shard_size="100KB")
    model.to(dev).save_pretrained(tmp_path / "dev", variant=variant, max_shard_size="100KB")
    files = saved(tmp_path / "dev")
    assert files == saved(tmp_path / "cpu")
    # 100KB shards: two and an index at float32, one file at half the size
    assert any(name.endswith(".index.json") for name in files) == (dtype == torch.float32)
    if variant:
        assert any(name.endswith(f".{variant}.safetensors") for name in files)
    back = type(model).from_pretrained(tmp_path / "dev", variant=variant, torch_dtype=dtype)
    assert all(torch.equal(v, weights[k]) and v.dtype == dtype for k, v in back.state_dict().items())
    if expected is not None:
        actual = run_diffusers_model(back.to(dev).eval(), x.to(dev)).cpu()
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def torch_saved_state(device) -> bytes:
    """torch.save of a small seeded fp16 state dict, and a step counter, on device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(torch.float16)
    buffer = io.BytesIO()
    torch.save(dict(model.to(device).state_dict(), step=torch.tensor(3).to(device)), buffer)
    return buffer.getvalue()


def test_torch_save_of_flagos_tensors_is_the_same_file_on_every_chip(dev):
    """torch.save stores a host copy of each flagos tensor that loads back onto flagos (or onto the
    host with map_location), and the file is the same whichever chip the tensors were on."""
    written = torch_saved_state(dev)
    other = run_python(f"""
        import hashlib, sys, flagos
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_ecosystem import torch_saved_state
        flagos.activate({"sim" if CHIP == "cpu" else "cpu"!r})
        print(hashlib.sha256(torch_saved_state(flagos.device())).hexdigest())
    """)
    assert hashlib.sha256(written).hexdigest() == other.stdout.split()[-1]
    expected = torch.load(io.BytesIO(torch_saved_state("cpu")), weights_only=True)
    for location, device in ((None, dev), ("cpu", torch.device("cpu"))):
        loaded = torch.load(io.BytesIO(written), map_location=location, weights_only=True)
        assert loaded.keys() == expected.keys()
        for key, value in loaded.items():
            assert value.device == device and torch.equal(value.cpu(), expected[key])


def test_pinned_dataloader_batches_move_with_non_blocking(dev):
    data = torch.utils.data.TensorDataset(torch.arange(24.0).reshape(12, 2), torch.arange(12))
    loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True)
    seen = []
    for x, y in loader:
        xd = x.to(dev, non_blocking=True)
        seen.append((xd * 2).sum().item() + y.to(dev, non_blocking=True).sum().item())
    assert seen == [(x * 2).sum().item() + y.sum().item()
                    for x, y in torch.utils.data.DataLoader(data, batch_size=4)]
    t = torch.ones(3)
    pinned = t.pin_memory()
    assert pinned.device.type == "cpu" and pinned.data_ptr() != t.data_ptr()  # a copy, as pinning
    assert pinned.tolist() == [1.0, 1.0, 1.0]
    # the deprecated device argument, as older scripts pass it: pinned for flagos, not refused
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for device in ("flagos", torch.device("flagos")):
            for_flagos = t.pin_memory(device)
            assert for_flagos.tolist() == [1.0, 1.0, 1.0] and for_flagos.data_ptr() != t.data_ptr()
            assert not t.is_pinned(device)
        # another device named: PyTorch's own answer, as without flagos
        with pytest.raises(RuntimeError, match="CPU device type not an accelerator"):
            t.pin_memory("cpu")
        assert t.is_pinned("cpu") is False and t.is_pinned("meta") is False
    on_flagos = t.to(dev)  # device memory: refused as for a CUDA tensor, and nothing falls back
    calls_before = flagos.fallback_report().calls("fallback")
    assert on_flagos.is_pinned() is False
    with pytest.raises(RuntimeError, match=r"cannot pin 'torch.flagos.FloatTensor' only dense CPU tensors"):
        on_flagos.pin_memory()
    assert flagos.fallback_report().calls("fallback") == calls_before


def test_safetensors_load_file_onto_flagos(dev, tmp_path):
    """safetensors checks device names against its own list; flagos loads through the host."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(3, 4), "i": torch.arange(5)}
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    for device in (dev, "flagos", str(dev)):
        loaded = safetensors_torch.load_file(str(path), device=device)
        assert {k: v.device for k, v in loaded.items()} == {"w": dev, "i": dev}
        for key, value in tensors.items():
            torch.testing.assert_close(loaded[key].cpu(), value)
    assert safetensors_torch.load_file(str(path))["w"].device.type == "cpu"
    # a name that is no device at all gets safetensors' own error, as without flagos
    with pytest.raises(Exception) as flagos_error:
        safetensors_torch.load_file(str(path), device="nonsense")
    with pytest.raises(Exception) as own_error:
        safetensors_torch.load_file.__wrapped__(str(path), device="nonsense")
    assert (type(flagos_error.value), str(flagos_error.value)) == (type(own_error.value), str(own_error.value))
    assert "device nonsense is invalid" in str(own_error.value)


def test_dlpack_exports_the_chips_memory(dev):
    """DLPack shares memory in place, so what a flagos tensor exports is its chip's memory: on
    a torch-native chip the payload's (the cpu chip's is host memory, which numpy and PyTorch
    import as CPU arrays sharing it); a C-ABI chip's memory is the adapter's, so the export is
    refused with BufferError naming .cpu(), unless the consumer asks for a host copy."""
    import numpy as np

    base = torch.arange(6.0).reshape(2, 3)
    t = base.to(dev)
    view, host_view = t[:, 1:], base[:, 1:]
    with pytest.raises(BufferError, match="detach"):
        torch.from_dlpack(t.clone().requires_grad_())
    for source in (t, base):  # device and copy are keyword-only, as in PyTorch's own
        with pytest.raises(TypeError):
            torch.from_dlpack(source, "cpu")
    if CHIP == "cpu":
        assert t.__dlpack_device__() == (torch.utils.dlpack.DLDeviceType.kDLCPU, 0)
        exports = [torch.from_dlpack(view), torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(view)),
                   torch.from_dlpack(torch.to_dlpack(view)), torch.from_numpy(np.from_dlpack(view))]
        for e in exports:
            assert e.device.type == "cpu" and e.stride() == host_view.stride()
            assert torch.equal(e, host_view)
        exports[0][1, 1] = -1.0  # the same memory: a write through the export is on the device
        assert t[1, 2].item() == -1.0
    else:
        assert t.__dlpack_device__() == (torch.utils.dlpack.DLDeviceType.kDLExtDev, t.device.index)
        for export in (lambda: torch.from_dlpack(view), lambda: torch.utils.dlpack.to_dlpack(view),
                       lambda: torch.to_dlpack(view), lambda: np.from_dlpack(view)):
            with pytest.raises(BufferError, match=r"tensor\.cpu\(\)"):
                export()
        copied = np.from_dlpack(view, device="cpu")  # a host copy asked for: that is exported
        assert np.array_equal(copied, host_view.numpy())
        copied[0, 0] = -1.0
        assert t[0, 1].item() == 1.0
        assert np.array_equal(np.from_dlpack(view, device="cpu", copy=True), host_view.numpy())
        with pytest.raises(BufferError, match=r"tensor\.cpu\(\)"):  # no copy allowed: nothing to export
            np.from_dlpack(view, device="cpu", copy=False)
        # PyTorch, the consumer, can address the chip's memory: asked for a device, it gets
        # what it gets from a CUDA tensor: a host copy, or the tensor itself on its own device
        for copied in (torch.from_dlpack(view, device="cpu"), torch.utils.dlpack.from_dlpack(view, device="cpu", copy=True)):
            assert copied.device.type == "cpu" and torch.equal(copied, host_view)
            copied[0, 0] = -1.0
            assert t[0, 1].item() == 1.0
        with pytest.raises(ValueError, match="without copying"):
            torch.from_dlpack(view, device="cpu", copy=False)
        with pytest.raises(BufferError, match="detach"):
            torch.from_dlpack(t.clone().requires_grad_(), device="cpu")
        shared, copied = torch.from_dlpack(view, device=t.device), torch.from_dlpack(view, device=t.device, copy=True)
        assert torch.equal(shared.cpu(), host_view) and torch.equal(copied.cpu(), host_view)
        assert not shared.requires_grad and shared.device == copied.device == t.device
        shared[1, 0] = -2.0  # the same memory
        assert t[1, 1].item() == -2.0 and copied[1, 0].item() == 4.0


def test_a_tensor_imported_from_the_wrappers_capsule_raises_a_clear_error(dev):
    """PyTorch's own exporter, given the wrapper (which owns no memory), makes a capsule that
    PyTorch imports as a plain tensor on the flagos device with no memory: every use of it is an
    error that says so, not an endless recursion between the device copies."""
    raw = torch.utils.dlpack.from_dlpack(torch._C._to_dlpack(torch.arange(3.0).to(dev)))
    assert type(raw) is torch.Tensor and raw.device.type == "flagos"
    for use in (raw.cpu, lambda: raw + 1, raw.sum, raw.clone, lambda: torch.zeros(3).copy_(raw)):
        with pytest.raises(RuntimeError, match="flagos did not make"):
            use()
    assert torch.equal(torch.arange(3.0).to(dev).cpu(), torch.arange(3.0))  # the process goes on

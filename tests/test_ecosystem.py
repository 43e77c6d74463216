"""The libraries' own workflows on flagos, compared with the same run on plain CPU."""
import pytest
import torch

from conftest import CHIP, device_mode_only

pytestmark = device_mode_only

needs_host_storage = pytest.mark.skipif(
    CHIP == "sim", reason="on C-ABI chips (sim) a flagos tensor's memory is an adapter buffer "
                          "with no host storage, which safetensors reads; torch-native chips only")


@needs_host_storage
def test_safetensors_save_file_and_load(dev, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    w = torch.arange(6.0).reshape(2, 3)
    shared = torch.randn(4)
    tensors = {"w": w.to(dev), "b": torch.ones(2, device=dev), "s": shared.to(dev)}
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_file(tensors, str(path))
    loaded = safetensors_torch.load_file(str(path))
    assert set(loaded) == {"w", "b", "s"}
    torch.testing.assert_close(loaded["w"], w)
    torch.testing.assert_close(loaded["s"], shared)
    # a tensor and a view of it are seen as sharing memory, as on CPU
    base = torch.randn(4, 4).to(dev)
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors_torch.save_file({"a": base, "b": base[0]}, str(tmp_path / "s.safetensors"))


@needs_host_storage
def test_transformers_save_pretrained_round_trip(dev, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    ref = transformers.BertModel(config).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():  # a live graph would keep module.to() from swapping the parameters
        expected = ref(input_ids=ids).last_hidden_state
    ref.to(dev).save_pretrained(tmp_path)
    back = transformers.BertModel.from_pretrained(tmp_path).to(dev).eval()
    torch.testing.assert_close(back(input_ids=ids.to(dev)).last_hidden_state.cpu(), expected,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(CHIP != "sim", reason="C-ABI chips only")
def test_save_pretrained_on_an_adapter_chip_says_to_move_to_the_cpu(dev, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    model = transformers.BertModel(config).eval().to(dev)
    with pytest.raises(RuntimeError, match=r"adapter buffers.*model.to\('cpu'\).save_pretrained"):
        model.save_pretrained(tmp_path / "on_chip")
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():  # nothing was lost: the model still runs, and saves from the host
        expected = model(input_ids=ids.to(dev)).last_hidden_state.cpu()
    model.to("cpu").save_pretrained(tmp_path / "host")
    back = transformers.BertModel.from_pretrained(tmp_path / "host").to(dev).eval()
    torch.testing.assert_close(back(input_ids=ids.to(dev)).last_hidden_state.cpu(), expected,
                               rtol=1e-4, atol=1e-5)


@needs_host_storage
def test_diffusers_save_pretrained_round_trip(dev, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                 block_out_channels=(8, 16), norm_num_groups=4,
                                 down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D")).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        expected = unet(x, 10).sample
    unet.to(dev).save_pretrained(tmp_path)
    back = diffusers.UNet2DModel.from_pretrained(tmp_path).to(dev).eval()
    torch.testing.assert_close(back(x.to(dev), 10).sample.cpu(), expected, rtol=1e-4, atol=1e-5)


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

"""Per-device generators: torch.Generator(device=flagos.device()) draws exactly what the same
seeded generator of the payload device draws (the CPU's on the cpu chip and on adapter chips,
whose random ops run on the host; CUDA's on the cuda chip), and Diffusers pipelines seeded with
one reproduce the plain run there."""
import copy
import pickle

import models
import pytest
import torch
from conftest import CHIP, device_mode_only, reference_device, run_python, runs_once

pytestmark = device_mode_only


def seeded(device, seed=0):
    return torch.Generator(device=device).manual_seed(seed)


def test_generator_on_the_flagos_device(dev):
    g = torch.Generator(device=dev)
    assert isinstance(g, torch.Generator) and g.device == dev
    assert g.manual_seed(7) is g and g.initial_seed() == 7
    assert torch.Generator(str(dev)).device == dev and torch.Generator("flagos").device == dev
    fresh = g.seed()
    assert g.initial_seed() == fresh
    # generators of other devices are PyTorch's own, as before
    cpu = torch.Generator()
    assert type(cpu) is torch._C.Generator and cpu.device == torch.device("cpu")
    assert isinstance(cpu, torch.Generator) and issubclass(type(g), torch.Generator)


@pytest.mark.parametrize("draw", [
    lambda d, g: torch.randn(3, 5, device=d, generator=g),
    lambda d, g: torch.rand(17, device=d, generator=g),
    lambda d, g: torch.randint(0, 100, (4, 4), device=d, generator=g),
    lambda d, g: torch.randperm(20, device=d, generator=g),
    lambda d, g: torch.empty(6, device=d).normal_(2.0, 3.0, generator=g),
    lambda d, g: torch.empty(6, device=d).uniform_(-1, 1, generator=g),
    lambda d, g: torch.full((50,), 0.3, device=d).bernoulli(generator=g),
    lambda d, g: torch.multinomial(torch.tensor([0.1, 0.2, 0.7], device=d), 8, True, generator=g),
], ids=["randn", "rand", "randint", "randperm", "normal_", "uniform_", "bernoulli", "multinomial"])
def test_random_ops_match_the_seeded_reference_generator(dev, ref, draw):
    g, ref_g = seeded(dev), seeded(ref)
    for _ in range(2):  # the second draw continues from the generator's advanced state
        out, expected = draw(dev, g), draw(ref, ref_g)
        assert out.device == dev
        assert torch.equal(out.cpu(), expected.cpu())


def test_dropout_uses_the_devices_default_generator(dev, ref):
    x = torch.ones(64, 8)
    torch.manual_seed(3)
    expected = torch.nn.functional.dropout(x.to(ref), 0.5, training=True).cpu()
    torch.flagos.manual_seed(3)
    out = torch.nn.functional.dropout(x.to(dev), 0.5, training=True)
    assert torch.equal(out.cpu(), expected)


def test_state_round_trip_and_copies(dev, ref):
    g = seeded(dev, 11)
    state = g.get_state()
    assert torch.equal(state, seeded(ref, 11).get_state())
    first = torch.randn(8, device=dev, generator=g).cpu()
    g.set_state(state)
    assert torch.equal(torch.randn(8, device=dev, generator=g).cpu(), first)
    g.set_state(state)
    for twin in (copy.deepcopy(g), pickle.loads(pickle.dumps(g))):
        assert twin.device == dev and twin is not g
        assert torch.equal(torch.randn(8, device=dev, generator=twin).cpu(), first)


def test_generators_of_every_device(dev):
    last = torch.flagos.device_count() - 1
    g = torch.Generator(device=f"flagos:{last}").manual_seed(5)
    assert g.device == torch.device("flagos", last)
    out = torch.randn(4, device=f"flagos:{last}", generator=g)
    assert out.device == torch.device("flagos", last)
    plain = reference_device(last)
    assert torch.equal(out.cpu(), torch.randn(4, device=plain, generator=seeded(plain, 5)).cpu())
    with pytest.raises(ValueError, match=rf"flagos:{last + 1} does not exist"):
        torch.Generator(device=f"flagos:{last + 1}")
    # every other way to name a device still gets PyTorch's own generator for it
    for other in ("cpu", torch.device("cpu"), None):
        g = torch.Generator() if other is None else torch.Generator(device=other)
        assert g.device == torch.device("cpu") and type(g) is torch._C.Generator, other


def test_diffusers_randn_tensor_with_a_flagos_generator(dev, ref):
    randn_tensor = pytest.importorskip("diffusers.utils.torch_utils").randn_tensor
    out = randn_tensor((2, 3, 4), generator=seeded(dev), device=dev)
    assert out.device == dev
    assert torch.equal(out.cpu(), randn_tensor((2, 3, 4), generator=seeded(ref), device=ref).cpu())
    per_sample = randn_tensor((2, 3), generator=[seeded(dev, 1), seeded(dev, 2)], device=dev)
    expected = randn_tensor((2, 3), generator=[seeded(ref, 1), seeded(ref, 2)], device=ref)
    assert torch.equal(per_sample.cpu(), expected.cpu())


def test_ddpm_pipeline_seeded_with_a_flagos_generator_matches_plain_pytorch(dev, ref):
    pytest.importorskip("diffusers")
    plain = models.ddpm_pipeline().to(ref)
    expected = plain(batch_size=1, generator=seeded(ref), num_inference_steps=4, output_type="np").images
    pipe = models.ddpm_pipeline().to(dev)
    torch.manual_seed(1234)  # the global generators differ from the reference run: only the
    torch.flagos.manual_seed(1234)  # pipeline's generator can make the images equal
    out = pipe(batch_size=1, generator=seeded(dev), num_inference_steps=4, output_type="np").images
    assert out.shape == expected.shape
    # sim's own kernels sum in another order than PyTorch's: equal to float32 rounding
    assert abs(out - expected).max() <= (0 if CHIP == "cpu" else 1e-5)


@runs_once
def test_release_gives_torch_generator_back():
    proc = run_python("""
        import torch, flagos
        from flagos.runtime import _registration
        flagos.activate("cpu")
        g = torch.Generator(flagos.device()).manual_seed(0)
        _registration.release()
        assert torch.Generator is torch._C.Generator
        try:
            torch.Generator(flagos.device())
        except NotImplementedError as e:
            print("PYTORCH", "getNewGenerator" in str(e))
        print("STILL", torch.randn(2, device=flagos.device(), generator=g).cpu().tolist()
              == torch.randn(2, generator=torch.Generator().manual_seed(0)).tolist())
    """)
    assert "PYTORCH True" in proc.stdout and "STILL True" in proc.stdout


def test_generator_without_an_index_is_on_the_current_device():
    """torch.Generator("flagos") is on the current device, as torch.Generator("cuda") is."""
    last = torch.flagos.device_count() - 1
    if last == 0:
        pytest.skip("needs a chip with two devices (sim has two; the cpu chip one)")
    torch.flagos.set_device(last)
    try:
        for g in (torch.Generator("flagos"), torch.Generator(device=torch.device("flagos"))):
            assert g.device == torch.device("flagos", last)
            out = torch.randn(4, device=g.device, generator=g.manual_seed(5))
            assert out.device == torch.device("flagos", last)
            plain = reference_device(last)
            assert torch.equal(out.cpu(), torch.randn(4, device=plain, generator=seeded(plain, 5)).cpu())
    finally:
        torch.flagos.set_device(0)
    assert torch.Generator("flagos").device == torch.device("flagos", 0)


@device_mode_only
def test_leaving_never_replaces_a_generator_someone_else_installed(monkeypatch):
    """uninstall() gives torch.Generator back only when flagos's is still the one installed:
    a library that replaced it since keeps its own, and leaving twice changes nothing."""
    from flagos.runtime import _generator
    assert torch.Generator is _generator.Generator   # activated in device mode
    monkeypatch.setattr(_generator, "_saved", _generator._saved)  # restored after the test

    class Replacement(_generator._TORCH_GENERATOR):
        pass

    monkeypatch.setattr(torch, "Generator", Replacement)
    _generator.uninstall()
    assert torch.Generator is Replacement
    monkeypatch.setattr(_generator, "_saved", None)
    monkeypatch.setattr(torch, "Generator", _generator.Generator)
    _generator.uninstall()   # nothing saved: nothing to give back
    assert torch.Generator is _generator.Generator

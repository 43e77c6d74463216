"""CPU offloading onto flagos: `.data` across flagos and the host, parameters rebuilt by type,
and every Diffusers offload mode, each pipeline compared with the same pipeline on plain CPU.
Runs on the suite's chip (cpu, and sim with FLAGOS_TEST_CHIP=sim)."""
import types
import weakref

import numpy as np
import pytest
import torch
from conftest import CHIP, device_mode_only, run_python, same_on_every_chip
from models import ddpm_pipeline, run_ddpm

from flagos.integrations import _libraries

pytestmark = device_mode_only


# ---- `.data =` across flagos and the host -------------------------------------------------

def test_cpu_parameter_takes_flagos_data_and_back(dev):
    lin = torch.nn.Linear(3, 2)
    weight = lin.weight
    weight.note = "kept"  # libraries tag parameters (accelerate, Diffusers): tags survive
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
    values = torch.randn(2, 3)
    moved = values.to(dev)

    weight.data = moved
    assert lin.weight is weight and weight.device == dev
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad and weight.note == "kept"
    assert weight in set(lin.parameters())
    torch.testing.assert_close(weight.cpu(), values)
    with torch.no_grad():
        moved.add_(1)  # `.data = t` aliases t's memory, as on one device
    torch.testing.assert_close(weight.cpu(), values + 1)

    weight.data = weight.data.to("cpu")
    assert lin.weight is weight and weight.device.type == "cpu"
    assert type(weight) is torch.nn.Parameter and weight.requires_grad and weight.note == "kept"
    torch.testing.assert_close(weight, values + 1)
    # the optimizer still holds the same object and steps it, on the host as before
    lin(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.testing.assert_close(weight, values + 1 - 0.1 * torch.ones(2, 1).expand(2, 3))


def test_buffer_and_frozen_parameter_keep_their_kind(dev):
    buffer = torch.arange(4.0)
    buffer.data = buffer.data.to(dev)
    assert buffer.device == dev and not isinstance(buffer, torch.nn.Parameter)
    assert not buffer.requires_grad and buffer.tolist() == [0.0, 1.0, 2.0, 3.0]
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    frozen.data = torch.full((2,), 3.0, device=dev)
    assert isinstance(frozen, torch.nn.Parameter) and not frozen.requires_grad
    frozen.data = frozen.data.cpu()
    assert type(frozen) is torch.nn.Parameter and not frozen.requires_grad
    assert frozen.tolist() == [3.0, 3.0]


def test_module_moved_off_flagos_keeps_its_parameter_objects(dev):
    """An optimizer built on flagos keeps stepping the module after model.cpu(), as with CUDA."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(reference.state_dict())
    model.to(dev)
    params = list(model.parameters())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for m, device in ((reference, "cpu"), (model, dev)):
        m(torch.ones(1, 3, device=device)).sum().backward()
    model.cpu()
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert all(type(p) is torch.nn.Parameter and p.grad.device.type == "cpu" for p in params)
    for optimizer in optimizers:
        optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    model.to(dev)
    assert all(p is q for p, q in zip(model.parameters(), params)) and params[0].device == dev


def test_module_held_by_a_graph_moves_off_flagos_keeping_its_parameters(dev):
    """A forward pass with gradients holds the parameters; module.cpu() still moves the same
    objects, the graph still runs on the flagos values it saved, and the gradients reach the
    parameters on the host, as they would on one device."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(reference.state_dict())
    model.to(dev)
    params = list(model.parameters())
    out = model(torch.ones(1, 3, device=dev)).pow(2).sum()
    model.cpu()
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert all(type(p) is torch.nn.Parameter and p.device.type == "cpu" for p in params)
    out.backward()
    reference(torch.ones(1, 3)).pow(2).sum().backward()
    for p, q in zip(params, reference.parameters()):
        assert p.grad.device.type == "cpu"
        torch.testing.assert_close(p.grad, q.grad)


def test_module_held_by_a_graph_moves_onto_flagos_keeping_its_parameters(dev):
    """The other way: a CPU forward pass holds the parameters, module.to(flagos) swaps each
    with its flagos copy (PyTorch's swap refuses a tensor a graph holds), and the graph's
    gradients still reach the parameters, now on flagos."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(reference.state_dict())
    params = list(model.parameters())
    out = model(torch.ones(1, 3)).pow(2).sum()
    model.to(dev)
    assert all(p is q for p, q in zip(model.parameters(), params)) and params[0].device == dev
    out.backward()
    reference(torch.ones(1, 3)).pow(2).sum().backward()
    for p, q in zip(params, reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad)


@pytest.mark.parametrize("direction", ["onto flagos", "off flagos"])
def test_a_gradient_that_cannot_reach_its_moved_parameter_raises_as_on_cpu(dev, direction):
    """A parameter whose data and .grad change shape while a graph holds it: backward raises
    the error CPU raises for the same program (AccumulateGrad's), and the next step works."""
    def step(device, move_to):
        torch.manual_seed(0)
        lin = torch.nn.Linear(3, 1).to(device)
        out = lin(torch.ones(2, 3, device=device)).sum()
        lin.to(move_to)
        lin.weight.data = torch.ones(5, device=move_to)
        lin.weight.grad = torch.zeros(5, device=move_to)
        with pytest.raises(RuntimeError) as raised:
            out.backward()
        return str(raised.value), lin

    start, end = (("cpu", dev) if direction == "onto flagos" else (dev, "cpu"))
    on_cpu, _ = step("cpu", "cpu")
    moved, lin = step(start, end)
    assert moved == on_cpu and "size of tensor a (5)" in moved
    lin.weight.data = torch.ones(1, 3, device=end)
    lin.weight.grad = None
    lin(torch.ones(2, 3, device=end)).sum().backward()
    assert lin.weight.grad.tolist() == [[2.0, 2.0, 2.0]]


def test_gradient_follows_the_data(dev):
    p = torch.nn.Parameter(torch.ones(3))
    (p * 2).sum().backward()
    p.data = p.data.to(dev)
    assert p.grad.device == dev and p.grad.tolist() == [2.0, 2.0, 2.0]


def test_tensor_held_by_a_graph_moves_and_its_gradient_follows(dev):
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    out = (p * p).sum()  # the graph saves p
    p.data = p.data.to(dev)
    assert isinstance(p, torch.nn.Parameter) and p.device == dev
    out.backward()  # on the values it saved; the gradient reaches p, where p is now
    assert p.grad.device == dev and p.grad.tolist() == [2.0, 4.0, 6.0]
    out = (p * 3).sum()
    p.data = p.data.cpu()  # moved twice while one graph holds it: both handed on
    p.data = p.data.to(dev)
    p.data = p.data.cpu()
    out.backward()
    assert p.grad.device.type == "cpu" and p.grad.tolist() == [5.0, 7.0, 9.0]


def test_tensor_hooks_survive_a_move(dev):
    """Hooks registered before a move run for graphs recorded before and after it, as after
    `.data =` on one device."""
    calls = []
    p = torch.nn.Parameter(torch.ones(3))
    p.register_hook(lambda grad: calls.append(("grad", grad.tolist())))
    p.register_post_accumulate_grad_hook(lambda t: calls.append(("accumulated", t.device.type)))
    out = (p * p).sum()
    p.data = p.data.to(dev)
    out.backward()
    assert calls == [("grad", [2.0, 2.0, 2.0]), ("accumulated", "flagos")]
    calls.clear()
    (p * 3).sum().backward()
    p.data = p.data.cpu()
    (p * 4).sum().backward()
    assert calls == [("grad", [3.0, 3.0, 3.0]), ("accumulated", "flagos"),
                     ("grad", [4.0, 4.0, 4.0]), ("accumulated", "cpu")]
    assert p.grad.tolist() == [9.0, 9.0, 9.0]


def test_weak_reference_blocks_the_move_with_a_clear_error(dev):
    p = torch.nn.Parameter(torch.ones(3))
    ref = weakref.ref(p)  # torch.compile keeps such references to the parameters it compiled
    with pytest.raises(RuntimeError, match="weak reference.*before compiling"):
        p.data = torch.zeros(3, device=dev)
    assert p.device.type == "cpu" and p.tolist() == [1.0, 1.0, 1.0]  # unchanged
    del ref
    p.data = torch.zeros(3, device=dev)
    assert p.device == dev


def test_weakly_referenced_parameter_moves_off_flagos_as_a_new_parameter(dev):
    m = torch.nn.Linear(2, 2).to(dev)
    old = m.weight
    ref = weakref.ref(old)  # cannot be swapped: the module gets a new Parameter, PyTorch's way
    m.to("cpu")
    assert m.weight.device.type == "cpu" and m.weight is not old and ref() is old
    assert old.device == dev and isinstance(m.weight, torch.nn.Parameter)
    assert torch.equal(m.weight.detach(), old.detach().cpu())


def test_swap_tensors_between_flagos_tensors_keeps_each_object(dev):
    """module.to(dtype) swaps wrapper-subclass parameters with torch.utils.swap_tensors; for two
    flagos tensors the data is exchanged as two `.data =` would, and each object keeps its
    TensorImpl (so a graph holding it stays valid), its requires_grad and its attributes."""
    a = torch.nn.Parameter(torch.ones(2, device=dev))
    a.note = "kept"
    b = torch.zeros(3, dtype=torch.float16, device=dev)
    a_impl, b_impl = a._cdata, b._cdata  # the TensorImpl behind each object, as an address
    torch.utils.swap_tensors(a, b)
    assert (a._cdata, b._cdata) == (a_impl, b_impl)
    assert a.dtype == torch.float16 and a.tolist() == [0.0, 0.0, 0.0]
    assert b.dtype == torch.float32 and b.tolist() == [1.0, 1.0]
    assert isinstance(a, torch.nn.Parameter) and a.requires_grad and a.note == "kept"
    assert not isinstance(b, torch.nn.Parameter) and not b.requires_grad


def test_swap_tensors_of_pairs_that_cannot_exchange_data_in_place_swaps_as_on_cpu(dev):
    """A non-leaf, and a pair whose math bits differ (a conjugate view), cannot exchange data
    in place: they are swapped as whole objects, values, graph and bits, as on CPU."""
    for device in ("cpu", dev):
        x = torch.ones(3, device=device, requires_grad=True)
        made = x * 2
        plain = torch.zeros(3, device=device)
        torch.utils.swap_tensors(made, plain)
        assert made.tolist() == [0.0, 0.0, 0.0] and made.grad_fn is None
        assert plain.tolist() == [2.0, 2.0, 2.0] and type(plain.grad_fn).__name__ == "MulBackward0"
        conj = torch.tensor([1 + 2j, 3 - 1j], device=device).conj()
        other = torch.tensor([5 + 0j, 6 + 1j], device=device)
        torch.utils.swap_tensors(conj, other)
        assert conj.tolist() == [5 + 0j, 6 + 1j] and not conj.is_conj()
        assert other.tolist() == [1 - 2j, 3 + 1j] and other.is_conj()


def test_swap_tensors_across_devices_leaves_tensor_hooks_with_the_memory_as_on_cpu(dev):
    """After torch.utils.swap_tensors(a, b) the hooks registered on a run for graphs over b, the
    object now holding a's former memory, and not for graphs over a: between two host tensors,
    and between a flagos and a host tensor (only `.data =` keeps them with the object)."""
    def run(device_a, device_b):
        calls = []
        a = torch.ones(3, device=device_a, requires_grad=True)
        b = torch.full((3,), 2.0, device=device_b, requires_grad=True)
        hooks = [a.register_hook(lambda grad: calls.append(("grad", grad.tolist()))),
                 a.register_post_accumulate_grad_hook(lambda t: calls.append(("accumulated", t is b)))]
        torch.utils.swap_tensors(a, b)
        (b * 3).sum().backward()
        (a * 5).sum().backward()
        # a hook closing over its own tensor is a cycle through PyTorch's C++ side that the
        # collector cannot free (plain PyTorch keeps such a pair for the process's life too):
        # removed, so this test leaves no memory held on the chip for the next ones
        for hook in hooks:
            hook.remove()
        return calls, a.grad.tolist(), b.grad.tolist()

    want = run("cpu", "cpu")
    assert want == ([("grad", [3.0, 3.0, 3.0]), ("accumulated", True)], [5.0] * 3, [3.0] * 3)
    assert run(dev, "cpu") == want and run("cpu", dev) == want


@pytest.mark.parametrize("referenced", ["t1", "t2"])
def test_swap_tensors_across_devices_with_a_weak_reference_is_refused_as_on_cpu(dev, referenced):
    """swap_tensors(flagos tensor, host tensor) refuses a weakly referenced one with PyTorch's
    error for two host tensors, and changes neither."""
    errors = []
    for other_device in ("cpu", dev):
        t1, t2 = torch.ones(2, device=other_device), torch.zeros(3)
        ref = weakref.ref(t1 if referenced == "t1" else t2)
        with pytest.raises(RuntimeError) as raised:
            torch.utils.swap_tensors(t1, t2)
        errors.append(str(raised.value))
        assert t1.tolist() == [1.0, 1.0] and t1.device == torch.device(other_device)
        assert t2.tolist() == [0.0, 0.0, 0.0] and t2.device.type == "cpu" and ref() is not None
    assert errors[1] == errors[0] == f"Cannot swap {referenced} because it has weakref associated with it"


def test_other_incompatible_pairs_keep_pytorchs_error():
    dense = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        dense.data = torch.ones(2, 2).to_sparse()


def test_parameter_rebuilt_by_its_type(dev):
    """accelerate rebuilds parameters with type(param)(value, requires_grad=...)."""
    lin = torch.nn.Linear(2, 2).to(dev)
    cls = type(lin.weight)
    back = cls(lin.weight.detach().cpu(), requires_grad=False)
    assert type(back) is torch.nn.Parameter and not back.requires_grad
    on_flagos = cls(torch.ones(2, device=dev))
    assert isinstance(on_flagos, torch.nn.Parameter) and on_flagos.requires_grad
    assert on_flagos.device == dev


def test_data_ptr_tells_flagos_tensors_apart(dev):
    a, b = torch.ones(4, device=dev), torch.ones(4, device=dev)
    assert a.data_ptr() != b.data_ptr()
    assert a[1:].data_ptr() == a.data_ptr() + a.element_size()
    assert a.view(2, 2).data_ptr() == a.data_ptr()


# ---- Diffusers offloading, compared with plain CPU ----------------------------------------

def _enable(pipe, mode, device, folder=None):
    if mode == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif mode == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    elif mode == "group-block":
        pipe.enable_group_offload(onload_device=device, offload_type="block_level", num_blocks_per_group=1)
    elif mode == "group-leaf":
        pipe.enable_group_offload(onload_device=device, offload_type="leaf_level")
    elif mode == "group-disk":  # the weights wait in safetensors files, loaded to flagos
        pipe.enable_group_offload(onload_device=device, offload_type="block_level",
                                  num_blocks_per_group=1, offload_to_disk_path=str(folder))
    elif mode == "group-stream":  # prefetches the next group on a flagos stream
        pipe.enable_group_offload(onload_device=device, offload_type="block_level",
                                  num_blocks_per_group=1, use_stream=True)


@pytest.mark.parametrize("mode", ["model", "sequential", "group-block", "group-leaf", "group-disk",
                                  "group-stream"])
def test_ddpm_offload_matches_cpu(dev, mode, tmp_path):
    expected = run_ddpm(ddpm_pipeline(), steps=2)
    pipe = ddpm_pipeline()
    _enable(pipe, mode, dev, tmp_path)
    seen = []
    hook = pipe.unet.conv_in.register_forward_pre_hook(lambda m, args: seen.append(args[0].device))
    images = run_ddpm(pipe, steps=2)
    hook.remove()
    assert seen and all(d == dev for d in seen)  # the UNet really ran on flagos
    np.testing.assert_allclose(images, expected, atol=1e-5, rtol=0)
    if mode in ("model", "group-block", "group-leaf"):  # the weights rest on the host again
        params = list(pipe.unet.parameters())
        assert all(p.device.type == "cpu" and type(p) is torch.nn.Parameter for p in params)


def tiny_stable_diffusion(seed: int = 0):
    """Text encoder, UNet and VAE of a Stable Diffusion pipeline, tiny and seeded."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "a", "photo", "of", "red", "chip"]
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
        norm_num_groups=4, attention_head_dim=4)
    vae = AutoencoderKL(block_out_channels=(8,), in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                        norm_num_groups=4, sample_size=16)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(words), hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_hidden_layers=1, max_position_embeddings=8, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    vocab = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    vocab.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="[UNK]", pad_token="[PAD]",
                                        model_max_length=8)
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        scheduler=DDIMScheduler(num_train_timesteps=100, clip_sample=False, set_alpha_to_one=False,
                                steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_stable_diffusion(pipe):
    generator = torch.Generator("cpu").manual_seed(0)
    return pipe("a photo of a red chip", num_inference_steps=2, height=16, width=16,
                guidance_scale=2.0, generator=generator, output_type="np").images


@pytest.mark.parametrize("mode", ["model", "sequential", "group-leaf"])
def test_stable_diffusion_offload_matches_cpu(dev, mode):
    """Three models handed over in turn (text encoder -> UNet -> VAE)."""
    expected = run_stable_diffusion(tiny_stable_diffusion())
    pipe = tiny_stable_diffusion()
    _enable(pipe, mode, dev)
    assert pipe._execution_device == dev
    np.testing.assert_allclose(run_stable_diffusion(pipe), expected, atol=1e-5, rtol=0)


# ---- activation order ---------------------------------------------------------------------

def test_enable_model_cpu_offload_without_device_finds_flagos(dev):
    """Diffusers' own accelerator detection, in whatever order this suite imported it."""
    from diffusers.utils.torch_utils import get_device

    assert get_device() == "flagos"
    expected = run_ddpm(ddpm_pipeline(), steps=1)
    pipe = ddpm_pipeline()
    pipe.enable_model_cpu_offload()
    assert pipe._offload_device == dev
    np.testing.assert_allclose(run_ddpm(pipe, steps=1), expected, atol=1e-5, rtol=0)


ORDER_CHECK = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
from models import ddpm_pipeline, run_ddpm
expected = run_ddpm(ddpm_pipeline(), steps=1)
pipe = ddpm_pipeline()
pipe.enable_model_cpu_offload()  # no device given: Diffusers' own accelerator detection
assert str(pipe._offload_device) == "flagos:0", pipe._offload_device
np.testing.assert_allclose(run_ddpm(pipe, steps=1), expected, atol=1e-5, rtol=0)
from diffusers.utils import torch_utils
print("accelerator", torch_utils.get_device(), "default", torch_utils.torch_device)
# the strategies device_map may name, in the order its error message lists them, as Diffusers
# imported after activation makes them: ["balanced", get_device(), "cpu"]
from diffusers.pipelines import pipeline_utils
print("strategies", pipeline_utils.SUPPORTED_DEVICE_MAP)
# loaded straight onto flagos: Diffusers accepts only the devices of a list made at its import
import tempfile
from diffusers import DDPMPipeline
with tempfile.TemporaryDirectory() as folder:
    ddpm_pipeline().save_pretrained(folder)
    loaded = DDPMPipeline.from_pretrained(folder, device_map="flagos")
    assert str(loaded.unet.device) == "flagos:0", loaded.unet.device
    np.testing.assert_allclose(run_ddpm(loaded, steps=1), expected, atol=1e-5, rtol=0)
print("device_map ok")
"""


@same_on_every_chip  # the offload itself runs on every chip: the test above
@pytest.mark.parametrize("order", ["diffusers-first", "autoload"])
def test_enable_model_cpu_offload_finds_flagos_when_diffusers_came_first(order):
    """Diffusers caches its accelerator, its default device and the devices `device_map` may
    name when its pipeline module is imported: imported before activation they say "cpu",
    which activation answers."""
    import os
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {"FLAGOS_FALLBACK": "allow", "PYTHONPATH": os.path.dirname(tests)}
    if order == "diffusers-first":
        code = f"import diffusers.pipelines.pipeline_utils, flagos\nflagos.activate({CHIP!r})\n"
    else:  # FLAGOS_DEVICE: activation at `import torch`, before Diffusers
        code = "import torch, diffusers.pipelines\n"
        env["FLAGOS_DEVICE"] = CHIP
    proc = run_python(code + ORDER_CHECK.format(tests=tests), env=env)
    # the module's default device, computed at its import, follows too
    assert "accelerator flagos default flagos" in proc.stdout and "device_map ok" in proc.stdout
    # (imported first, Diffusers listed its detection's "cpu" beside its own "cpu"; both stay)
    assert "strategies ['balanced', 'flagos', 'cpu'" in proc.stdout, proc.stdout


def test_a_default_device_the_user_set_in_diffusers_is_kept():
    """Activation replaces Diffusers' import-time default only where it is the "cpu" that
    Diffusers computed before flagos existed; a device a user assigned stays theirs."""
    def stub(default):
        module = types.ModuleType("torch_utils_stub")
        module.get_device = lambda: "flagos"
        module.torch_device = default
        _libraries._diffusers_torch_utils(module)
        return module.torch_device

    assert stub("cpu") == "flagos"
    assert stub("meta") == "meta"


@pytest.mark.parametrize("kind", ["buffer with a view", "intermediate result"])
def test_a_tensor_no_graph_accumulates_into_moves_as_on_cpu(dev, kind):
    """Only a leaf that needs a gradient gets its gradient handed on after a move: a tensor
    that needs none (a buffer another tensor views) or has a grad_fn of its own moves as any."""
    if kind == "buffer with a view":
        t = torch.arange(3.0)
        view = t[:2]  # holds the tensor, as a graph would
        t.data = t.data.to(dev)
        assert t.device == dev and not t.requires_grad and t.grad_fn is None
        assert t.tolist() == [0.0, 1.0, 2.0] and view.tolist() == [0.0, 1.0]
    else:
        leaf = torch.ones(3, requires_grad=True)
        mid = leaf * 2
        held = mid * mid  # the graph saves mid
        mid.data = mid.data.to(dev)
        assert mid.device == dev  # (a leaf now, unlike on CPU: docs/design.md §13)
        held.sum().backward()  # the graph's gradient reaches the leaf, and nothing else
        assert leaf.grad.tolist() == [8.0, 8.0, 8.0] and mid._grad is None

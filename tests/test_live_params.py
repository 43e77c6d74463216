"""Parameters changed while an autograd graph holds them, as on plain CPU: module.to(dtype),
.half() and .float() between forward and backward, Diffusers' layerwise casting in training,
and Diffusers' and accelerate's offloading with gradients enabled.

Each case is a function of the device. It runs on plain CPU in this process and on the suite's
chip (cpu, and sim with FLAGOS_TEST_CHIP=sim) in a fresh one, because these are the paths that
used to end the process inside backward; the two results are compared."""
import os

import pytest
import torch
from conftest import CHIP, device_mode_only, run_python
from torch import nn

pytestmark = device_mode_only
TESTS = os.path.dirname(os.path.abspath(__file__))


CASES = ("dtype_change_all", "layerwise_casting_all", "layerwise_casting_steps_all",
         "offload_training_all")


@pytest.fixture(scope="module")
def flagos_results(tmp_path_factory):
    """Every case of this file on the suite's chip, in one fresh process (one start-up and
    warm-up instead of one per test). A case that raises gives its error as its result."""
    result = tmp_path_factory.mktemp("live_params") / "results.pt"
    run_python(f"""
        import sys, traceback
        sys.path.insert(0, {TESTS!r})
        import torch, flagos
        flagos.activate({CHIP!r})
        import test_live_params as cases
        results = {{}}
        for case in {CASES!r}:
            try:
                results[case] = getattr(cases, case)(flagos.device())
            except Exception:
                results[case] = traceback.format_exc()
        torch.save(results, {str(result)!r})
        """, env={"FLAGOS_FALLBACK": "allow", "PYTHONPATH": os.path.dirname(TESTS)})
    return torch.load(result, weights_only=False)


def on_flagos(results: dict, case: str):
    got = results[case]
    if isinstance(got, str):
        pytest.fail(f"{case} raised on flagos:\n{got}")
    return got


def exact(exact_on_cpu: bool) -> bool:
    return CHIP == "cpu" and exact_on_cpu


def close(actual, expected, exact_on_cpu=True):
    """Equal up to float32 rounding on the cpu chip (the same kernels). sim computes with its own
    kernels, whose float16 rounding under autocast differs from CPU's in the last bits."""
    if exact(exact_on_cpu):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-3)


def grads_match(actual: dict, expected: dict, exact_on_cpu=True) -> None:
    """Every parameter's gradient close to CPU's, and all of them together within 3% of CPU's
    norm where rounding differs (measured: up to 1% on sim), which a lost gradient would fail."""
    assert actual.keys() == expected.keys()
    for key, grad in expected.items():
        close(actual[key], grad, exact_on_cpu)
    flat = [torch.cat([g[k].double().flatten() for k in expected]) for g in (actual, expected)]
    limit = 1e-5 if exact(exact_on_cpu) else 3e-2
    assert (flat[0] - flat[1]).norm() <= limit * flat[1].norm()


# ---- module.to(dtype), .half(), .float() between forward and backward --------------------

CHANGES = {
    "none": lambda m: m,
    "half": lambda m: m.half(),
    "half, then float": lambda m: m.half().float(),
    "float (no change)": lambda m: m.float(),
    "to(float64)": lambda m: m.to(torch.float64),
    "to(dtype=bfloat16)": lambda m: m.to(dtype=torch.bfloat16),
    # a parameter that only its AccumulateGrad node holds: the case PyTorch's swap_tensors
    # lets through but poisons, so that backward raised inside the engine
    "half, the shift only": lambda m: m[-1].half(),
}


class Shift(nn.Module):
    """x + shift: the addition saves nothing, so the graph holds `shift` only through its
    AccumulateGrad node."""

    def __init__(self, size: int):
        super().__init__()
        self.shift = nn.Parameter(torch.linspace(-1, 1, size))

    def forward(self, x):
        return x + self.shift


def dtype_change(device, change: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.GELU(), nn.Conv2d(3, 2, 3), nn.Flatten(),
                          nn.Linear(8, 2), Shift(2)).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    x = torch.randn(1, 2, 6, 6).to(device).requires_grad_()
    loss = model(x).pow(2).sum()
    CHANGES[change](model)
    out = {"same objects": all(p is q for p, q in zip(params, model.parameters())),
           "dtypes": [p.dtype for p in params]}
    try:
        loss.backward()
    except RuntimeError as e:  # as on CPU: a convolution's weight is read as it is now
        out["error"] = str(e).splitlines()[0]
    else:
        out["grads"] = [p.grad.cpu() for p in params]
        out["grad dtypes"] = [p.grad.dtype for p in params]
        out["input grad"] = x.grad.cpu()
        optimizer.step()  # the optimizer built before the change steps the same objects
        out["stepped"] = [p.detach().cpu() for p in params]
    # a second step in float32 runs clean: nothing the change did lingers in autograd
    optimizer.zero_grad()
    model.float()
    model(x.detach().float()).pow(2).sum().backward()
    out["second grads"] = [p.grad.cpu() for p in params]
    return out


def test_dtype_changes_between_forward_and_backward_match_cpu(flagos_results):
    """On CPU `.data =` keeps each parameter's TensorImpl: the graph's AccumulateGrad nodes still
    fill the parameter's .grad, and the convolutions, which save their weight (a leaf) itself,
    read it as it is at backward time. flagos does the same."""
    got = on_flagos(flagos_results, "dtype_change_all")
    for change in CHANGES:
        expected, actual = dtype_change("cpu", change), got[change]
        assert actual["same objects"] and expected["same objects"], change
        assert actual["dtypes"] == expected["dtypes"], change
        assert actual.get("error") == expected.get("error"), change
        for key in ("grads", "stepped", "second grads"):
            for a, e in zip(actual.get(key, []), expected.get(key, [])):
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=f"{change}: {key}")
        assert actual.get("grad dtypes") == expected.get("grad dtypes"), change
        if "input grad" in expected:
            torch.testing.assert_close(actual["input grad"], expected["input grad"], rtol=1e-5,
                                       atol=1e-5, msg=change)
    # the case that tells "backward reads the weights as they are now" from "as they were":
    reference = dtype_change("cpu", "none")["input grad"]
    assert not torch.equal(got["half, then float"]["input grad"], reference)
    assert "error" in got["half"] and "Half" in got["half"]["error"]


def dtype_change_all(device) -> dict:
    return {change: dtype_change(device, change) for change in CHANGES}


# ---- Diffusers' layerwise casting in training -------------------------------------------

def tiny_unet():
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(8, 16), norm_num_groups=4,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))


def tiny_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3,
                         latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
                         sample_size=8)


MODELS = {"UNet2DModel": tiny_unet, "AutoencoderKL": tiny_vae}


def model_inputs(name: str, step: int, device) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    sample = torch.randn(1, 3, 8, 8, generator=g).to(device)
    if name == "UNet2DModel":
        return {"sample": sample, "timestep": torch.tensor([3 + step]).to(device)}
    return {"sample": sample}


def layerwise_casting_training(device, name: str, storage_dtype) -> dict:
    """Diffusers' test_layerwise_casting_training, on a tiny seeded model. Diffusers runs it
    under the device's default autocast dtype (float16 on accelerators, flagos among them;
    bfloat16 on CPU): float16 on both sides here, so the two compare."""
    device = torch.device(device)
    model = MODELS[name]().to(device, dtype=torch.float32)
    model.enable_layerwise_casting(storage_dtype=storage_dtype, compute_dtype=torch.float32)
    model.train()
    inputs = model_inputs(name, 0, device)
    with torch.amp.autocast(device_type=device.type, dtype=torch.float16):
        output = model(**inputs, return_dict=False)[0]
        noise = torch.randn(output.shape, generator=torch.Generator().manual_seed(7)).to(device)
        loss = nn.functional.mse_loss(output, noise)
    loss.backward()
    return {"loss": loss.item(),
            "storage dtypes": {k: p.dtype for k, p in model.named_parameters()},
            "grads": {k: p.grad.cpu() for k, p in model.named_parameters() if p.grad is not None}}


LAYERWISE_CASES = [(name, dtype) for name in MODELS
                   for dtype in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)]


def layerwise_casting_all(device) -> dict:
    return {(name, str(dtype)): layerwise_casting_training(device, name, dtype)
            for name, dtype in LAYERWISE_CASES}


def test_layerwise_casting_training_as_diffusers_tests_it(flagos_results):
    """Diffusers' own test only asks that backward runs; here losses and gradients also match
    CPU. The gradients of layers before a SiLU differ by float16 rounding even on the cpu chip:
    PyTorch gives PrivateUse1 the decomposition of silu_backward (the test with exact gradients
    is the next one)."""
    got = on_flagos(flagos_results, "layerwise_casting_all")
    for name, dtype in LAYERWISE_CASES:
        expected, actual = layerwise_casting_training("cpu", name, dtype), got[(name, str(dtype))]
        assert actual["storage dtypes"] == expected["storage dtypes"]
        assert dtype in set(actual["storage dtypes"].values())
        close(torch.tensor(actual["loss"]), torch.tensor(expected["loss"]))
        assert len(actual["grads"]) == len(actual["storage dtypes"])  # every parameter learns
        grads_match(actual["grads"], expected["grads"], exact_on_cpu=False)


def without_silu(model):
    """SiLU -> GELU everywhere: on PrivateUse1 PyTorch decomposes silu_backward, which rounds
    differently from CPU's fused kernel under autocast; GELU's backward is the same kernel."""
    for module in list(model.modules()):
        for key, child in list(module.named_children()):
            if isinstance(child, nn.SiLU):
                setattr(module, key, nn.GELU())
    return model


def layerwise_casting_steps(device, name: str, steps: int = 3) -> dict:
    device = torch.device(device)
    model = without_silu(MODELS[name]()).to(device)
    model.enable_layerwise_casting(storage_dtype=torch.float16, compute_dtype=torch.float32)
    model.train()
    # foreach=False on both sides: flagos gets PyTorch's foreach path by default (as CUDA does),
    # which rounds a float32 gradient into a float16 parameter differently from CPU's loop
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    losses, grads = [], []
    for step in range(steps):
        inputs = model_inputs(name, step, device)
        with torch.amp.autocast(device_type=device.type, dtype=torch.float16):
            output = model(**inputs, return_dict=False)[0]
        target = torch.randn(output.shape, generator=torch.Generator().manual_seed(step)).to(device)
        loss = nn.functional.mse_loss(output.float(), target)
        loss.backward()
        grads.append({k: p.grad.cpu() for k, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads,
            "params": {k: p.detach().cpu() for k, p in model.named_parameters()}}


def layerwise_casting_steps_all(device) -> dict:
    return {name: layerwise_casting_steps(device, name) for name in MODELS}


def test_layerwise_casting_training_steps_match_cpu(flagos_results):
    got = on_flagos(flagos_results, "layerwise_casting_steps_all")
    for name in MODELS:
        expected, actual = layerwise_casting_steps("cpu", name), got[name]
        close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]))
        for a, e in zip(actual["grads"], expected["grads"]):
            grads_match(a, e)
        for key, param in expected["params"].items():
            assert actual["params"][key].dtype == param.dtype
            close(actual["params"][key], param)


# ---- offloading with gradients enabled -------------------------------------------------

OFFLOADS = ["group-block", "group-leaf", "group-stream", "model", "sequential"]


def offload_training(device, mode: str, steps: int = 2) -> dict:
    """Forward with gradients through an offloaded UNet, backward, an optimizer step; "none" is
    the same model held on `device` without offloading."""
    import accelerate  # heavy, and only these cases need it

    model = tiny_unet()
    params = list(model.parameters())
    hook = None
    if mode == "group-block":
        model.enable_group_offload(onload_device=device, offload_type="block_level",
                                   num_blocks_per_group=1)
    elif mode == "group-leaf":
        model.enable_group_offload(onload_device=device, offload_type="leaf_level")
    elif mode == "group-stream":
        model.enable_group_offload(onload_device=device, offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=True)
    elif mode == "model":
        model, hook = accelerate.cpu_offload_with_hook(model, execution_device=device)
    elif mode == "sequential":
        accelerate.cpu_offload(model, execution_device=device)
    else:
        model.to(device)
    optimizer = torch.optim.SGD(params, lr=0.05, foreach=False)
    out = {"losses": [], "grads": [], "input grads": []}
    for step in range(steps):
        inputs = model_inputs("UNet2DModel", step, device)
        sample = inputs["sample"].requires_grad_()
        output = model(sample, inputs["timestep"]).sample
        loss = nn.functional.mse_loss(output, torch.ones_like(output))
        if hook is not None:
            hook.offload()  # the weights go back to the host while the graph holds them
        loss.backward()
        out["losses"].append(loss.item())
        out["grads"].append([None if p.grad is None else p.grad.cpu() for p in params])
        out["input grads"].append(sample.grad.cpu())
        optimizer.step()
        optimizer.zero_grad()
    out["same objects"] = all(p is q for p, q in zip(params, model.parameters()))
    out["devices"] = {p.device.type for p in model.parameters()}
    return out


def offload_training_all(device) -> dict:
    return {mode: offload_training(device, mode) for mode in OFFLOADS}


def test_offloaded_training_matches_cpu(flagos_results):
    """Group offloading moves each group back to the host right after its forward, model
    offloading when told to: both while the graph holds the weights. The graph keeps the values
    it saved, gradients reach the parameter objects on the host, and the optimizer steps them.
    Sequential offloading (accelerate's meta-device hooks) gives the parameters no gradient on
    CPU either: only the loss and the input's gradient carry over."""
    got = on_flagos(flagos_results, "offload_training_all")
    cpu = offload_training("cpu", "none")
    for mode in OFFLOADS:
        actual = got[mode]
        expected = offload_training("cpu", mode) if mode == "sequential" else cpu
        torch.testing.assert_close(torch.tensor(actual["losses"]),
                                   torch.tensor(expected["losses"]), rtol=1e-5, atol=1e-5, msg=mode)
        for a, e in zip(actual["input grads"], expected["input grads"]):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=mode)
        if mode == "sequential":
            assert all(g is None for step in expected["grads"] for g in step)
            assert all(g is None for step in actual["grads"] for g in step)
            continue
        assert actual["same objects"] and actual["devices"] == {"cpu"}, mode
        for step_a, step_e in zip(actual["grads"], cpu["grads"]):
            for a, e in zip(step_a, step_e):
                assert a is not None, mode
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=mode)

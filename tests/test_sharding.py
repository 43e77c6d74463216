"""One model over several flagos devices (inference): transformers' device_map="auto" over the
devices' free memory when the model does not fit one device, Diffusers' device_map="balanced",
and the report's bytes_between_devices, each compared with plain CPU.
Runs on the suite's chip (cpu, and sim with FLAGOS_TEST_CHIP=sim); the cpu chip has one device,
so there everything lands on flagos:0 and no byte crosses devices."""
import json
import os

import numpy as np
import pytest
import torch
from accelerate.utils import get_max_memory
from conftest import CHIP, device_mode_only, run_python, runs_once

import flagos

pytestmark = device_mode_only
accelerate = pytest.importorskip("accelerate")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
two_devices = pytest.mark.skipif(CHIP != "sim", reason="needs a chip with two devices (sim has two)")


def test_copies_to_and_from_the_host_and_on_one_device_cross_no_devices(dev):
    x = torch.randn(100, device=dev)
    with flagos.track() as report:
        y = x.to("cpu").to(dev)
        y.copy_(x)
        x.clone()
        x.to(dev)
    assert report.calls() > 0
    assert report.bytes_between_devices == 0
    assert report.to_dict()["totals"]["bytes_between_devices"] == 0
    assert "between devices" not in str(report)


@two_devices
def test_bytes_between_devices_are_the_bytes_copied_from_one_device_to_another(tmp_path):
    x = torch.randn(1000, device="flagos:0")            # 4000 bytes
    half = torch.ones(10, 10, device="flagos:1")
    x.to("flagos:1")                                     # before the scope: 4000
    with flagos.track() as report:
        y = x.to("flagos:1")                             # 4000
        z = torch.empty(10, 10, dtype=torch.float16, device="flagos:0")
        z.copy_(half)                                    # 100 float16 elements land: 200
        y.to("flagos:1")                                 # same device: 0
        x[::2].to("flagos:1", torch.float64)             # 500 float64 elements: 4000
    assert report.bytes_between_devices == 8200
    assert report.to_dict()["totals"]["bytes_between_devices"] == 8200
    assert "between devices: 0.008 MB" in str(report)
    report.save(tmp_path / "report.html")
    assert 'id="between-devices">between devices: 0.008 MB' in (tmp_path / "report.html").read_text()
    assert flagos.fallback_report().bytes_between_devices == 12200  # the running total
    torch.testing.assert_close(z.cpu(), torch.ones(10, 10, dtype=torch.float16))
    torch.testing.assert_close(y.cpu(), x.cpu())
    flagos.reset_report()
    assert flagos.fallback_report().bytes_between_devices == 0


@two_devices
def test_a_fresh_process_counts_from_zero():
    """Since activation, with no reset and no scope: the report holds exactly the bytes copied."""
    proc = run_python("""
        import torch, flagos
        flagos.activate("sim")
        torch.randn(1000, device="flagos:0").to("flagos:1")
        print("BETWEEN", flagos.fallback_report().bytes_between_devices)
    """, env={"FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_DEVICES": "2"})
    assert "BETWEEN 4000" in proc.stdout, proc.stdout + proc.stderr


@two_devices
def test_a_model_dispatched_over_two_devices_counts_the_activations_that_cross():
    """Linear(8, 16) on flagos:0, Linear(16, 4) on flagos:1, input (3, 8) on flagos:0: the
    first output (3 x 16 float32, 192 bytes) goes to flagos:1, and the result (3 x 4, 48 bytes)
    comes back to the input's device (dispatch_model's io_same_device)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    accelerate.dispatch_model(model, device_map={"0": 0, "1": 1})
    assert model[1].weight.device == torch.device("flagos", 1)
    with torch.no_grad(), flagos.track() as report:
        out = model(x.to("flagos:0"))
    assert out.device == torch.device("flagos", 0)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert report.bytes_between_devices == 3 * 16 * 4 + 3 * 4 * 4


@runs_once
def test_device_map_auto_splits_a_model_too_big_for_one_device_over_their_free_memory():
    """sim with two devices of 512 KiB each and a Llama of about 650 KB: accelerate sees both
    devices with their free memory (no max_memory given), transformers splits the model over
    flagos:0 and flagos:1, the logits and greedy tokens are the CPU's."""
    proc = run_python("""
        import json, tempfile
        import accelerate, torch, transformers
        import flagos

        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=False)
        torch.manual_seed(0)
        reference = transformers.LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = reference(ids).logits
            tokens = reference.generate(ids, max_new_tokens=3, do_sample=False)
        folder = tempfile.mkdtemp()
        reference.save_pretrained(folder)
        size = accelerate.utils.compute_module_sizes(reference)[""]

        flagos.activate("sim")
        free = [torch.flagos.mem_get_info(i) for i in range(torch.flagos.device_count())]
        seen = accelerate.utils.get_max_memory()
        with accelerate.init_empty_weights():
            empty = transformers.LlamaForCausalLM(config)
        plan = accelerate.infer_auto_device_map(empty, no_split_module_classes=empty._no_split_modules)
        model = transformers.LlamaForCausalLM.from_pretrained(folder, device_map="auto").eval()
        inputs = ids.to(flagos.device())
        with torch.no_grad():
            with flagos.track() as report:
                logits = model(inputs).logits
            generated = model.generate(inputs, max_new_tokens=3, do_sample=False)
        print(json.dumps({
            "size": size, "free": free, "seen": {str(k): v for k, v in seen.items()},
            "map": {k: str(v) for k, v in model.hf_device_map.items()},
            "plan": sorted({str(v) for v in plan.values()}),
            "layer3": str(model.model.layers[3].mlp.up_proj.weight.device),
            "error": (logits.cpu() - expected).abs().max().item(),
            "same_tokens": generated.cpu().tolist() == tokens.tolist(),
            "between": report.to_dict()["totals"]["bytes_between_devices"],
            "table": str(report)}))
    """, env={"FLAGOS_FALLBACK": "allow", "FLAGOS_SIM_DEVICES": "2", "FLAGOS_SIM_MEMORY": "512K",
              "PYTHONPATH": ROOT})
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    pool = 512 * 1024
    assert out["size"] > pool  # does not fit one device
    assert [total for _, total in out["free"]] == [pool, pool]
    assert list(out["seen"]) == ["0", "1", "cpu"]
    assert [out["seen"]["0"], out["seen"]["1"]] == [free for free, _ in out["free"]]
    assert set(out["map"].values()) == {"0", "1"}, out["map"]
    assert out["plan"] == ["0", "1"]  # infer_auto_device_map without max_memory: flagos:0 first, then 1
    assert out["layer3"] == "flagos:1"
    assert out["error"] < 1e-5
    assert out["same_tokens"]
    # accelerate's hooks move each module's inputs to its device (constraints.txt's versions):
    # the hidden states (2 x 10 x 64 float32) to flagos:1 twice (the rotary embedding's input,
    # layer 2's), the position ids (1 x 10 int64) three times, the rotary cos and sin (1 x 10 x
    # 16 float32) back to layers 0 and 1, and the logits (2 x 10 x 64: vocabulary 64) back to
    # the input's device
    hidden, positions, rotary = 2 * 10 * 64 * 4, 10 * 8, 10 * 16 * 4
    assert out["between"] == 2 * hidden + 3 * positions + 4 * rotary + hidden
    assert f"({out['between']} bytes)" in out["table"]


def test_diffusers_balanced_pipeline_places_components_over_the_devices_and_matches_cpu(dev, tmp_path):
    """A Stable-Diffusion pipeline of three small models saved from the host, loaded with
    device_map="balanced": Diffusers puts the largest component (the UNet) on the device with
    the most free memory (flagos:0 when they have the same) and the others on the next device
    (the same one on a chip with one device); the image is the CPU's. Moving it with .to() needs reset_device_map() first, as on CUDA."""
    diffusers = pytest.importorskip("diffusers")
    import models

    reference = models.tiny_sd_pipeline(str(tmp_path / "tokenizer"))
    expected = models.run_sd(reference)
    reference.save_pretrained(tmp_path / "pipe")
    # Diffusers' rule, as on CUDA: the devices by free memory, most first (a tie keeps their
    # order), the largest component on the first; memory an earlier test left held decides a tie
    count = torch.flagos.device_count()
    free = get_max_memory()
    first = min(range(count), key=lambda i: (-free[i], i))
    other = (first + 1) % count
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tmp_path / "pipe", device_map="balanced")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.hf_device_map == {"unet": first, "vae": other, "text_encoder": other}
    assert pipe.unet.device == torch.device("flagos", first)
    assert pipe.vae.device == pipe.text_encoder.device == torch.device("flagos", other)
    with flagos.track() as report:
        image = models.run_sd(pipe)
    np.testing.assert_allclose(image, expected, atol=1e-5, rtol=0)
    if count > 1:
        # Diffusers runs the pipeline on its first component's device (the VAE's, `other`), so
        # at each of the 2 steps the UNet's hook brings it the latents (2 x 4 x 8 x 8 float32:
        # classifier-free guidance doubles the batch), the timestep (one int64) and the prompt's
        # embeddings (2 x 8 x 16 float32), and its output goes back (2 x 4 x 8 x 8 float32)
        latents, timestep, embeddings = 2 * 4 * 8 * 8 * 4, 8, 2 * 8 * 16 * 4
        assert report.bytes_between_devices == 2 * (2 * latents + timestep + embeddings)
    else:
        assert report.bytes_between_devices == 0
    with pytest.raises(ValueError, match="reset_device_map"):  # Diffusers' own refusal
        pipe.to(dev)
    pipe.reset_device_map()
    pipe.to(dev)
    assert pipe.vae.device == pipe.text_encoder.device == dev
    np.testing.assert_allclose(models.run_sd(pipe), expected, atol=1e-5, rtol=0)

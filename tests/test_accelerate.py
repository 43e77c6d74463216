"""accelerate on flagos: its default device, the device memory it plans with, its dispatch and
offload hooks, and transformers' device_map="auto", each compared with plain CPU.
Runs on the suite's chip (cpu, and sim with FLAGOS_TEST_CHIP=sim)."""
import os

import numpy as np
import pytest
import torch
from conftest import CHIP, device_mode_only, run_python, runs_once, same_on_every_chip

import flagos
from flagos.core import _state
from flagos.integrations import _libraries

pytestmark = device_mode_only
accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


@pytest.fixture
def fresh_state():
    """accelerate keeps one process-wide state: start and leave it empty."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    assert not PartialState._shared_state


def gpt2(seed: int = 0):
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


IDS = torch.arange(10).reshape(1, 10) % 64


def cpu_logits(model):
    with torch.no_grad():
        return model(IDS).logits


def close(actual, expected):
    torch.testing.assert_close(actual.detach().cpu(), expected, rtol=1e-5, atol=1e-5)


def test_partial_state_and_accelerator_pick_flagos(dev, fresh_state):
    assert accelerate.PartialState().device == dev
    accelerator = accelerate.Accelerator()
    assert accelerator.device == dev


def test_accelerator_training_matches_cpu(dev, fresh_state):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))

    def train(model, loader, step):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer, loader = step(model, optimizer, loader)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            yield x.device, loss.item()
            optimizer.zero_grad()
            backward(loss)
            optimizer.step()

    torch.manual_seed(1)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    model.load_state_dict(reference.state_dict())
    backward = torch.Tensor.backward
    expected = [loss for _, loss in train(reference, torch.utils.data.DataLoader(data, batch_size=4),
                                          lambda *a: a)]
    accelerator = accelerate.Accelerator()
    backward = accelerator.backward
    seen = list(train(model, torch.utils.data.DataLoader(data, batch_size=4), accelerator.prepare))
    assert all(device == dev for device, _ in seen)  # batches placed on flagos by accelerate
    assert [loss for _, loss in seen] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert all(p.device == dev for p in model.parameters())


def _trainer_run(tmp_path, use_cpu, bf16=False):
    """A transformers Trainer fine-tuning a tiny BERT classifier for one epoch (4 steps) and
    predicting: the device it chose, the loss, the weights and the predictions."""
    torch.manual_seed(0)
    # (no dropout under bf16: PyTorch's dropout is a composite that takes a fused kernel on an
    # accelerator, whose backward scales in float32 where the CPU's scales by a bfloat16 factor)
    dropout = 0.0 if bf16 else 0.1
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, num_labels=2,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = transformers.BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (16, 8), generator=generator)
    labels = torch.randint(0, 2, (16,), generator=generator)
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long), "labels": labels[i]}
            for i in range(16)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("cpu" if use_cpu else "flagos")), per_device_train_batch_size=4,
        num_train_epochs=1, learning_rate=1e-3, report_to=[], seed=0, save_strategy="no",
        use_cpu=use_cpu, dataloader_pin_memory=False, disable_tqdm=True, bf16=bf16)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    predictions = trainer.predict(data).predictions
    return args.device, result.training_loss, model.classifier.weight.detach().cpu(), predictions


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_trainer_trains_on_flagos_as_on_cpu(dev, fresh_state, tmp_path, bf16):
    """The Trainer puts the batches where TrainingArguments.device says and the model where its
    accelerate says: both flagos (the batches stayed on the host: "argument 'indices' is a tensor
    on cpu, but the op runs on flagos"). Loss, weights and predictions are plain CPU's. `bf16=True`
    is accepted where the chip runs bfloat16 natively and refused elsewhere, as on a GPU."""
    if bf16 and not flagos.supports_dtype(torch.bfloat16):
        with pytest.raises(ValueError, match="doesn't support bf16"):
            _trainer_run(tmp_path, use_cpu=False, bf16=True)
        return
    device, loss, weight, predictions = _trainer_run(tmp_path, use_cpu=False, bf16=bf16)
    want_device, want_loss, want_weight, want_predictions = _trainer_run(tmp_path, use_cpu=True, bf16=bf16)
    assert device == dev and want_device == torch.device("cpu")
    # bfloat16 in a chip's own kernels (sim with FLAGOS_SIM_DTYPES naming it) rounds where its
    # kernels do, not where CPU's do: bfloat16's tolerance there, float32's everywhere else
    rtol, atol = (1e-2, 1e-4) if bf16 and CHIP != "cpu" else (1e-4, 1e-6)
    assert loss == pytest.approx(want_loss, rel=rtol / 10)
    torch.testing.assert_close(weight, want_weight, rtol=rtol, atol=atol)
    np.testing.assert_allclose(predictions, want_predictions, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", [None, 0, -1, "flagos", "cpu"])
def test_a_pipeline_given_an_index_or_no_device_runs_on_flagos_as_on_an_accelerator(dev, tmp_path, device):
    """pipeline(device=None or N) means the first accelerator's device N, as cuda:N on a GPU:
    the model stays on flagos (it was moved back to the host); -1 keeps the model's device;
    "cpu" moves it. The scores are plain CPU's."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(95)]))
    tokenizer = transformers.BertTokenizer(str(vocab))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, num_labels=3)
    model = transformers.BertForSequenceClassification(config).eval()
    texts = ["w1 w2 w3", "w4 w5"]
    expected = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, device="cpu",
                                     top_k=None)(texts)
    kwargs = {} if device is None else {"device": dev if device == "flagos" else device}
    classify = transformers.pipeline("text-classification", model=model.to(dev), tokenizer=tokenizer,
                                     top_k=None, **kwargs)
    on = torch.device("cpu") if device == "cpu" else dev
    assert classify.device == on and next(model.parameters()).device == on
    got = classify(texts)
    for g, e in zip(got, expected):
        assert [d["label"] for d in g] == [d["label"] for d in e]
        assert [d["score"] for d in g] == pytest.approx([d["score"] for d in e], rel=1e-5)


def test_accelerator_bf16_mixed_precision_matches_cpu(dev, fresh_state):
    """accelerate's bf16 autocast on flagos is bit-identical to accelerate's bf16 on the host."""
    from accelerate.state import AcceleratorState

    results = []
    for cpu in (True, False):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=cpu)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        dtypes = []
        model[0].register_forward_hook(lambda module, args, out, dtypes=dtypes: dtypes.append(out.dtype))
        model, optimizer = accelerator.prepare(model, optimizer)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(accelerator.device)
        y = model(x)
        accelerator.backward(y.sum())
        optimizer.step()
        results.append((y.detach().cpu(), [p.detach().cpu() for p in model.parameters()]))
        assert dtypes == [torch.bfloat16] and accelerator.device == (torch.device("cpu") if cpu else dev)
    (y_cpu, params_cpu), (y_flagos, params_flagos) = results
    torch.testing.assert_close(y_flagos, y_cpu, rtol=0, atol=0)
    for a, b in zip(params_flagos, params_cpu):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_accelerator_fp16_mixed_precision_scales_the_loss_as_on_an_accelerator(dev, fresh_state):
    """`mixed_precision="fp16"` on flagos gets what it gets on a GPU, float16 autocast and a
    loss scaler of the device (accelerate refused flagos, and made CUDA's scaler, which turns
    itself off without CUDA): the same losses, loss scale and parameters as that loop written
    by hand on the CPU, an overflowing first step skipped by both."""
    def data():
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    accelerator = accelerate.Accelerator(mixed_precision="fp16")
    assert isinstance(accelerator.scaler, torch.amp.GradScaler) and accelerator.scaler._device == dev.type
    net = model()
    net, optimizer, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                                 torch.utils.data.DataLoader(data(), batch_size=8))
    losses = []
    for x, y in loader:
        with accelerator.autocast():
            loss = torch.nn.functional.mse_loss(net(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    host = model()
    host_optimizer = torch.optim.SGD(host.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    host_losses = []
    for x, y in torch.utils.data.DataLoader(data(), batch_size=8):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(host(x), y)
        scaler.scale(loss).backward()
        scaler.step(host_optimizer)
        scaler.update()
        host_optimizer.zero_grad()
        host_losses.append(loss.item())
    assert losses == host_losses
    assert accelerator.scaler.get_scale() == scaler.get_scale() < 65536.0  # one step skipped
    for a, b in zip(accelerator.unwrap_model(net).parameters(), host.parameters()):
        assert a.device == dev
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=0, atol=0)


@runs_once
def test_find_executable_batch_size_retries_after_a_chips_out_of_memory():
    """accelerate's batch-size search (and transformers' auto_find_batch_size with it) retries
    on an error whose text says " out of memory.", as CUDA's, HIP's and XPU's do: a C-ABI chip's
    out-of-memory error says it too. sim with a 40 MiB pool and two tensors of batch_size MiB
    a try: accelerate's sizes 64, 57, 51, ... (each 0.9 of the last) fail down to 19, the first
    that fits (2 x 19 MiB), and every failed try gives its memory back."""
    proc = run_python("""
        import torch, flagos
        from accelerate.utils import find_executable_batch_size
        flagos.activate("sim")
        tried = []

        @find_executable_batch_size(starting_batch_size=64)
        def step(batch_size):
            tried.append(batch_size)
            x = torch.ones(batch_size, 1 << 18, device="flagos")  # batch_size MiB
            return batch_size, (x * 2).sum().item()

        print("found", step(), tried)
        print("allocated", torch.flagos.memory_allocated())
    """, env={"FLAGOS_SIM_MEMORY": "40M", "FLAGOS_FALLBACK": "allow",
              "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert "found (19, 9961472.0) [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19]" in proc.stdout, proc.stdout
    assert "allocated 0" in proc.stdout


def test_get_max_memory_lists_flagos_devices_with_their_free_memory():
    from accelerate.utils import get_max_memory

    memory = get_max_memory()
    count = torch.flagos.device_count()
    assert list(memory) == [*range(count), "cpu"]
    for index in range(count):
        free = torch.flagos.mem_get_info(index)[0]
        assert memory[index] == pytest.approx(free, rel=0.05)  # the cpu chip's host memory moves
    assert get_max_memory({0: "1MB", "cpu": "2MB"}) == {0: 10**6, "cpu": 2 * 10**6}
    with pytest.raises(ValueError, match=f"flagos has {count} device"):
        get_max_memory({count + 3: 100, "cpu": 100})


def test_infer_auto_device_map_and_dispatch_match_cpu(dev):
    model = gpt2()
    expected = cpu_logits(model)
    device_map = accelerate.infer_auto_device_map(model, max_memory={0: 60_000, "cpu": 10**7})
    assert 0 in device_map.values() and "cpu" in device_map.values()  # split: flagos, then host
    accelerate.dispatch_model(model, device_map=device_map)
    assert model.transformer.wte.weight.device == dev
    close(model(IDS.to(dev)).logits, expected)


def test_cpu_offload_and_disk_offload_match_cpu(dev, tmp_path):
    model = gpt2()
    expected = cpu_logits(model)
    accelerate.cpu_offload(model, execution_device=dev)
    with torch.no_grad():
        close(model(IDS).logits, expected)
    model = gpt2()
    accelerate.disk_offload(model, str(tmp_path), execution_device=dev)
    with torch.no_grad():
        close(model(IDS).logits, expected)


@pytest.mark.parametrize("max_memory", [None, {0: 80_000, "cpu": 10**7}], ids=["on-flagos", "split"])
def test_transformers_device_map_auto_from_local_checkpoint(dev, tmp_path, max_memory):
    reference = gpt2()
    expected = cpu_logits(reference)
    reference.save_pretrained(tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, device_map="auto",
                                                         max_memory=max_memory).eval()
    assert model.transformer.wte.weight.device == dev
    if max_memory is not None:  # the blocks that did not fit wait on the host
        assert "cpu" in model.hf_device_map.values()
    with torch.no_grad():
        close(model(IDS.to(dev)).logits, expected)
        generated = model.generate(IDS.to(dev), max_new_tokens=4, do_sample=False)
        assert generated.tolist() == reference.generate(IDS, max_new_tokens=4, do_sample=False).tolist()


@pytest.mark.skipif(CHIP != "sim", reason="needs a chip with two devices (sim has two)")
def test_device_map_auto_spreads_over_two_flagos_devices(tmp_path):
    reference = gpt2()
    expected = cpu_logits(reference)
    reference.save_pretrained(tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path, device_map="auto", max_memory={0: 80_000, 1: 10**6, "cpu": 10**6}).eval()
    assert set(model.hf_device_map.values()) == {0, 1}
    assert model.transformer.h[0].attn.c_attn.weight.device == torch.device("flagos", 1)
    with torch.no_grad():
        close(model(IDS.to(flagos.device())).logits, expected)


def tied_llama(seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def model_size(model) -> int:
    """Bytes of the model's weights and buffers, as the libraries' own tests size max_memory."""
    return accelerate.utils.compute_module_sizes(model)[""]


def assert_placed_as_mapped(model, device_map):
    """Each parameter where its module's entry says: flagos:N for N, the meta device for modules
    whose weights wait on the host (accelerate's hooks bring them to the execution device)."""
    for name, param in model.named_parameters():
        key = name
        while key and key not in device_map:
            key = key.rpartition(".")[0]
        where = device_map[key]
        assert param.device == (torch.device("meta") if where in ("cpu", "disk") else
                                torch.device("flagos", where)), name


@pytest.mark.parametrize("share", [0.5, 0.7])
def test_device_map_auto_with_integer_max_memory_splits_with_the_host(dev, tmp_path, share):
    """transformers' test_cpu_offload: a model that ran on flagos, saved from the host, loaded
    with max_memory={0: part of its size, "cpu": twice its size}."""
    reference = tied_llama()
    expected = cpu_logits(reference)
    model = tied_llama().to(dev)
    model(IDS.to(dev))  # with gradients, as the library's test does: module.cpu() then copies
    size = model_size(model)
    model.cpu().save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, device_map="auto", max_memory={0: int(share * size), "cpu": 2 * size})
    assert set(loaded.hf_device_map.values()) == {0, "cpu"}
    assert_placed_as_mapped(loaded, loaded.hf_device_map)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        close(loaded(IDS.to(dev)).logits, expected)


@pytest.mark.skipif(CHIP != "sim", reason="needs a chip with two devices (sim has two)")
@pytest.mark.parametrize("host", [False, True], ids=["two-devices", "two-devices-and-host"])
def test_device_map_auto_over_two_flagos_devices_with_integer_max_memory(tmp_path, host):
    """transformers' test_model_parallelism: max_memory over {0, 1, "cpu"}."""
    assert torch.flagos.device_count() == 2  # FLAGOS_SIM_DEVICES' default
    reference = tied_llama()
    expected = cpu_logits(reference)
    reference.save_pretrained(tmp_path)
    size = model_size(reference)
    max_memory = {0: int(0.5 * size), 1: int(0.3 * size) if host else 2 * size, "cpu": 2 * size}
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map="auto",
                                                         max_memory=max_memory)
    assert set(model.hf_device_map.values()) == ({0, 1, "cpu"} if host else {0, 1})
    assert_placed_as_mapped(model, model.hf_device_map)
    with torch.no_grad():
        close(model(IDS.to(flagos.device())).logits, expected)


def test_infer_auto_device_map_and_dispatch_over_every_flagos_device_and_the_host(dev):
    model = tied_llama()
    expected = cpu_logits(model)
    count = torch.flagos.device_count()
    budget = int(0.3 * model_size(model))
    device_map = accelerate.infer_auto_device_map(
        model, max_memory={**dict.fromkeys(range(count), budget), "cpu": 10**7},
        no_split_module_classes=model._no_split_modules)
    assert set(device_map.values()) == {*range(count), "cpu"}
    accelerate.dispatch_model(model, device_map=device_map)
    assert model.hf_device_map == device_map
    assert_placed_as_mapped(model, device_map)
    close(model(IDS.to(dev)).logits, expected)


def device_map_plans(device_count: int) -> dict:
    """accelerate's device_map="auto" plans (get_balanced_memory, then infer_auto_device_map)
    for two small models and max_memory keyed by device index."""
    plans = {}
    for name, build in (("bert", lambda: transformers.BertModel(transformers.BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
            intermediate_size=37))), ("llama-tied", tied_llama)):
        with accelerate.init_empty_weights():
            model = build()
        size = model_size(model)
        for share in (0.5, 0.7, 0.9):
            memories = [{0: int(share * size), "cpu": 2 * size}]
            if device_count > 1:
                memories.append({0: int(share * size), 1: int(share * size / 2), "cpu": 2 * size})
            for memory in memories:
                balanced = accelerate.utils.get_balanced_memory(
                    model, max_memory=memory, no_split_module_classes=model._no_split_modules)
                plan = accelerate.infer_auto_device_map(model, max_memory=balanced,
                                                        no_split_module_classes=model._no_split_modules)
                plans[f"{name} {share} {list(memory)}"] = {k: str(v) for k, v in plan.items()}
    return plans


def test_device_map_plans_are_the_ones_accelerate_makes_without_flagos(monkeypatch):
    """flagos only answers which devices there are and their memory: for a given max_memory the
    plan is the one accelerate makes without flagos, where integer keys are CUDA devices (its own
    get_max_memory), including plans that leave the whole model on the host, for which
    transformers sets no hf_device_map on any accelerator (BERT with half its size on device 0)."""
    from accelerate.utils import modeling

    count = torch.flagos.device_count()
    plans = device_map_plans(count)
    assert plans["bert 0.5 [0, 'cpu']"] == {"": "cpu"}
    assert {"0", "cpu"} <= set(plans["llama-tied 0.5 [0, 'cpu']"].values())
    if count > 1:
        assert {"0", "1", "cpu"} <= set(plans["llama-tied 0.7 [0, 1, 'cpu']"].values())
    monkeypatch.setattr(modeling, "get_max_memory", modeling.get_max_memory.__wrapped__)
    assert device_map_plans(count) == plans


def test_diffusers_device_map_auto_with_integer_max_memory_splits_with_the_host(dev, tmp_path):
    """Diffusers' test_cpu_offload for a model class that can be split (AutoencoderKL)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3,
                                  latent_channels=4, norm_num_groups=4, layers_per_block=1,
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2).eval()
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = vae(x).sample
    size = model_size(vae)
    vae.save_pretrained(tmp_path)
    model = diffusers.AutoencoderKL.from_pretrained(tmp_path, device_map="auto",
                                                    max_memory={0: size // 2, "cpu": 2 * size})
    assert set(model.hf_device_map.values()) == {0, "cpu"}
    assert_placed_as_mapped(model, model.hf_device_map)
    with torch.no_grad():
        close(model(x.to(dev)).sample, expected)


def test_diffusers_pipeline_saved_from_flagos_loads_with_device_map(dev, tmp_path):
    """Diffusers' test_pipeline_with_accelerator_device_map: a pipeline on flagos saved, then
    loaded with device_map="flagos" (the accelerator's name, as "cuda" there)."""
    diffusers = pytest.importorskip("diffusers")
    import models

    expected = models.run_ddpm(models.ddpm_pipeline())
    models.ddpm_pipeline().to(dev).save_pretrained(tmp_path)
    pipe = diffusers.DDPMPipeline.from_pretrained(tmp_path, device_map="flagos")
    pipe.set_progress_bar_config(disable=True)
    assert pipe.unet.device == dev
    np.testing.assert_allclose(models.run_ddpm(pipe), expected, atol=1e-5, rtol=0)


def test_accelerate_imported_before_activation_finds_flagos():
    proc = run_python(f"""
        import accelerate, transformers.integrations.accelerate as hf
        from accelerate.utils import get_max_memory
        import flagos
        flagos.activate({CHIP!r})
        print("device", accelerate.PartialState().device)
        print("memory", sorted(k for k in get_max_memory() if isinstance(k, int)))
        print("transformers", sorted(k for k in hf.get_max_memory() if isinstance(k, int)))
    """, env={"FLAGOS_FALLBACK": "allow",
              "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    count = torch.flagos.device_count()
    assert "device flagos:0" in proc.stdout
    assert f"memory {list(range(count))}" in proc.stdout
    assert f"transformers {list(range(count))}" in proc.stdout


@same_on_every_chip
def test_native_mode_and_deactivation_leave_accelerate_its_own_default_device():
    """Only device mode makes flagos accelerate's default device: in native mode a chip's own
    device is PyTorch's (the host, for the cpu chip), and after deactivate() nothing of flagos
    is asked."""
    proc = run_python("""
        import accelerate, flagos
        from accelerate import PartialState
        flagos.activate("cpu", mode="native")
        print("native", PartialState().default_device)
        flagos.deactivate()
        print("after", PartialState().default_device)
    """, env={"FLAGOS_FALLBACK": "allow"})
    assert "native cpu" in proc.stdout and "after cpu" in proc.stdout


def test_get_max_memory_accepts_every_device_and_no_other():
    """Indices 0 to device_count - 1 are flagos devices; device_count itself and -1 are not."""
    from accelerate.utils import get_max_memory

    count = torch.flagos.device_count()
    budgets = {i: 1000 * (i + 1) for i in range(count)}
    assert get_max_memory({**budgets, "cpu": "1KB"}) == {**budgets, "cpu": 1000}
    for missing in (count, -1):
        with pytest.raises(ValueError, match=rf"names device {missing}, but flagos has {count} "
                                             rf"device\(s\).*use indices 0 to {count - 1}"):
            get_max_memory({missing: 100, "cpu": 100})


class _Kinds:
    NO, MULTI_GPU, MULTI_CPU = "NO", "MULTI_GPU", "MULTI_CPU"


def _launched_state(found_kind):
    """A stand-in for accelerate's PartialState: what its own backend choice and set_device do,
    with flagos's answers put around them as on the real class."""
    class State:
        device = None
        local_process_index = 0

        def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            return backend or "gloo", found_kind

        def set_device(self):
            self.device = "accelerate's own"

    _libraries._accelerate_distributed(State, _Kinds)
    return State()


def test_a_launched_process_forms_its_group_on_flagos_unless_told_otherwise(monkeypatch):
    """Under a launcher (LOCAL_RANK set) accelerate's backend becomes flagos's and the kind
    data-parallel over devices; a CPU run, SageMaker's data parallel, a kind accelerate decided
    otherwise, or no launcher keeps accelerate's own answer, as does an explicit backend only
    where it is "nccl" under the CUDA redirect."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    state = _launched_state(_Kinds.NO)
    assert state._prepare_backend(False, False, None) == ("flagos", _Kinds.MULTI_GPU)
    assert state._prepare_backend(True, False, None) == ("gloo", _Kinds.NO)       # cpu=True
    assert state._prepare_backend(False, True, None) == ("gloo", _Kinds.NO)       # sagemaker_dp
    assert _launched_state(_Kinds.MULTI_CPU)._prepare_backend(False, False, None) == ("gloo", _Kinds.MULTI_CPU)
    assert state._prepare_backend(False, False, "nccl") == ("flagos", _Kinds.MULTI_GPU)
    monkeypatch.setattr(_state.active(), "redirect_cuda", True)
    assert state._prepare_backend(False, False, "nccl") == ("nccl", _Kinds.MULTI_GPU)
    monkeypatch.delenv("LOCAL_RANK")
    assert state._prepare_backend(False, False, None) == ("gloo", _Kinds.NO)


def test_a_process_in_a_flagos_group_takes_the_device_of_its_local_rank(dev, monkeypatch):
    state = _launched_state(_Kinds.NO)
    state.backend = "flagos"
    state.set_device()
    assert state.device == torch.device("flagos", 0) and torch.flagos.current_device() == 0
    other = _launched_state(_Kinds.NO)
    other.backend = "gloo"  # a group accelerate formed itself: its own device choice
    other.set_device()
    assert other.device == "accelerate's own"
    nccl = _launched_state(_Kinds.NO)
    nccl.backend = "nccl"  # a CUDA script's group: flagos's only under the CUDA redirect
    nccl.set_device()
    assert nccl.device == "accelerate's own"
    monkeypatch.setattr(_state.active(), "redirect_cuda", True)
    redirected = _launched_state(_Kinds.NO)
    redirected.backend = "nccl"
    redirected.set_device()
    assert redirected.device == torch.device("flagos", 0)


@pytest.mark.parametrize("error", [AttributeError("module has no attribute 'PartialState'"),
                                   TypeError("default_device() takes 1 positional argument")])
def test_a_library_version_flagos_cannot_answer_is_left_working_with_a_warning(monkeypatch, caplog, error):
    """Another release of a library (a renamed attribute, another signature): its import and
    everything else go on; the log says to pass flagos.device() to it explicitly."""
    def patch(module):
        raise error

    monkeypatch.setitem(_libraries._PATCHES, "flagos_test_library", patch)
    monkeypatch.setattr(_libraries, "_done", set())
    with caplog.at_level("WARNING", logger="flagos"):
        _libraries._patch("flagos_test_library", object())
    assert f"flagos could not answer flagos_test_library's device detection ({type(error).__name__}: " \
           f"{error}); pass flagos.device() to it explicitly" in caplog.text

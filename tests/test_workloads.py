"""The workloads of `flagos bench` and `flagos compare` (flagos/tools/_models.py): each built-in
is the model docs/cli.md describes (layers, sizes, inputs, seeds), a user's `path.py:function`
is loaded as documented, and the helpers that cast, move and collect tensors do what a bench or
a comparison relies on. Plain PyTorch on the CPU: a workload is built before any chip sees it."""
import dataclasses

import pytest
import torch

from flagos.tools import _models


def _draw(*shape, seed: int, ints: int = 0) -> torch.Tensor:
    """What docs/cli.md says the inputs are: drawn from a generator seeded `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ints, shape, generator=g) if ints else torch.randn(*shape, generator=g)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", ["mlp", "cnn", "bert", "unet"])
def test_weights_follow_the_seed_and_the_model_is_in_eval_mode(name):
    first, again, other = (_models.load(name, seed=s) for s in (3, 3, 4))
    assert _same_weights(first.model, again.model) and not _same_weights(first.model, other.model)
    assert not first.model.training and first.name == name


def test_a_workload_is_one_row_of_seed_0_unless_asked():
    plain, asked = _models.load("mlp"), _models.load("mlp", batch=1, seed=0)
    assert plain.inputs[0].shape == (1, 256) and _same_weights(plain.model, asked.model)
    assert torch.equal(plain.inputs[0], asked.inputs[0])


def test_mlp_is_256_512_512_10_with_gelu_and_layer_norm():
    work = _models.load("mlp", batch=3)
    layers = list(work.model)
    assert [type(m).__name__ for m in layers] == ["Linear", "GELU", "Linear", "LayerNorm", "Linear"]
    assert [(m.in_features, m.out_features) for m in layers[::2]] == [(256, 512), (512, 512), (512, 10)]
    assert layers[3].normalized_shape == (512,)
    assert len(work.inputs) == 1 and work.inputs[0].shape == (3, 256)
    assert work.call(work.model, work.inputs).shape == (3, 10)


def test_cnn_is_two_3x3_convolutions_on_32x32_images_into_10_classes():
    work = _models.load("cnn", batch=2)
    layers = list(work.model)
    assert [type(m).__name__ for m in layers] == [
        "Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU", "AdaptiveAvgPool2d", "Flatten", "Linear"]
    convs = [layers[0], layers[4]]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == \
        [(3, 16, (3, 3), (1, 1)), (16, 32, (3, 3), (1, 1))]
    assert layers[1].num_features == 16 and layers[3].kernel_size == 2 and layers[6].output_size == 1
    assert (layers[8].in_features, layers[8].out_features) == (32, 10)
    (x,) = work.inputs
    assert x.shape == (2, 3, 32, 32)
    seen = []
    layers[4].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert work.call(work.model, work.inputs).shape == (2, 10)
    assert seen == [(2, 32, 16, 16)]  # padding 1 keeps 32x32, the pool halves it


def test_bert_is_two_layers_of_128_with_32_token_ids_drawn_from_seed_plus_one():
    work = _models.load("bert", batch=2, seed=5)
    config = work.model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.intermediate_size, config.max_position_embeddings) == (1000, 128, 2, 4, 512, 128)
    assert config.hidden_dropout_prob == 0.0 and config.attention_probs_dropout_prob == 0.0
    assert torch.equal(work.inputs["input_ids"], _draw(2, 32, seed=6, ints=1000))
    assert torch.equal(work.inputs["attention_mask"], torch.ones(2, 32, dtype=torch.int64))
    out = work.call(work.model, work.inputs)
    assert out.last_hidden_state.shape == (2, 32, 128)


def test_unet_is_one_step_at_timestep_10_on_a_sample_drawn_from_seed_plus_one():
    work = _models.load("unet", batch=2, seed=1)
    config = work.model.config
    assert (config.sample_size, config.in_channels, config.out_channels, config.layers_per_block,
            tuple(config.block_out_channels), config.norm_num_groups) == (32, 3, 3, 1, (32, 64, 64), 8)
    assert tuple(config.down_block_types) == ("DownBlock2D", "AttnDownBlock2D", "DownBlock2D")
    assert tuple(config.up_block_types) == ("UpBlock2D", "AttnUpBlock2D", "UpBlock2D")
    assert torch.equal(work.inputs["sample"], _draw(2, 3, 32, 32, seed=2))
    assert work.inputs["timestep"].item() == 10
    assert work.call(work.model, work.inputs).sample.shape == (2, 3, 32, 32)


def test_ddpm_is_four_steps_of_a_100_step_scheduler_with_noise_from_seed_plus_two():
    from diffusers import DDPMScheduler

    work = _models.load("ddpm", batch=1, seed=0)
    assert work.model.scheduler.config.num_train_timesteps == 100
    (noise,) = work.inputs
    assert torch.equal(noise, _draw(1, 3, 32, 32, seed=1))
    assert _same_weights(work.model.unet, _models.load("unet", seed=0).model)  # that UNet
    steps = []
    work.model.unet.register_forward_hook(lambda m, args, out: steps.append(int(args[1])))
    with torch.no_grad():
        out = work.call(work.model, work.inputs)
        again = work.call(work.model, work.inputs)
    assert steps == [75, 50, 25, 0] * 2
    assert torch.equal(out, again)  # each call denoises with the same scheduler noise
    # the loop by hand, Diffusers' own scheduler, its noise drawn from seed + 2
    scheduler = DDPMScheduler(num_train_timesteps=100)
    scheduler.set_timesteps(4)
    generator = torch.Generator().manual_seed(2)
    sample = noise
    with torch.no_grad():
        for t in scheduler.timesteps:
            eps = work.model.unet(sample, t).sample
            sample = scheduler.step(eps, t, sample, generator=generator).prev_sample
    assert torch.equal(out, sample)


def test_a_user_function_is_called_with_the_seed_set_and_batch_when_it_takes_one(tmp_path):
    (tmp_path / "work.py").write_text(
        "import torch\n\n"
        "def with_batch(batch):\n    return torch.nn.Linear(4, 2), torch.randn(batch, 4)\n\n"
        "def without():\n    return torch.nn.Linear(4, 2), {'input': torch.randn(1, 4)}\n\n"
        "def wrong():\n    return torch.nn.Linear(4, 2)\n\n"
        "def three():\n    return torch.nn.Linear(4, 2), 1, 2\n\n"
        "def not_a_module():\n    return 'model', torch.ones(1)\n\n"
        "class Net(torch.nn.Linear):\n    pass\n\n"
        "def own_class():\n    return Net(4, 2), torch.ones(1, 4)\n\n"
        "NOT_CALLABLE = 3\n")
    # the file's classes belong to a module named after it, as tracebacks and reprs show them
    assert type(_models.load(f"{tmp_path / 'work.py'}:own_class").model).__module__ == "flagos_user_model_work"
    spec = f"{tmp_path / 'work.py'}:with_batch"
    work = _models.load(spec, batch=5, seed=7)
    torch.manual_seed(7)
    expected = torch.nn.Linear(4, 2), torch.randn(5, 4)
    assert work.name == spec and _same_weights(work.model, expected[0]) and torch.equal(work.inputs, expected[1])
    assert work.call(work.model, work.inputs).shape == (5, 2)
    work = _models.load(f"{tmp_path / 'work.py'}:without", batch=5)
    assert work.inputs["input"].shape == (1, 4) and work.call(work.model, work.inputs).shape == (1, 2)
    for name, returned in (("wrong", "Linear"), ("three", "tuple"), ("not_a_module", "tuple")):
        with pytest.raises(ValueError, match=f"must return \\(model, inputs\\).*it returned {returned}$"):
            _models.load(f"{tmp_path / 'work.py'}:{name}")
    for name in ("NOT_CALLABLE", "missing"):
        with pytest.raises(ValueError, match=f"has no function '{name}'"):
            _models.load(f"{tmp_path / 'work.py'}:{name}")


def test_a_spec_is_checked_before_anything_is_built(tmp_path):
    (tmp_path / "work.py").write_text("")
    _models.check_spec("ddpm")
    _models.check_spec(f"{tmp_path / 'work.py'}:f")
    for spec in ("resnet", f"{tmp_path / 'work.py'}", f"{tmp_path / 'work.txt'}:f", f"{tmp_path / 'work.py'}:"):
        with pytest.raises(ValueError, match="unknown model .* use one of mlp, cnn, bert, unet, ddpm or "
                                             "path/to/file.py:function"):
            _models.check_spec(spec)
    with pytest.raises(ValueError, match="model file '.*nowhere.py' does not exist"):
        _models.check_spec(f"{tmp_path / 'nowhere.py'}:f")


def test_dtype_names_as_typed_on_the_command_line():
    for names, dtype in ((("float32", "fp32", " FP32 "), torch.float32), (("float16", "fp16", "half", "Half"), torch.float16),
                         (("bfloat16", "bf16", "BF16"), torch.bfloat16), (("float64", "fp64"), torch.float64)):
        assert {_models.parse_dtype(n) for n in names} == {dtype}
    with pytest.raises(ValueError, match="unknown dtype 'int8'; use one of: float32, float16, bfloat16, float64"):
        _models.parse_dtype("int8")


def test_cast_and_move_change_floating_tensors_only():
    model = torch.nn.Linear(2, 2)
    model.register_buffer("steps", torch.tensor(3))
    cast = _models.cast_model(model, "cpu", torch.float64)
    assert cast.weight.dtype == torch.float64 and cast.steps.dtype == torch.int64
    assert _models.cast_model(torch.nn.Linear(2, 2).half(), "cpu", None).weight.dtype == torch.float16
    inputs = {"x": torch.ones(2), "ids": torch.ones(2, dtype=torch.int64),
              "pair": (torch.zeros(1), [torch.ones(1), "text"]), "n": 4}
    moved = _models.move(inputs, "cpu", torch.float16)
    assert moved["x"].dtype == torch.float16 and moved["ids"].dtype == torch.int64
    assert type(moved["pair"]) is tuple and type(moved["pair"][1]) is list
    assert moved["pair"][0].dtype == torch.float16 and moved["pair"][1][1] == "text" and moved["n"] == 4
    assert _models.move(torch.ones(2), "cpu").dtype == torch.float32


def test_every_tensor_of_an_output_is_collected_in_order():
    @dataclasses.dataclass
    class Out:
        first: torch.Tensor
        rest: tuple

    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    value = {"out": Out(a, (b, [c, "label"])), "extra": d, "none": None}
    assert [float(t) for t in _models.output_tensors(value)] == [0.0, 1.0, 2.0, 3.0]
    assert _models.output_tensors(Out) == [] and _models.output_tensors(3) == []


def test_inputs_are_passed_as_keywords_positions_or_one_argument():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, *args, **kwargs):
            seen.append((len(args), sorted(kwargs)))

    for inputs in ({"a": 1, "b": 2}, (1, 2), [1, 2, 3], torch.ones(1)):
        _models.Workload("probe", Probe(), inputs).call(Probe(), inputs)
    assert seen == [(0, ["a", "b"]), (2, []), (3, []), (1, [])]

"""Built-in workloads for `flagos bench` and `flagos compare`, built from small configs with
seeded random weights (no downloads), and user workloads given as `path.py:function`.

A workload is a module and its inputs: `load(spec, batch, seed)` returns a `Workload` whose
`call(model, inputs)` runs one step. A user function takes no arguments (or `batch`) and
returns `(model, inputs)`, inputs being a tensor, a tuple of positional arguments or a dict of
keyword arguments.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch


@dataclasses.dataclass
class Workload:
    name: str
    model: torch.nn.Module
    inputs: Any                                  # tuple (positional) or dict (keyword)
    call: Callable[[torch.nn.Module, Any], Any] = None

    def __post_init__(self):
        if self.call is None:
            self.call = call_module


def call_module(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _mlp(batch: int, seed: int) -> Workload:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 512), torch.nn.LayerNorm(512),
                                torch.nn.Linear(512, 10))
    return Workload("mlp", model.eval(), (torch.randn(batch, 256),))


def _cnn(batch: int, seed: int) -> Workload:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
    return Workload("cnn", model.eval(), (torch.randn(batch, 3, 32, 32),))


def _bert(batch: int, seed: int) -> Workload:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=512,
                        max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertModel(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (batch, 32), generator=g)
    return Workload("bert", model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def _unet(batch: int, seed: int) -> Workload:
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    model = UNet2DModel(
        sample_size=32, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(32, 64, 64), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D")).eval()
    g = torch.Generator().manual_seed(seed + 1)
    sample = torch.randn(batch, 3, 32, 32, generator=g)
    return Workload("unet", model, {"sample": sample, "timestep": torch.tensor(10)})


class _DDPM(torch.nn.Module):
    """A whole DDPM denoising loop as one module, so the pipeline is measured and compared as
    users run it (the UNet is a submodule, so compare's hooks see every layer)."""

    def __init__(self, seed: int, steps: int = 4):
        super().__init__()
        from diffusers import DDPMScheduler

        self.unet = _unet(1, seed).model
        self.scheduler = DDPMScheduler(num_train_timesteps=100)
        self.steps, self.seed = steps, seed

    def forward(self, noise):
        self.scheduler.set_timesteps(self.steps)
        # the scheduler's noise drawn on the host from a seeded generator: every chip, and
        # every call, denoises with the same noise
        generator = torch.Generator().manual_seed(self.seed + 2)
        sample = noise
        for t in self.scheduler.timesteps:
            eps = self.unet(sample, t).sample
            sample = self.scheduler.step(eps, t, sample, generator=generator).prev_sample
        return sample


def _ddpm(batch: int, seed: int) -> Workload:
    model = _DDPM(seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    return Workload("ddpm", model, (torch.randn(batch, 3, 32, 32, generator=g),))


BUILTIN = {"mlp": _mlp, "cnn": _cnn, "bert": _bert, "unet": _unet, "ddpm": _ddpm}


def check_spec(spec: str) -> None:
    """ValueError naming the choices unless `spec` names a built-in or an existing
    `path.py:function` (cheap: builds nothing, so a tool can check before starting children)."""
    if spec in BUILTIN:
        return
    path, sep, func = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not func:
        raise ValueError(f"unknown model {spec!r}: use one of {', '.join(BUILTIN)} or "
                         f"path/to/file.py:function (a function returning (model, inputs))")
    if not os.path.isfile(path):
        raise ValueError(f"model file {path!r} does not exist")


def load(spec: str, batch: int = 1, seed: int = 0) -> Workload:
    """A built-in workload by name, or `path.py:function` returning (model, inputs).

    A user function may take a `batch` argument; it is called with the seed already set."""
    check_spec(spec)
    if spec in BUILTIN:
        return BUILTIN[spec](batch, seed)
    path, _, func = spec.rpartition(":")
    path = os.path.abspath(path)
    # the file's folder on the path, so the file can import its neighbours as a script would
    if os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    name = "flagos_user_model_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ValueError(f"{path} has no function {func!r}")
    torch.manual_seed(seed)
    takes_batch = "batch" in inspect.signature(fn).parameters
    made = fn(batch=batch) if takes_batch else fn()
    if (not isinstance(made, (tuple, list)) or len(made) != 2
            or not isinstance(made[0], torch.nn.Module)):
        raise ValueError(f"{spec} must return (model, inputs): an nn.Module and a tensor, tuple "
                         f"or dict of its arguments; it returned {type(made).__name__}")
    return Workload(spec, made[0], made[1])


def cast_model(model: torch.nn.Module, device, dtype: torch.dtype | None) -> torch.nn.Module:
    """`model` on `device`, its floating parameters and buffers cast to `dtype` when given."""
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    """A dtype from its command-line name, or ValueError listing the names."""
    dtype = DTYPES.get(name.strip().lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; use one of: float32, float16, bfloat16, "
                         f"float64 (or fp32, fp16, bf16, fp64)")
    return dtype


def output_tensors(value) -> list[torch.Tensor]:
    """Every tensor in a model's output (tensor, tuple, list, dict, ModelOutput, dataclass)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in output_tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in output_tensors(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value)
                for t in output_tensors(getattr(value, f.name))]
    return []


def move(inputs, device, dtype: torch.dtype | None = None):
    """Inputs (tensor, tuple, list or dict, nested) moved to `device`; floating tensors cast
    to `dtype` when given."""
    if isinstance(inputs, torch.Tensor):
        if dtype is not None and inputs.is_floating_point():
            return inputs.to(device=device, dtype=dtype)
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: move(v, device, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(move(v, device, dtype) for v in inputs)
    return inputs

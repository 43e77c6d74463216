"""Small, seeded models built from configs (random weights, no downloads)."""
from __future__ import annotations

import torch


def ddpm_pipeline(seed: int = 0):
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(seed)
    unet = UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    pipe = DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=100))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_ddpm(pipe, steps: int = 4, seed: int = 0):
    generator = torch.Generator("cpu").manual_seed(seed)
    return pipe(batch_size=1, generator=generator, num_inference_steps=steps, output_type="np").images


BERT_SIZES = {
    # the test model: small enough for every test, dominated by per-op dispatch cost
    "tiny": dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=64),
    # BERT-base's layer shape (hidden 768, 12 heads, 3072 FFN) with 4 layers, for benchmarks
    "base": dict(vocab_size=128, hidden_size=768, num_hidden_layers=4, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512),
}


def bert(seed: int = 0, size: str = "tiny"):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(**BERT_SIZES[size], num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).eval()


def bert_batch(seed: int = 1, batch: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    labels = torch.randint(0, 3, (batch,), generator=g)
    return ids, mask, labels


def _clip_tokenizer(folder: str):
    """A CLIP tokenizer written to `folder`: one token per letter (no merges), start and end."""
    import json
    import os

    from transformers import CLIPTokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {c: i for i, c in enumerate(letters)}
    vocab.update({c + "</w>": len(letters) + i for i, c in enumerate(letters)})
    vocab.update({"<|startoftext|>": 52, "<|endoftext|>": 53})
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    return CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"),
                         model_max_length=8)


def tiny_sd_pipeline(folder: str, seed: int = 0):
    """A Stable-Diffusion pipeline of three small models (UNet2DConditionModel, AutoencoderKL,
    CLIPTextModel) with a letter tokenizer; `folder` holds the tokenizer's files."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
        norm_num_groups=4, attention_head_dim=4)
    vae = AutoencoderKL(block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4,
                        norm_num_groups=4, layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=54, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=8, bos_token_id=52, eos_token_id=53, pad_token_id=53, projection_dim=16))
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=_clip_tokenizer(folder),
        scheduler=DDIMScheduler(clip_sample=False, steps_offset=1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_sd(pipe, steps: int = 2, seed: int = 0):
    generator = torch.Generator("cpu").manual_seed(seed)
    return pipe("a cat", num_inference_steps=steps, height=16, width=16, generator=generator,
                output_type="np").images

"""A tiny Stable-Diffusion-architecture pipeline built from configs, for tests.

Same classes as SD v1.5 (UNet2DConditionModel, AutoencoderKL, CLIPTextModel, CLIPTokenizer,
DDIMScheduler), saved with save_pretrained and loaded back through the real loading path.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer


def write_char_tokenizer(folder: Path) -> None:
    """A CLIP BPE tokenizer whose tokens are single characters (no merges)."""
    folder.mkdir(parents=True, exist_ok=True)
    chars = list(string.ascii_lowercase + string.digits + ".,'-")
    vocab = {}
    for ch in chars:
        vocab[ch] = len(vocab)
    for ch in chars:
        vocab[ch + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))


def build_tiny_unet(sample_size: int = 8):
    """The tiny pipeline's random UNet (SD v1.5's block types, UpBlock2D after the mid block)."""
    return UNet2DConditionModel(
        sample_size=sample_size,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
    )



def build_tiny_vae(sample_size: int, **config):
    """A two-block AutoencoderKL (8x downsampling would be too much for 16-32 px: this one halves once);
    ``config`` overrides or adds config entries (latent channels, scaling and shift factors, ...)."""
    return AutoencoderKL(**{
        "in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D", "DownEncoderBlock2D"),
        "up_block_types": ("UpDecoderBlock2D", "UpDecoderBlock2D"), "block_out_channels": (8, 16),
        "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 8, "sample_size": sample_size, **config,
    })


def build_tiny_pipeline(folder: str | Path, seed: int = 0, sample_size: int = 8):
    """Save a tiny random SD pipeline (16 px images, 4x8x8 latents) to ``folder`` and return the path."""
    folder = Path(folder)
    torch.manual_seed(seed)
    unet = build_tiny_unet(sample_size)
    vae = build_tiny_vae(sample_size * 2)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=82,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=80,
            eos_token_id=81,
            pad_token_id=81,
        )
    )
    write_char_tokenizer(folder / "_tok")
    tokenizer = CLIPTokenizer.from_pretrained(folder / "_tok")
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder / "pipeline")
    return folder / "pipeline"

"""A tiny SDXL-architecture pipeline built from configs with random weights, for tests.

Same classes as stable-diffusion-xl-base-1.0: a UNet2DConditionModel with SDXL's "text_time" added
conditioning, two CLIP text encoders (the second with a projection, whose projected output is the pooled
embedding), two tokenizers, an AutoencoderKL with SDXL's scaling factor and force_upcast, and the
EulerDiscreteScheduler config SDXL ships (the family swaps it for DDIM on load). Saved with
save_pretrained and loaded back through the real loading path.

Sizes differ on purpose so that a mix-up fails loudly: encoder 1 has width 16, encoder 2 width 24 with
a 12-d projection, so the UNet's cross-attention width is 40 and its added embedding takes
6 x 4 (time ids) + 12 (pooled) = 36 inputs. The two tokenizers pad with different tokens, as SDXL's do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from align.testing.tiny_sd import build_tiny_vae, write_char_tokenizer

TEXT_WIDTHS = (16, 24)  # hidden sizes of text_encoder and text_encoder_2
POOLED_DIM = 12  # text_encoder_2's projection_dim
TIME_EMBED_DIM = 4  # addition_time_embed_dim: each of the 6 time ids gets a 4-d sinusoidal embedding
IMAGE_SIDE = 32  # default resolution: the UNet's sample_size (16) x the VAE's scale factor (2)


def _text_config(width: int, pad_token_id: int, projection_dim: int | None = None):
    extra = {"projection_dim": projection_dim} if projection_dim else {}
    return CLIPTextConfig(
        vocab_size=83, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, bos_token_id=80, eos_token_id=81, pad_token_id=pad_token_id, **extra,
    )


def _write_second_tokenizer(folder: Path) -> None:
    """The character tokenizer with a "!" token that pads, as SDXL's tokenizer_2 pads with "!"."""
    write_char_tokenizer(folder)
    vocab = json.loads((folder / "vocab.json").read_text())
    vocab["!"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77, "pad_token": "!"}))


def build_tiny_sdxl_unet():
    return UNet2DConditionModel(
        sample_size=IMAGE_SIDE // 2,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),  # SDXL: no attention at the highest resolution
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        transformer_layers_per_block=(1, 2),
        cross_attention_dim=sum(TEXT_WIDTHS),
        addition_embed_type="text_time",
        addition_time_embed_dim=TIME_EMBED_DIM,
        projection_class_embeddings_input_dim=6 * TIME_EMBED_DIM + POOLED_DIM,
        norm_num_groups=8,
    )


def build_tiny_sdxl_pipeline(folder: str | Path, seed: int = 0, force_zeros_for_empty_prompt: bool = True):
    """Save a tiny random SDXL pipeline (32 px images, 4x16x16 latents) under ``folder``; return its path."""
    folder = Path(folder)
    torch.manual_seed(seed)
    unet = build_tiny_sdxl_unet()
    vae = build_tiny_vae(IMAGE_SIDE, scaling_factor=0.13025,  # SDXL's, not SD's 0.18215: the family must read it
                         force_upcast=True)
    text_encoder = CLIPTextModel(_text_config(TEXT_WIDTHS[0], pad_token_id=81))
    text_encoder_2 = CLIPTextModelWithProjection(_text_config(TEXT_WIDTHS[1], pad_token_id=82, projection_dim=POOLED_DIM))
    write_char_tokenizer(folder / "_tok")
    _write_second_tokenizer(folder / "_tok2")
    # SDXL base's scheduler config: Euler with the DDPM betas; the DDIM keys ride along as in the real file.
    scheduler = EulerDiscreteScheduler.from_config({
        "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
        "prediction_type": "epsilon", "steps_offset": 1, "timestep_spacing": "leading", "interpolation_type": "linear",
        "use_karras_sigmas": False, "clip_sample": False, "set_alpha_to_one": False, "sample_max_value": 1.0,
        "skip_prk_steps": True,
    })
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=CLIPTokenizer.from_pretrained(folder / "_tok"),
        tokenizer_2=CLIPTokenizer.from_pretrained(folder / "_tok2"),
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
        add_watermarker=False,
    )
    pipe.save_pretrained(folder / "pipeline")
    return folder / "pipeline"

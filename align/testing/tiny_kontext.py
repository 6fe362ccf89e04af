"""A tiny FLUX.1 Kontext pipeline (FluxKontextPipeline: FLUX.1's transformer, CLIP + T5, the FLUX VAE) built from
align/testing/tiny_flow.py's scaled-down FLUX config, saved and loaded back like real weights, for tests.

Sizes: 32 px images <-> 4 x 16 x 16 latents, 64 generated + 64 source image tokens. ``flow_testbed.json`` beside it
stores the 32 px size (FluxKontextPipeline's own default is 1024 px) and the T5 length of the tiny FLUX pipelines.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel

from align.testbed.flow_models import FLOW_SETTINGS_FILE
from align.testing.tiny_flow import (
    CLIP_HIDDEN,
    JOINT_DIM,
    T5_MAX_SEQUENCE_LENGTH,
    _clip_config,
    _clip_tokenizer,
    _t5_encoder,
    _t5_tokenizer,
    _vae,
)

RESOLUTION = 32


def build_tiny_kontext(folder: str | Path, guidance_embeds: bool = True, seed: int = 0) -> Path:
    """Save a tiny random FluxKontextPipeline (FLUX.1 Kontext [dev]: guidance-distilled) and return its folder."""
    folder = Path(folder)
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = _clip_tokenizer(folder / "_tok"), _t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=JOINT_DIM, pooled_projection_dim=CLIP_HIDDEN, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 4, 8),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1 Kontext's scheduler config (FLUX.1's)
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxKontextPipeline(scheduler=scheduler, vae=_vae(), text_encoder=CLIPTextModel(_clip_config(tokenizer)),
                               tokenizer=tokenizer, text_encoder_2=_t5_encoder(len(tokenizer_2)), tokenizer_2=tokenizer_2,
                               transformer=transformer)
    out = folder / "pipeline"
    pipe.save_pretrained(out, safe_serialization=True)
    (out / FLOW_SETTINGS_FILE).write_text(json.dumps({"resolution": RESOLUTION,
                                                      "max_sequence_length": T5_MAX_SEQUENCE_LENGTH}))
    return out

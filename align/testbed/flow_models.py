"""Configs of the flow-matching shapes testbed: the Stable Diffusion 3 architecture at 32 px.

The classes are SD3's own (diffusers' SD3Transformer2DModel / FlowMatchEulerDiscreteScheduler,
transformers' CLIPTextModelWithProjection twice, no T5), only small, so code written for SD3 /
SD3.5 runs unchanged on it. The VAE is the SD testbed's (32 px <-> 8 x 8 x 4 latents), frozen.

SD3's prompt encoding, which the tiny sizes follow: each CLIP's penultimate hidden states are
concatenated along the feature axis and zero-padded to ``joint_attention_dim``; the missing T5
contributes ``max_sequence_length`` rows of zeros (one constant token after the context
projection). The pooled embedding is both CLIPs' projected EOS features concatenated, hence
``pooled_projection_dim = projection_1 + projection_2``. The prompt sequence the transformer sees is
``tokenizer.model_max_length + max_sequence_length`` tokens, so both are kept short here and
``max_sequence_length`` must be passed to the pipeline as it was in training (``flow_testbed.json``).
"""

from __future__ import annotations

import torch

from align.testbed import models
from align.testbed.weights import FLOW_TESTBED_SETTINGS_FILE

# Short prompt sequences keep the joint attention cheap on a CPU (the longest caption is 16 tokens).
TOKENIZER_MAX_LENGTH = 20
MAX_SEQUENCE_LENGTH = 2  # T5 placeholder rows (zeros); SD3 pipelines default to 256

# name -> (transformer width = heads x head dim, heads, layers, patch size); "test" is for unit tests.
SIZES: dict[str, dict] = {
    "test": dict(num_attention_heads=2, attention_head_dim=8, num_layers=1, patch_size=2),
    "small": dict(num_attention_heads=4, attention_head_dim=32, num_layers=4, patch_size=2),
    "base": dict(num_attention_heads=6, attention_head_dim=32, num_layers=6, patch_size=1),
}
TEXT_HIDDEN = {"text_encoder": models.TEXT_HIDDEN_SIZE, "text_encoder_2": 32}
FLOW_SETTINGS_FILE = FLOW_TESTBED_SETTINGS_FILE  # sampling settings beside model_index.json


def text_encoder_config(name: str, vocab_size: int, bos_token_id: int, eos_token_id: int) -> dict:
    """CLIPTextModelWithProjection: the SD testbed's text encoder (1) and a narrower one (2)."""
    config = models.text_encoder_config(vocab_size, bos_token_id, eos_token_id)
    hidden = TEXT_HIDDEN[name]
    return {**config, "hidden_size": hidden, "intermediate_size": 4 * hidden, "projection_dim": hidden,
            "num_hidden_layers": 3 if name == "text_encoder" else 2}


def transformer_config(size: str = "small") -> dict:
    """SD3Transformer2DModel on 8 x 8 x 4 latents, conditioned by the two CLIPs."""
    if size not in SIZES:
        raise ValueError(f"unknown flow testbed size {size!r}; valid: {', '.join(SIZES)}")
    shape = SIZES[size]
    text_width = sum(TEXT_HIDDEN.values())
    return dict(
        sample_size=models.LATENT_SIZE,
        in_channels=models.LATENT_CHANNELS,
        out_channels=models.LATENT_CHANNELS,
        joint_attention_dim=text_width,
        caption_projection_dim=shape["num_attention_heads"] * shape["attention_head_dim"],
        pooled_projection_dim=text_width,
        pos_embed_max_size=models.LATENT_SIZE // shape["patch_size"],
        **shape,
    )


def scheduler_config() -> dict:
    """SD3's scheduler; shift 1 (SD3 uses 3 at 1024 px: a 32 px image needs less time at high noise)."""
    return dict(num_train_timesteps=1000, shift=1.0)


def build_text_encoders(tokenizer) -> tuple:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return tuple(
        CLIPTextModelWithProjection(CLIPTextConfig(**text_encoder_config(name, **ids)))
        for name in ("text_encoder", "text_encoder_2")
    )


def build_transformer(size: str = "small"):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(**transformer_config(size))


def build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**scheduler_config())


def prepare_vae(vae):
    """SD3 pipelines decode ``latents / scaling_factor + shift_factor``: the SD testbed's VAE has no shift."""
    if vae.config.get("shift_factor") is None:
        vae.register_to_config(shift_factor=0.0)
    return vae


def build_pipeline(tokenizer, vae, transformer=None, text_encoders=None, size: str = "small"):
    """A StableDiffusion3Pipeline from the flow testbed parts (random where a part is not given)."""
    from diffusers import StableDiffusion3Pipeline

    tokenizer.model_max_length = TOKENIZER_MAX_LENGTH
    text_encoder, text_encoder_2 = text_encoders if text_encoders is not None else build_text_encoders(tokenizer)
    return StableDiffusion3Pipeline(
        transformer=transformer if transformer is not None else build_transformer(size),
        scheduler=build_scheduler(),
        vae=prepare_vae(vae),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def load_pipeline(folder, dtype=None):
    """``StableDiffusion3Pipeline.from_pretrained`` of a flow testbed folder.

    As for SD3 loaded without T5, diffusers wants ``text_encoder_3=None, tokenizer_3=None`` passed
    explicitly (a null entry in model_index.json alone is refused).
    """
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(
        folder, text_encoder_3=None, tokenizer_3=None, dtype=dtype if dtype is not None else torch.float32
    )

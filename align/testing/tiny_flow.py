"""Tiny flow-matching pipelines (SD3 with and without T5, FLUX) built from configs, for tests.

The classes are the real ones (SD3Transformer2DModel / FluxTransformer2DModel, AutoencoderKL,
CLIPTextModel(WithProjection), T5EncoderModel, CLIPTokenizer, T5TokenizerFast,
FlowMatchEulerDiscreteScheduler) at random weights, saved with ``save_pretrained`` and meant to be
loaded back through ``align.pipeline.load_pipeline`` like real weights. Tokenizers are
character-level and written to disk here, so nothing is downloaded.

Sizes: 32 px images <-> 4 x 16 x 16 latents (the VAE downsamples by 2), 64 image tokens in both
transformers; 64 px works too. The VAE has a non-zero ``shift_factor`` (as SD3's and FLUX's do), so
code that forgets the shift is caught. A 4-step 32 px generation takes a few hundredths of a second.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from align.testbed.flow_models import FLOW_SETTINGS_FILE
from align.testing.tiny_sd import build_tiny_vae, write_char_tokenizer

CLIP_MAX_LENGTH = 16  # short CLIP sequences keep the joint attention cheap
T5_MAX_SEQUENCE_LENGTH = 8  # what tests pass as max_sequence_length (also written to flow_testbed.json)
CLIP_HIDDEN = 16
JOINT_DIM = 32  # T5 width = joint_attention_dim (SD3 zero-pads the two CLIPs' 16 + 16 features to it)
VAE_SHIFT, VAE_SCALE = 0.0609, 1.5035  # diffusers' own SD3/FLUX test VAE values


def _clip_tokenizer(folder: Path):
    write_char_tokenizer(folder)
    tokenizer = CLIPTokenizer.from_pretrained(folder)
    tokenizer.model_max_length = CLIP_MAX_LENGTH
    return tokenizer


def _t5_tokenizer():
    """A T5 tokenizer (Unigram over single characters, ``</s>`` appended, ``<pad>`` = 0), built offline."""
    chars = list(string.ascii_lowercase + string.digits + ".,'-")
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in chars] + [("\u2581" + c, -1.5) for c in chars]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                           extra_ids=0, model_max_length=512)


def _t5_encoder(vocab_size: int):
    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=JOINT_DIM, d_kv=8, d_ff=64, num_layers=1,
                                   num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0))


def _clip_config(tokenizer, hidden: int = CLIP_HIDDEN):
    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH, projection_dim=hidden,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )


def _vae(latent_channels: int = 4):
    return build_tiny_vae(32, latent_channels=latent_channels, use_quant_conv=False, use_post_quant_conv=False,
                          shift_factor=VAE_SHIFT, scaling_factor=VAE_SCALE)


def _save(pipe, folder: Path, settings: dict | None) -> Path:
    out = folder / "pipeline"
    pipe.save_pretrained(out, safe_serialization=True)
    if settings is not None:

        (out / FLOW_SETTINGS_FILE).write_text(json.dumps(settings))
    return out


def build_tiny_sd3(folder: str | Path, t5: bool = False, seed: int = 0, settings_file: bool = True,
                   shift: float = 3.0) -> Path:
    """Save a tiny random StableDiffusion3Pipeline under ``folder`` and return its folder (``folder/pipeline``).

    ``t5=False`` saves null ``text_encoder_3``/``tokenizer_3`` entries (SD3 without T5, as the flow
    testbed). ``settings_file`` writes ``flow_testbed.json`` with ``max_sequence_length`` =
    ``T5_MAX_SEQUENCE_LENGTH`` beside it (without it the SD3 default, 256, applies). ``shift`` is
    the scheduler's static shift (SD3/SD3.5 use 3.0).
    """
    folder = Path(folder)
    torch.manual_seed(seed)
    tokenizer = _clip_tokenizer(folder / "_tok")
    tokenizer_3 = _t5_tokenizer() if t5 else None
    transformer = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=JOINT_DIM, caption_projection_dim=16,
        pooled_projection_dim=2 * CLIP_HIDDEN, pos_embed_max_size=16,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
        vae=_vae(),
        text_encoder=CLIPTextModelWithProjection(_clip_config(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(_clip_config(tokenizer)),
        tokenizer_2=tokenizer,
        text_encoder_3=_t5_encoder(len(tokenizer_3)) if t5 else None,
        tokenizer_3=tokenizer_3,
    )
    return _save(pipe, folder, {"max_sequence_length": T5_MAX_SEQUENCE_LENGTH} if settings_file else None)


def build_tiny_flux(folder: str | Path, guidance_embeds: bool = True, seed: int = 0, settings_file: bool = True) -> Path:
    """Save a tiny random FluxPipeline under ``folder`` and return its folder (``folder/pipeline``).

    ``guidance_embeds=True`` is FLUX.1-dev's guidance-distilled transformer, False FLUX.1-schnell's.
    ``settings_file`` writes ``flow_testbed.json`` with ``max_sequence_length`` = ``T5_MAX_SEQUENCE_LENGTH``
    (without it FLUX's default, 512, applies). The scheduler shifts dynamically with the resolution, as FLUX's.
    """
    folder = Path(folder)
    torch.manual_seed(seed)
    tokenizer = _clip_tokenizer(folder / "_tok")
    tokenizer_2 = _t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=JOINT_DIM, pooled_projection_dim=CLIP_HIDDEN,
        guidance_embeds=guidance_embeds, axes_dims_rope=(4, 4, 8),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1's scheduler config
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=_vae(),
        text_encoder=CLIPTextModel(_clip_config(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=_t5_encoder(len(tokenizer_2)),
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    return _save(pipe, folder, {"max_sequence_length": T5_MAX_SEQUENCE_LENGTH} if settings_file else None)

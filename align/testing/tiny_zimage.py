"""A tiny Z-Image pipeline built from diffusers' scaled-down test config (tests/pipelines/z_image), for tests.

The classes are the real ones (ZImageTransformer2DModel, AutoencoderKL, Qwen3Model, Qwen2Tokenizer,
FlowMatchEulerDiscreteScheduler) at random weights, saved with ``save_pretrained`` and loaded back through
``align.pipeline.load_pipeline`` like real weights; the tokenizer is byte-level with Qwen3's chat-template form
(align/testing/tiny_flux2.py), written here.

Sizes: 32 px images <-> 16 x 8 x 8 latents (the VAE downsamples by 4), 16 packed image tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from align.testing.tiny_flux2 import QWEN3_CHAT_TEMPLATE
from align.testing.tiny_qwen import qwen_tokenizer, save_tiny

TEXT_HIDDEN = 16
MAX_SEQUENCE_LENGTH = 64  # stored beside the tiny pipeline: its rotary table holds 256 positions


def build_tiny_zimage(folder: str | Path, seed: int = 0) -> Path:
    """Save a tiny random ZImagePipeline under ``folder`` and return its folder (``folder/pipeline``)."""
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=TEXT_HIDDEN, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # diffusers' test: the pad tokens start as torch.empty; fix them so no NaN sneaks in
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 3,
                        up_block_types=["UpDecoderBlock2D"] * 3, block_out_channels=[32, 32, 32], layers_per_block=1,
                        latent_channels=16, norm_num_groups=32, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159)
    tokenizer = qwen_tokenizer(QWEN3_CHAT_TEMPLATE)
    text_encoder = Qwen3Model(Qwen3Config(
        hidden_size=TEXT_HIDDEN, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=1024, bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id))
    # Z-Image's scheduler_config.json: shift 3 (the pipeline gives μ from the image size)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer,
                          transformer=transformer)
    return save_tiny(pipe, folder, MAX_SEQUENCE_LENGTH)

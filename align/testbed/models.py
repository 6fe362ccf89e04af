"""Configs of the tiny testbed models: the Stable Diffusion architecture at 32 px, and shapes-clip.

The classes are the real ones (diffusers' AutoencoderKL / UNet2DConditionModel / DDIMScheduler,
transformers' CLIPTextModel / CLIPModel), only small, so everything written for SD v1.5 and
for a real CLIP runs unchanged on the testbed. Config builders return plain dicts (what lands
in each ``config.json``); ``build_*`` functions instantiate randomly initialised models.
"""

from __future__ import annotations

# 32 px images; the VAE halves the side twice, so latents are 8 x 8 x 4 (as SD: 512 px -> 64 x 64 x 4).
IMAGE_SIZE = 32
VAE_BLOCK_CHANNELS = (16, 32, 64)
LATENT_CHANNELS = 4
LATENT_SIZE = IMAGE_SIZE // 2 ** (len(VAE_BLOCK_CHANNELS) - 1)
TEXT_HIDDEN_SIZE = 64


def vae_config() -> dict:
    """AutoencoderKL: 32 x 32 x 3 images <-> 8 x 8 x 4 latents.

    ``scaling_factor`` is a placeholder here: the build script measures the latent standard
    deviation after training and stores 1/std, as SD does (0.18215 for SD v1.5).
    """
    return dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(VAE_BLOCK_CHANNELS),
        up_block_types=("UpDecoderBlock2D",) * len(VAE_BLOCK_CHANNELS),
        block_out_channels=VAE_BLOCK_CHANNELS,
        layers_per_block=1,
        act_fn="silu",
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
        scaling_factor=1.0,
    )


def unet_config(cross_attention_dim: int = TEXT_HIDDEN_SIZE) -> dict:
    """UNet2DConditionModel on 8 x 8 latents with cross-attention to the text encoder at every level."""
    return dict(
        sample_size=LATENT_SIZE,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        # Small on purpose: the build must train on 2 shared CPU cores, and the model should stay imperfect.
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=cross_attention_dim,
        # diffusers' legacy name: this is the number of heads (8 and 16 channels per head).
        attention_head_dim=4,
        norm_num_groups=16,
    )


def text_encoder_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> dict:
    """CLIPTextModel for the grammar's few dozen words (one token per word)."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN_SIZE,
        intermediate_size=4 * TEXT_HIDDEN_SIZE,
        projection_dim=TEXT_HIDDEN_SIZE,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        pad_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def scheduler_config() -> dict:
    """DDIM with SD v1.5's noise schedule (scaled-linear betas 0.00085 -> 0.012 over 1000 steps)."""
    return dict(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type="epsilon",
        timestep_spacing="leading",
    )


def shapes_clip_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> dict:
    """CLIPConfig for shapes-clip: a ViT on 32 px images (4 px patches, 64 of them) + a text transformer."""
    text = text_encoder_config(vocab_size, bos_token_id, eos_token_id)
    vision = dict(
        image_size=IMAGE_SIZE,
        patch_size=4,
        num_channels=3,
        hidden_size=96,
        intermediate_size=384,
        projection_dim=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        hidden_act="quick_gelu",
    )
    return dict(text_config=text, vision_config=vision, projection_dim=64)


def _tokenizer_ids(tokenizer) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(**vae_config())


def build_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**unet_config())


def build_text_encoder(tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(**text_encoder_config(**_tokenizer_ids(tokenizer))))


def build_scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(**scheduler_config())


def build_shapes_clip(tokenizer):
    from transformers import CLIPConfig, CLIPModel

    return CLIPModel(CLIPConfig(**shapes_clip_config(**_tokenizer_ids(tokenizer))))


def shapes_clip_image_processor():
    """CLIP's normalisation at the testbed's 32 px (a real CLIP would resize to 224 first).

    Resizing to 32 keeps 64 px testbed images usable; 32 px images pass through unchanged.
    """
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": IMAGE_SIZE},
        do_center_crop=True,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
    )


def build_pipeline(tokenizer, vae=None, unet=None, text_encoder=None):
    """A StableDiffusionPipeline from the testbed parts (random where a part is not given)."""
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline(
        vae=vae if vae is not None else build_vae(),
        text_encoder=text_encoder if text_encoder is not None else build_text_encoder(tokenizer),
        tokenizer=tokenizer,
        unet=unet if unet is not None else build_unet(),
        scheduler=build_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )

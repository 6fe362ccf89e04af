"""Qwen-Image 2.1: a Qwen3-VL text encoder (the last decoder layer's hidden states before its final norm, the system
prompt dropped, one length per prompt), a single-stream block-causal transformer on unpatched latents of a 16x VAE
(one frame, 64 channels), rectified flow with a resolution-dependent shift, and plain "true" classifier-free guidance.

Matches diffusers' QwenImage21Pipeline for text-to-image: ``encode_prompt`` itself, the flattened latent tokens and
the transformer's ``img_mask`` (the prompt's slots, then one slot per 2 x 2 target tokens), ``timestep / 1000``, the
σ schedule (the pipeline's ``sample_sigmas`` when it has them for the asked number of steps, else
linspace(1, 1/N, N), shifted with μ of the image's token count), the VAE's per-channel mean and std, and guidance
without Qwen-Image's norm rescale. LoRA goes on the blocks' ``to_q/to_k/to_v/to_out.0`` (as Qwen-Image; the pipeline
loads it with ``QwenImageLoraLoaderMixin``). Deliberate differences:

- the family's prediction never uses the transformer's KV cache (training needs every call to be a full forward);
  the pipeline caches the condition tokens' keys and values by default when ``causal_condition``: the same function
  (the prompt's tokens are modulated at t = 0 and attend causally), equal up to float rounding.
- latents are the VAE posterior's mean, as every family here encodes (the pipeline encodes condition images with it).
- the unconditional side is the prompt " " (as the Qwen-Image family; the pipeline guides only when given a negative
  prompt and by default samples unguided, ``true_cfg_scale`` 1), and ``true_cfg_scale`` is the trainers'
  ``--guidance_scale``.
- images are RGB: the VAE reads and writes RGBA, so ``encode_images`` appends an opaque alpha (as the pipeline's
  RGBA conversion of an RGB condition image) and ``decode_latents`` drops the decoded alpha (the pipeline returns RGBA
  images).
- none in code, but worth knowing: prompts of different lengths in one batch are zero-padded to the longest, as the
  pipeline pads them, and the transformer places the image after the batch's longest prompt (its RoPE frame index),
  so a padded row predicts as in the pipeline's padded batch, not as that prompt alone (about 5e-3 on the tiny model).
- on the meta device (``--dry_run``'s memory planner runs the prediction there) the image-slot mask is a CPU tensor:
  the transformer reads its values (``repeat_interleave``, ``tolist``) to lay out the sequence, and its blocks get the
  CPU token masks it derives moved to the meta device (``cpu_masks_to_meta``). The same transformer code runs, so the
  planner counts what it keeps.
- text-to-image only: condition images (the pipeline's ``image``) are not used.
- with ``sample_sigmas`` of another length than the asked number of steps, the family samples linspace(1, 1/N, N) for
  N steps, where the pipeline would ignore ``num_inference_steps`` and sample its own σ.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from align.families import flow_common
from align.families.base import Conditioning
from align.families.qwenimage import QwenImage

VAE_SCALE_FACTOR = 16  # QwenImage21Pipeline's fixed vae_scale_factor: one latent token per 16 x 16 px
IMAGE_TOKENS_PER_SLOT = 4  # each of the transformer's image slots stands for 2 x 2 latent tokens
DEFAULT_RESOLUTION = 1024  # QwenImage21Pipeline's output_resolution


def image_only_processor(model: str):
    """The pipeline's Qwen3VLProcessor without its video processor (which transformers builds only with torchvision),
    as the Qwen-Image-Edit family loads its Qwen2VLProcessor."""
    from transformers import Qwen3VLProcessor

    attributes = [name for name in Qwen3VLProcessor.get_attributes() if name != "video_processor"]

    class ImageOnly(Qwen3VLProcessor):
        @classmethod
        def get_attributes(cls):
            return list(attributes)

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnly.__name__ = ImageOnly.__qualname__ = "Qwen3VLProcessor"  # the pipeline's config names transformers' class
    ImageOnly.__module__ = Qwen3VLProcessor.__module__
    path = Path(model).expanduser()
    if path.is_dir():
        return ImageOnly.from_pretrained(str(path / "processor"))
    return ImageOnly.from_pretrained(model, subfolder="processor")


@contextmanager
def cpu_masks_to_meta(denoiser):
    """While a meta-device forward runs: the blocks and the final norm get the transformer's CPU token masks (derived
    from a CPU image-slot mask, whose values it reads) on the meta device, where their other inputs are."""

    def to_meta(module, args, kwargs):
        def move(value):
            return value.to("meta") if isinstance(value, torch.Tensor) and not value.is_meta else value
        return tuple(move(arg) for arg in args), {key: move(value) for key, value in kwargs.items()}

    modules = [*denoiser.transformer_blocks, denoiser.norm_out]
    handles = [module.register_forward_pre_hook(to_meta, with_kwargs=True) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def pack_tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H*W, C]: QwenImage21Pipeline._pack_latents (2.1 consumes latents unpatched)."""
    return latents.flatten(2).transpose(1, 2)


def unpack_tokens(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], height, width)


class QwenImage21(QwenImage):
    name = "qwenimage21"
    title = "Qwen-Image 2.1"
    pipeline_class_names = ("QwenImage21Pipeline",)
    shard_blocks = ("QwenImage21TransformerBlock",)

    def pipeline_class(self):
        from diffusers import QwenImage21Pipeline

        return QwenImage21Pipeline

    # --- loading ------------------------------------------------------------------------------
    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        pipe = self.pretrained_with_processor(model, dtype, quantization, image_only_processor)
        return flow_common.finish_loading(pipe, model, device, self.default_max_sequence_length)

    def generation_kwargs(self, pipe) -> dict:
        return {}  # QwenImage21Pipeline takes no max_sequence_length

    # --- conditioning and latents -------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """``pipe.encode_prompt``: the prompts' hidden states, zero-padded to the batch's longest, and the mask of their
        real tokens (the pipeline drops an all-ones mask; kept here so that batches concatenate). Text only: its
        image-slot mask is all False and rebuilt at each call."""
        embeds, mask, _ = pipe.encode_prompt(list(prompts), device=pipe.text_encoder.device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    @torch.no_grad()
    def encode_images(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        """RGB in [-1, 1] made opaque RGBA (the VAE reads four channels; the pipeline converts its condition images to
        RGBA), then (posterior mean - latents_mean) / latents_std of the one-frame video, as ``_encode_vae_image``."""
        if pixels.shape[1] == 3 and pipe.vae.config.in_channels == 4:
            pixels = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        return super().encode_images(pipe, pixels)

    def decode_latents(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        """The pipeline's decoded image in [0, 1] without its alpha channel (the VAE decodes RGBA); differentiable, as
        Qwen-Image's (reward backpropagation decodes with gradients)."""
        return super().decode_latents(pipe, latents)[:, :3]

    def native_resolution_of(self, denoiser_config, vae_config) -> int:
        return DEFAULT_RESOLUTION

    def latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        # as QwenImage21Pipeline.prepare_latents: an even number of 16 px latents a side
        side = 2 * (int(resolution) // (VAE_SCALE_FACTOR * 2))
        return (denoiser_config["in_channels"], side, side)

    def conditioning_shapes(self, denoiser_config, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        return {"prompt_embeds": (batch, text_tokens, denoiser_config["context_in_dim"])}

    # --- the denoiser -------------------------------------------------------------------------
    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        """The velocity [B, C, H, W]: the latents flattened to tokens after the prompt's, ``timesteps / 1000``, the
        image slots marked as the pipeline marks them, the target tokens of the output unflattened (no KV cache)."""
        batch, _, height, width = latents.shape
        tokens = pack_tokens(latents)
        embeds = cond["prompt_embeds"]
        mask = cond.get("prompt_embeds_mask")
        if mask is not None and bool(mask.all()):
            mask = None
        on_meta = tokens.is_meta  # the memory planner's forward (module docstring)
        mask_device = torch.device("cpu") if on_meta else embeds.device
        img_mask = torch.cat([torch.zeros(embeds.shape[:2], dtype=torch.bool, device=mask_device),
                              torch.ones(batch, tokens.shape[1] // IMAGE_TOKENS_PER_SLOT, dtype=torch.bool,
                                         device=mask_device)], dim=1)
        with cpu_masks_to_meta(denoiser) if on_meta else nullcontext():
            out = denoiser(hidden_states=tokens, timestep=timesteps.to(tokens.dtype) / 1000,
                           encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                           img_shapes=[[(1, height, width)]] * batch, img_mask=img_mask, return_dict=False)[0]
        return unpack_tokens(out[:, -tokens.shape[1]:], height, width)

    def guided_prediction(self, denoiser, latents, timesteps, cond, uncond, guidance_scale: float) -> torch.Tensor:
        """As QwenImage21Pipeline with ``true_cfg_scale``: two calls (conditional, then unconditional), combined as
        uncond + s (cond - uncond) without a norm rescale; no guidance at a scale of 1 or below."""
        cond_out = self.predict(denoiser, latents, timesteps, cond).float()
        if guidance_scale <= 1.0:
            return cond_out
        uncond_out = self.predict(denoiser, latents, timesteps, uncond).float()
        return uncond_out + guidance_scale * (cond_out - uncond_out)

    def pipeline_latents(self, pipe, noise: torch.Tensor) -> torch.Tensor:
        return pack_tokens(noise)  # the pipeline draws [B, 1, C, H, W] and flattens it: the same values in this order

    def base_sigmas(self, pipe, num_inference_steps: int):
        """The pipeline's ``sample_sigmas`` where they are that many steps, else linspace(1, 1/N, N)."""
        stored = pipe.config.get("sample_sigmas") if hasattr(pipe, "config") else None
        if stored is not None and len(stored) == num_inference_steps:
            return np.asarray(stored, dtype=np.float64)
        return np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)

    def flow_sigmas(self, pipe, num_inference_steps: int, resolution: int) -> torch.Tensor:
        """As QwenImage21Pipeline: the base σ given to the scheduler with μ = calculate_shift(image tokens)."""
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

        config = pipe.scheduler.config
        side = self.latent_shape(pipe, resolution)[1]
        mu = calculate_shift(side * side, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        return flow_common.set_timesteps_copy(pipe.scheduler, num_inference_steps,
                                              sigmas=self.base_sigmas(pipe, num_inference_steps), mu=mu)

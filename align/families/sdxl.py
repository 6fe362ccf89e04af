"""Stable Diffusion XL: two CLIP text encoders, pooled text and size/crop micro-conditioning, a UNet,
DDPM training (epsilon or v-prediction) as SD 1.x/2.x.

Conditioning keys: ``prompt_embeds`` [B, 77, D1 + D2] (both encoders' penultimate hidden states side by
side), ``pooled_embeds`` [B, P] (text_encoder_2's projected output) and ``time_ids`` [B, 6] =
(original h, w, crop top, left, target h, w) = (res, res, 0, 0, res, res), what
``StableDiffusionXLPipeline`` builds by default for a res x res image and what the Diffusion-DPO authors'
SDXL training uses (train.py, ``add_time_ids`` for SDXL-base).

Differences from the authors' Diffusion-DPO SDXL code, on purpose:
- images are encoded to the VAE posterior mean (the SD family's convention), not a posterior sample;
- time_ids are in the text encoders' dtype, as the pipeline builds them (the authors use the training weight
  dtype, to which they cast the encoders too: the same values);
- their special cases by checkpoint name (refiner: 5 time ids with an aesthetic score and t < 200; turbo:
  four fixed timesteps) are not reproduced: the refiner is another pipeline class, not handled here.

The empty prompt ``""`` is encoded as text by ``encode_prompts`` (as the authors' training encodes dropped
captions); the unconditional side of classifier-free guidance is ``unconditional``: zeros when the
pipeline's ``force_zeros_for_empty_prompt`` is set (SDXL base), as the pipeline does without a negative
prompt. The invisible watermark stays diffusers' default: ``pipe(...)`` applies it when the
invisible-watermark package is installed, ``decode_latents`` never does.
"""

from __future__ import annotations

import contextlib

import torch

from align.families.base import (
    Conditioning,
    expand_conditioning,
    pretrained_pipeline,
)
from align.families.sd import StableDiffusion


def size_time_ids(resolution: int, batch: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """SDXL's micro-conditioning for a square image generated whole: original size = target size =
    ``resolution``, crop top-left (0, 0). [batch, 6]."""
    row = [resolution, resolution, 0, 0, resolution, resolution]
    return torch.tensor([row], dtype=dtype, device=device).repeat(batch, 1)


@contextlib.contextmanager
def vae_in_float32_if_needed(vae):
    """SDXL's VAE overflows in fp16 (its config says ``force_upcast``): run it in float32 meanwhile and put
    it back after, as the pipeline does around its decode."""
    upcast = vae.dtype == torch.float16 and bool(getattr(vae.config, "force_upcast", False))
    if not upcast:
        yield vae
        return
    # torch's Module.to, not diffusers' ModelMixin.to, which warns on every dtype cast (and this runs per batch)
    torch.nn.Module.to(vae, torch.float32)
    try:
        yield vae
    finally:
        torch.nn.Module.to(vae, torch.float16)


def _latent_stats(vae, like: torch.Tensor):
    """(mean, std) per latent channel where the VAE config has them (the pipeline's normalisation), else None."""
    mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
    if mean is None or std is None:
        return None
    shape = (1, len(mean), 1, 1)
    return (torch.tensor(mean).view(shape).to(like.device, like.dtype), torch.tensor(std).view(shape).to(like.device, like.dtype))


class StableDiffusionXL(StableDiffusion):
    name = "sdxl"
    title = "Stable Diffusion XL"
    pipeline_class_names = ("StableDiffusionXLPipeline",)
    denoiser_name = "unet"
    is_flow = False
    # train_dreambooth_lora_sdxl.py's UNet targets: the attention projections, as SD 1.x.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")

    def pipeline_class(self):
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        from diffusers import DDIMScheduler

        pipe = pretrained_pipeline(self.pipeline_class(), model, dtype, self.title, quantization)
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(device)

    def frozen_modules(self, pipe) -> list[torch.nn.Module]:
        return [pipe.vae, pipe.text_encoder, pipe.text_encoder_2]

    def conditioning_shapes(self, denoiser_config, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        # the added text embedding's input is the pooled embedding and 6 size ids, each time-embedded
        pooled = denoiser_config["projection_class_embeddings_input_dim"] - 6 * denoiser_config["addition_time_embed_dim"]
        return {"prompt_embeds": (batch, text_tokens, denoiser_config["cross_attention_dim"]),
                "pooled_embeds": (batch, pooled), "time_ids": (batch, 6)}

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """What ``pipe.encode_prompt`` gives for the positive prompts, plus the size ``time_ids`` at
        ``resolution`` (default: the pipeline's default side). ``""`` is encoded as text; the guidance
        side is ``unconditional``."""
        hidden, pooled = [], None
        for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
            tokens = tokenizer(
                list(prompts), padding="max_length", max_length=tokenizer.model_max_length,
                truncation=True, return_tensors="pt",
            ).input_ids.to(encoder.device)
            out = encoder(tokens, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])  # SDXL conditions on the penultimate layer of both encoders
            if out[0].ndim == 2:  # the projected text embedding of CLIPTextModelWithProjection
                pooled = out[0]
        prompt_embeds = torch.cat(hidden, dim=-1).to(pipe.text_encoder_2.dtype)
        side = resolution or self.native_resolution(pipe)
        return {
            "prompt_embeds": prompt_embeds,
            "pooled_embeds": pooled.to(prompt_embeds.dtype),
            "time_ids": size_time_ids(side, len(prompts), prompt_embeds.dtype, prompt_embeds.device),
        }

    def unconditional(self, pipe, batch: int, resolution: int | None = None) -> Conditioning:
        """The pipeline's unconditional side without a negative prompt: zero text and pooled embeddings when
        ``force_zeros_for_empty_prompt`` (SDXL base's setting), else the encoded ``""``; same time_ids."""
        cond = self.encode_prompts(pipe, [""], resolution)
        if pipe.config.force_zeros_for_empty_prompt:
            cond = {**cond, "prompt_embeds": torch.zeros_like(cond["prompt_embeds"]),
                    "pooled_embeds": torch.zeros_like(cond["pooled_embeds"])}
        return expand_conditioning(cond, batch)

    @torch.no_grad()
    def encode_images(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        dtype = pipe.vae.dtype
        with vae_in_float32_if_needed(pipe.vae) as vae:
            latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
            stats = _latent_stats(vae, latents)
            if stats is not None:
                latents = (latents - stats[0]) * vae.config.scaling_factor / stats[1]
            else:
                latents = latents * vae.config.scaling_factor
        return latents.to(dtype)

    def decode_latents(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        # differentiable (reward backpropagation decodes with gradients); sampling callers run under no_grad
        with vae_in_float32_if_needed(pipe.vae) as vae:
            latents = latents.to(vae.device, vae.dtype)
            stats = _latent_stats(vae, latents)
            if stats is not None:
                latents = latents * stats[1] / vae.config.scaling_factor + stats[0]
            else:
                latents = latents / vae.config.scaling_factor
            images = vae.decode(latents).sample
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        return denoiser(
            latents, timesteps, encoder_hidden_states=cond["prompt_embeds"],
            added_cond_kwargs={"text_embeds": cond["pooled_embeds"], "time_ids": cond["time_ids"]},
        ).sample

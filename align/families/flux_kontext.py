"""FLUX.1 Kontext: instruction editing with FLUX.1's transformer. A prompt is an instruction and a source image
(``rewards.edit_prompts``); the source's latents are packed into 2x2 tokens appended after the generated image's, with
position ids whose first coordinate is 1, and the prediction is read off the generated image's tokens.

Matches diffusers' FluxKontextPipeline (the instruction's CLIP + T5 encoding, the source encoded by the VAE's
posterior mode with FLUX's shift and scale, its tokens and ids after the latents', the guidance embedding, the σ
schedule of the generated image's token count) and examples/dreambooth/train_dreambooth_lora_flux_kontext.py
(uniform timesteps, velocity target ε - x0 on the generated tokens only, guidance 3.5 in training). Deliberate
differences:

- the source image is resized to the run's square resolution (the pipeline picks one of Kontext's preferred
  resolutions unless ``_auto_resize=False``, which ``call_arguments`` passes with the resized source and
  ``max_area`` = the resolution's area, so that the pipeline generates what the family samples).
- LoRA targets: FLUX.1's (the attention of both streams and the feed-forward layers); the script also adapts the
  single blocks' ``proj_mlp``.
- the unconditional side keeps the source image (the empty instruction on it), as the pipeline's negative prompt
  does; FLUX.1 Kontext [dev] is guidance-distilled and does not use it. A transformer without the guidance embedding
  (the editing testbed's) guides with both halves in one call; the pipeline, given ``negative_prompt`` and
  ``true_cfg_scale`` by ``call_arguments``, calls twice (the same to float rounding).
"""

from __future__ import annotations

import torch

from align.families import flow_common
from align.families.base import Conditioning, pretrained_pipeline
from align.families.edit_common import SOURCE_KEY, source_images, split_edit_prompts, with_source
from align.families.flux import Flux, latent_image_ids, pack_latents


class FluxKontext(Flux):
    name = "flux-kontext"
    title = "FLUX.1 Kontext"
    pipeline_class_names = ("FluxKontextPipeline",)
    edits = True

    def pipeline_class(self):
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline

    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        flow_common.loadable_model_index(model)
        pipe = pretrained_pipeline(self.pipeline_class(), model, dtype, self.title, quantization)
        return flow_common.finish_loading(pipe, model, device, self.default_max_sequence_length)

    # --- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """The instructions' CLIP + T5 encoding and the source images' latents (``source_latents``); plain prompts
        (the unconditional side's "") have no source."""
        instructions, sources = split_edit_prompts(prompts, self.title)
        cond = super().encode_prompts(pipe, instructions, resolution)
        if sources is not None:
            side = resolution or self.native_resolution(pipe)
            # the pipeline's own image processor: the same pixels, to the last bit, as its call sees
            pixels = pipe.image_processor.preprocess(source_images(sources, side), side, side)
            cond[SOURCE_KEY] = self.encode_images(pipe, pixels)
        return cond

    @torch.no_grad()
    def encode_images(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        """The posterior's mode (= its mean), shifted and scaled, as FluxKontextPipeline._encode_vae_image."""
        vae = pipe.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def reference_tokens(self, cond: Conditioning, dtype):
        source = cond.get(SOURCE_KEY)
        if source is None:
            return None
        ids = latent_image_ids(source.shape[2], source.shape[3], source.device, dtype)
        ids[:, 0] = 1  # FluxKontextPipeline: the source image's ids are the latents' with the first coordinate 1
        return pack_latents(source.to(dtype)), ids

    # --- guidance and the pipeline's call ---------------------------------------------------------
    def guided_prediction(self, denoiser, latents, timesteps, cond, uncond, guidance_scale: float) -> torch.Tensor:
        return super().guided_prediction(denoiser, latents, timesteps, cond, with_source(uncond, cond), guidance_scale)

    def call_arguments(self, pipe, prompts: list[str], guidance_scale: float, resolution: int | None = None) -> dict:
        """The instructions, the sources resized to the generated size, and that size's area as ``max_area``."""
        instructions, sources = split_edit_prompts(prompts, self.title)
        if sources is None:
            raise ValueError(f"{self.title} edits: give prompts '[source: <image>] <instruction>'")
        side = resolution or self.native_resolution(pipe)
        arguments = {"prompt": instructions, "image": source_images(sources, side), "max_area": side * side,
                     "_auto_resize": False, **self.generation_kwargs(pipe)}
        if guidance_scale is None:  # the pipeline's own default
            return arguments
        arguments["guidance_scale"] = guidance_scale
        if not self.uses_guidance_embedding(pipe.transformer) and guidance_scale > 1.0:
            # no guidance embedding: the pipeline's true CFG against the empty instruction on the same source
            arguments.update(negative_prompt=[""] * len(prompts), true_cfg_scale=guidance_scale)
        return arguments

"""Z-Image: a Qwen3 text encoder (penultimate hidden states of the prompt's real tokens: one length per prompt), a
single-stream DiT taking lists of latents and captions, rectified flow with a resolution-dependent shift. The
transformer predicts x0 - ε and reads t = 1 - σ; its pipeline guides as pos + s (pos - neg).

Matches diffusers' ZImagePipeline (encoding, the transformer's list inputs, ``(1000 - t) / 1000``, the negated output,
guidance at its own scale convention, the σ schedule, VAE shift and scale) and
examples/dreambooth/train_dreambooth_lora_z_image.py (uniform timesteps, velocity target ε - x0 of the negated
prediction, LoRA on ``to_q/to_k/to_v/to_out.0``). Deliberate differences:

- conditioning is a dict of batch-first tensors: the captions zero-padded to the batch's longest with a mask of their
  real tokens; ``predict`` hands the transformer the same list of unpadded captions the pipeline does.
- ``--guidance_scale`` w is classifier-free guidance's usual scale, uncond + w (cond - uncond), as for every family
  here (1 = unguided); ZImagePipeline's own scale is s = w - 1 (pos + s (pos - neg) is the same prediction), which
  ``call_arguments`` passes it. Z-Image-Turbo, step-distilled, samples unguided (its pipeline's s = 0: w = 1).
- the pipeline's optional ``cfg_normalization`` and ``cfg_truncation`` are left at their defaults (off); ``guided_prediction``
  does not implement them.
- the planner counts prompts of ``PLANNED_PROMPT_TOKENS`` tokens.
"""

from __future__ import annotations

import torch

from align.families import flow_common
from align.families.base import (
    Conditioning,
    cat_conditioning,
    pretrained_pipeline,
    vae_scale_factor,
)
from align.families.qwenimage import PLANNED_PROMPT_TOKENS, resolution_shifted_sigmas

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline's
DEFAULT_RESOLUTION = 1024  # ZImagePipeline.__call__: height = height or 1024


def padded_with_mask(embeddings: list[torch.Tensor]) -> Conditioning:
    """A list of [L_i, D] captions as [B, max L, D] zero-padded, and the [B, max L] mask of the real tokens."""
    longest = max(e.shape[0] for e in embeddings)
    embeds = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[0])) for e in embeddings])
    mask = torch.stack([torch.arange(longest, device=e.device) < e.shape[0] for e in embeddings]).long()
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


def unpadded(cond: Conditioning) -> list[torch.Tensor]:
    """The captions' real tokens, one tensor per row (as ZImagePipeline hands them to the transformer); without a mask
    every token is real."""
    if "prompt_embeds_mask" not in cond:
        return list(cond["prompt_embeds"])
    return [embeds[mask.bool()] for embeds, mask in zip(cond["prompt_embeds"], cond["prompt_embeds_mask"])]


class ZImage(flow_common.FlowMatchingFamily):
    name = "zimage"
    title = "Z-Image"
    pipeline_class_names = ("ZImagePipeline",)
    default_max_sequence_length = DEFAULT_MAX_SEQUENCE_LENGTH
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # train_dreambooth_lora_z_image.py's default
    weighting_scheme = "none"
    shard_blocks = ("ZImageTransformerBlock",)

    def pipeline_class(self):
        from diffusers import ZImagePipeline

        return ZImagePipeline

    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        flow_common.loadable_model_index(model)
        pipe = pretrained_pipeline(self.pipeline_class(), model, dtype, self.title, quantization)
        return flow_common.finish_loading(pipe, model, device, self.default_max_sequence_length)

    def frozen_modules(self, pipe) -> list[torch.nn.Module]:
        return [pipe.vae, pipe.text_encoder]

    # --- conditioning and latents -------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """``pipe.encode_prompt`` without guidance: each prompt's real tokens, padded here with their mask."""
        embeddings, _ = pipe.encode_prompt(list(prompts), device=pipe.text_encoder.device, do_classifier_free_guidance=False,
                                           max_sequence_length=self.max_sequence_length(pipe))
        return padded_with_mask(embeddings)

    def native_resolution_of(self, denoiser_config, vae_config) -> int:
        return DEFAULT_RESOLUTION

    def latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        side = 2 * (int(resolution) // (vae_scale_factor(vae_config) * 2))  # ZImagePipeline.prepare_latents
        return (denoiser_config["in_channels"], side, side)

    def text_tokens(self, model: str | None = None) -> int:
        stored = flow_common.trained_max_sequence_length(model) if model else None
        return stored or PLANNED_PROMPT_TOKENS

    def conditioning_shapes(self, denoiser_config, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        # no mask: a conditioning without one is all real tokens (what the planner counts)
        return {"prompt_embeds": (batch, text_tokens, denoiser_config["cap_feat_dim"])}

    # --- the denoiser and its training target -------------------------------------------------
    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        """The velocity ε - x0 [B, C, H, W]: the transformer's negated output for t = (1000 - timestep) / 1000."""
        images = list(latents.unsqueeze(2).unbind(0))  # [C, 1, H, W] each
        out = denoiser(images, (1000 - timesteps.to(latents.dtype)) / 1000, unpadded(cond), return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def guided_prediction(self, denoiser, latents, timesteps, cond, uncond, guidance_scale: float) -> torch.Tensor:
        """As ZImagePipeline at its scale s = w - 1: guided when s is above 0, the prompts then the negatives in one call,
        combined as pos + s (pos - neg) in float32."""
        scale = guidance_scale - 1.0
        if scale <= 0:
            return self.predict(denoiser, latents, timesteps, cond).float()
        out = self.predict(denoiser, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                           cat_conditioning([cond, uncond])).float()
        pos, neg = out.chunk(2)
        return pos + scale * (pos - neg)

    def call_arguments(self, pipe, prompts: list[str], guidance_scale: float, resolution: int | None = None) -> dict:
        return {"prompt": list(prompts), "guidance_scale": guidance_scale - 1.0, **self.generation_kwargs(pipe)}

    def flow_sigmas(self, pipe, num_inference_steps: int, resolution: int) -> torch.Tensor:
        """As ZImagePipeline: linspace(1, 1/N, N) shifted with μ = calculate_shift(packed image tokens)."""
        return resolution_shifted_sigmas(pipe, num_inference_steps, (self.latent_shape(pipe, resolution)[1] // 2) ** 2)

"""Qwen-Image: a Qwen2.5-VL text encoder (last hidden states, the prompt template dropped, one length per prompt),
a dual-stream MMDiT on 2x2-packed latents of a causal video VAE (one frame), rectified flow with a
resolution-dependent shift, and "true" classifier-free guidance that rescales each token to the conditional norm.

Matches diffusers' QwenImagePipeline (encoding, packing, ``timestep / 1000``, the σ schedule, the VAE's per-channel
mean and std, the guidance with its norm rescale) and examples/dreambooth/train_dreambooth_lora_qwen_image.py
(uniform timesteps, velocity target ε - x0, LoRA on ``to_q/to_k/to_v/to_out.0``, the prompt batch zero-padded to its
longest with a mask). Deliberate differences:

- latents are the VAE posterior's mean (the script samples the posterior), as every family here encodes.
- the unconditional side is the prompt " " (Qwen-Image's model card; the pipeline guides only when given a negative
  prompt, and its ``true_cfg_scale`` is the trainers' ``--guidance_scale``).
- the planner counts prompts of ``PLANNED_PROMPT_TOKENS`` tokens (each prompt has its own length, up to 1024).
"""

from __future__ import annotations

import numpy as np
import torch

from align.families import flow_common
from align.families.base import (
    Conditioning,
    ModelLoadError,
    expand_conditioning,
    one_line,
    pretrained_pipeline,
)
from align.families.flux import pack_latents, unpack_latents

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default (encode_prompt's own is 1024)
NEGATIVE_PROMPT = " "  # Qwen-Image's model card: the negative prompt when there is nothing to remove
PLANNED_PROMPT_TOKENS = 256  # the memory planner's prompt length (a long prompt; the pipeline allows up to 1024)


def qwen_vae_scale_factor(vae_config) -> int:
    """2 ** (number of temporal-downsample flags), as QwenImagePipeline computes its ``vae_scale_factor``."""
    return 2 ** len(vae_config["temperal_downsample"])


def rescaled_guidance(cond_tokens: torch.Tensor, uncond_tokens: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's true CFG on packed tokens [B, L, D]: uncond + s (cond - uncond), each token rescaled to the
    conditional prediction's norm."""
    combined = uncond_tokens + scale * (cond_tokens - uncond_tokens)
    return combined * (cond_tokens.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImage(flow_common.FlowMatchingFamily):
    name = "qwenimage"
    title = "Qwen-Image"
    pipeline_class_names = ("QwenImagePipeline",)
    default_max_sequence_length = DEFAULT_MAX_SEQUENCE_LENGTH
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")  # train_dreambooth_lora_qwen_image.py's default
    weighting_scheme = "none"  # the script's default: uniform timesteps, loss weight 1
    default_sample_size = 128  # QwenImagePipeline's: 128 x 8 = 1024 px
    shard_blocks = ("QwenImageTransformerBlock",)
    negative_prompt = NEGATIVE_PROMPT

    def pipeline_class(self):
        from diffusers import QwenImagePipeline

        return QwenImagePipeline

    # --- loading and saving -------------------------------------------------------------------
    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        flow_common.loadable_model_index(model)
        pipe = pretrained_pipeline(self.pipeline_class(), model, dtype, self.title, quantization)
        if pipe.transformer.config.guidance_embeds:
            raise ModelLoadError(f"{model!r}: a guidance-distilled {self.title} transformer (guidance_embeds) is not "
                                 "supported; Qwen-Image's own transformer guides with two calls")
        return flow_common.finish_loading(pipe, model, device, self.default_max_sequence_length)

    def pretrained_with_processor(self, model: str, dtype: torch.dtype, quantization, load_processor):
        """The pipeline from ``model`` with its VLM processor from ``load_processor(model)`` where torchvision is
        missing (transformers builds the processors' video part only with it; Qwen-Image-Edit and Qwen-Image 2.1)."""
        from transformers.utils import is_torchvision_available

        flow_common.loadable_model_index(model)
        components = {}
        if not is_torchvision_available():
            try:
                components["processor"] = load_processor(model)
            except (OSError, ValueError, TypeError) as err:
                raise ModelLoadError(f"cannot load a {self.title} pipeline's processor from {model!r}: "
                                     f"{one_line(err)}") from err
        return pretrained_pipeline(self.pipeline_class(), model, dtype, self.title, quantization, **components)

    def frozen_modules(self, pipe) -> list[torch.nn.Module]:
        return [pipe.vae, pipe.text_encoder]

    # --- conditioning and latents -------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """``pipe.encode_prompt``: the prompts' hidden states, zero-padded to the batch's longest, and the mask of
        their real tokens (the pipeline drops an all-ones mask; kept here so that batches concatenate)."""
        embeds, mask = pipe.encode_prompt(list(prompts), device=pipe.text_encoder.device,
                                          max_sequence_length=self.max_sequence_length(pipe))
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def unconditional(self, pipe, batch: int, resolution: int | None = None) -> Conditioning:
        return expand_conditioning(self.encode_prompts(pipe, [self.negative_prompt], resolution), batch)

    def latent_stats(self, vae, like: torch.Tensor):
        """The VAE's per-channel latent mean and std, shaped to broadcast over [B, C, H, W]."""
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1).to(like.device, like.dtype)
        return mean, std

    @torch.no_grad()
    def encode_images(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        """(posterior mean - latents_mean) / latents_std of the one-frame video, as the pipelines scale latents."""
        vae = pipe.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)[:, :, None]).latent_dist.mean[:, :, 0]
        mean, std = self.latent_stats(vae, latents)
        return (latents - mean) / std

    def decode_latents(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        # differentiable (reward backpropagation decodes with gradients); sampling callers run under no_grad
        vae = pipe.vae
        latents = latents.to(vae.device, vae.dtype)
        mean, std = self.latent_stats(vae, latents)
        images = vae.decode((latents * std + mean)[:, :, None], return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def native_resolution_of(self, denoiser_config, vae_config) -> int:
        return self.default_sample_size * qwen_vae_scale_factor(vae_config)

    def latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        # as QwenImagePipeline.prepare_latents: whole 2x2 patches; the transformer takes the patches' channels
        side = 2 * (int(resolution) // (qwen_vae_scale_factor(vae_config) * 2))
        return (denoiser_config["in_channels"] // 4, side, side)

    def text_tokens(self, model: str | None = None) -> int:
        stored = flow_common.trained_max_sequence_length(model) if model else None
        return stored or PLANNED_PROMPT_TOKENS

    def conditioning_shapes(self, denoiser_config, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        # no mask: a conditioning without one is all real tokens (what the planner counts)
        return {"prompt_embeds": (batch, text_tokens, denoiser_config["joint_attention_dim"])}

    # --- the denoiser and its training target -------------------------------------------------
    def transformer_call(self, denoiser, tokens: torch.Tensor, timesteps, cond: Conditioning, img_shapes) -> torch.Tensor:
        """The transformer on packed tokens; an all-ones mask is passed as None, as the pipeline passes it."""
        mask = cond.get("prompt_embeds_mask")
        if mask is not None and bool(mask.all()):
            mask = None
        return denoiser(hidden_states=tokens, timestep=timesteps.to(tokens.dtype) / 1000,
                        encoder_hidden_states=cond["prompt_embeds"], encoder_hidden_states_mask=mask,
                        img_shapes=img_shapes, return_dict=False)[0]

    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        """The velocity [B, C, H, W]: latents packed into 2x2 tokens, ``timesteps / 1000``, the output unpacked."""
        batch, _, height, width = latents.shape
        img_shapes = [[(1, height // 2, width // 2)]] * batch
        tokens = self.transformer_call(denoiser, pack_latents(latents), timesteps, cond, img_shapes)
        return unpack_latents(tokens, height, width)

    def guided_prediction(self, denoiser, latents, timesteps, cond, uncond, guidance_scale: float) -> torch.Tensor:
        """As QwenImagePipeline with ``true_cfg_scale``: two calls (conditional, then unconditional: their prompts'
        lengths differ, so they are not batched), combined on packed tokens with each token's norm rescaled to the
        conditional one's; no guidance at a scale of 1 or below."""
        cond_out = self.predict(denoiser, latents, timesteps, cond).float()
        if guidance_scale <= 1.0:
            return cond_out
        uncond_out = self.predict(denoiser, latents, timesteps, uncond).float()
        height, width = latents.shape[2:]
        guided = rescaled_guidance(pack_latents(cond_out), pack_latents(uncond_out), guidance_scale)
        return unpack_latents(guided, height, width)

    def call_arguments(self, pipe, prompts: list[str], guidance_scale: float, resolution: int | None = None) -> dict:
        """QwenImagePipeline guides through ``true_cfg_scale`` with a negative prompt (its ``guidance_scale`` is for
        guidance-distilled transformers only); None: the pipeline's default (no negative prompt: unguided)."""
        arguments = {"prompt": list(prompts), **self.generation_kwargs(pipe)}
        if guidance_scale is not None:
            arguments["true_cfg_scale"] = guidance_scale
            arguments["negative_prompt"] = [self.negative_prompt] * len(prompts) if guidance_scale > 1.0 else None
        return arguments

    def pipeline_latents(self, pipe, noise: torch.Tensor) -> torch.Tensor:
        return pack_latents(noise)  # the pipeline draws [B, C, 1, H, W] and packs it: the same values in this order

    def flow_sigmas(self, pipe, num_inference_steps: int, resolution: int) -> torch.Tensor:
        """As QwenImagePipeline: base σ = linspace(1, 1/N, N) shifted with μ = calculate_shift(packed image tokens)."""
        return resolution_shifted_sigmas(pipe, num_inference_steps, (self.latent_shape(pipe, resolution)[1] // 2) ** 2)


def resolution_shifted_sigmas(pipe, num_inference_steps: int, image_tokens: int) -> torch.Tensor:
    """The σ of FLUX-like pipelines: linspace(1, 1/N, N) given to the scheduler with μ from the image's token count."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    config = pipe.scheduler.config
    mu = calculate_shift(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    return flow_common.set_timesteps_copy(pipe.scheduler, num_inference_steps, sigmas=sigmas, mu=mu)

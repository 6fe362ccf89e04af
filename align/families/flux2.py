"""FLUX.2: one LLM text encoder (FLUX.2 [dev]: Mistral Small 3.1; [klein]: Qwen3) whose hidden states of three layers
are stacked per token, a transformer on latents patchified 2x2 by the VAE side and normalised by the VAE's batch-norm
statistics, 4-axis rotary positions, rectified flow with an empirical, step-dependent shift. [dev] is
guidance-distilled (the scale is an input); [klein] guides with two calls unless it is step-distilled (``is_distilled``).

Matches diffusers' Flux2Pipeline / Flux2KleinPipeline (encoding, patchify and batch-norm scaling, packing, position
ids, ``timestep / 1000``, guidance, the σ schedule) and examples/dreambooth/train_dreambooth_lora_flux2{,_klein}.py
(uniform timesteps, velocity target ε - x0, guidance 3.5 in training where the transformer embeds it, LoRA targets).
Deliberate differences:

- latents are the VAE posterior's mean, as the pipelines encode a reference image (the scripts sample the posterior).
- the latents this family hands the trainers are the patchified, normalised ones the transformer reads ([B, 4C, H/2,
  W/2]); ``decode_latents`` undoes both, as the pipelines do before their VAE.
- the T5-like length: the one stored beside the model (``flow_testbed.json``), else the pipelines' 512.
"""

from __future__ import annotations

import numpy as np
import torch

from align.families import flow_common
from align.families.base import Conditioning, pretrained_pipeline, vae_scale_factor

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # Flux2Pipeline / Flux2KleinPipeline's
TRAINING_GUIDANCE = 3.5  # train_dreambooth_lora_flux2.py --guidance_scale default (FLUX.2 [dev] is guidance-distilled)
DISTILLED_ATTRIBUTE = "align_step_distilled"  # set on a step-distilled [klein] transformer at load: it never guides
# train_dreambooth_lora_flux2.py's default --lora_layers: the double blocks' image attention, the single blocks' fused
# projection and their output (the script names each single block; the [klein] script the first 24 of them)
SINGLE_BLOCK_OUTPUTS = tuple(f"single_transformer_blocks.{i}.attn.to_out" for i in range(48))


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2], each channel's 2x2 patch as four channels (Flux2Pipeline._patchify_latents)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def tokens_of(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, HW, C] (Flux2Pipeline._pack_latents)."""
    return latents.flatten(2).transpose(1, 2)


def latents_of(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, height, width)


def position_ids(batch: int, height: int, width: int, time: int, device) -> torch.Tensor:
    """[B, HW, 4] ids (t, row, column, 0) of an image's tokens, row-major (Flux2Pipeline._prepare_latent_ids)."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    ids = torch.stack([torch.full_like(rows, time), rows, cols, torch.zeros_like(rows)], dim=1)
    return ids.unsqueeze(0).expand(batch, -1, -1)


def text_ids(batch: int, length: int, device) -> torch.Tensor:
    """[B, L, 4] ids (0, 0, 0, token index) of the prompt's tokens (Flux2Pipeline._prepare_text_ids)."""
    index = torch.arange(length, device=device)
    ids = torch.stack([torch.zeros_like(index)] * 3 + [index], dim=1)
    return ids.unsqueeze(0).expand(batch, -1, -1)


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu as pipeline_mu

    return pipeline_mu(image_seq_len=image_seq_len, num_steps=num_steps)


def inner(denoiser):
    """The transformer through an accelerate/DDP wrapper."""
    return getattr(denoiser, "module", denoiser)


class Flux2(flow_common.FlowMatchingFamily):
    name = "flux2"
    title = "FLUX.2"
    pipeline_class_names = ("Flux2Pipeline", "Flux2KleinPipeline")
    default_max_sequence_length = DEFAULT_MAX_SEQUENCE_LENGTH
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", *SINGLE_BLOCK_OUTPUTS)
    weighting_scheme = "none"
    default_sample_size = 128  # the pipelines': 128 x 8 x ... = 1024 px with the real VAE
    shard_blocks = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")

    def pipeline_class(self, class_name: str = "Flux2Pipeline"):
        import diffusers

        return getattr(diffusers, class_name)

    # --- loading and saving -------------------------------------------------------------------
    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        index = flow_common.loadable_model_index(model)
        pipe = pretrained_pipeline(self.pipeline_class(index["_class_name"]), model, dtype, self.title, quantization)
        # a step-distilled [klein] pipeline never guides; its transformer carries the flag for guided_prediction
        setattr(pipe.transformer, DISTILLED_ATTRIBUTE, bool(getattr(pipe.config, "is_distilled", False)))
        return flow_common.finish_loading(pipe, model, device, self.default_max_sequence_length)

    def frozen_modules(self, pipe) -> list[torch.nn.Module]:
        return [pipe.vae, pipe.text_encoder]

    # --- conditioning and latents -------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """``pipe.encode_prompt``: three layers' hidden states per token, padded to the sequence length (the pipelines
        attend to the padding too; ``text_ids`` are rebuilt in ``predict``)."""
        embeds, _ = pipe.encode_prompt(list(prompts), device=pipe.text_encoder.device,
                                       max_sequence_length=self.max_sequence_length(pipe))
        return {"prompt_embeds": embeds}

    def batch_norm_stats(self, vae, like: torch.Tensor):
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    @torch.no_grad()
    def encode_images(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        """The posterior mean, patchified, normalised with the VAE's batch-norm statistics (Flux2Pipeline._encode_vae_image)."""
        vae = pipe.vae
        latents = patchify(vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode())
        mean, std = self.batch_norm_stats(vae, latents)
        return (latents - mean) / std

    def decode_latents(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        # differentiable (reward backpropagation decodes with gradients); sampling callers run under no_grad
        vae = pipe.vae
        latents = latents.to(vae.device, vae.dtype)
        mean, std = self.batch_norm_stats(vae, latents)
        images = vae.decode(unpatchify(latents * std + mean), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        # as the pipelines' prepare_latents: whole 2x2 patches of the VAE's latents, patchified into channels
        side = int(resolution) // (vae_scale_factor(vae_config) * 2)
        return (denoiser_config["in_channels"], side, side)

    def text_tokens(self, model: str | None = None) -> int:
        return self.trained_t5_tokens(model)

    def conditioning_shapes(self, denoiser_config, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        shapes = {"prompt_embeds": (batch, text_tokens, denoiser_config["joint_attention_dim"])}
        if denoiser_config.get("guidance_embeds"):
            shapes["guidance"] = (batch,)
        return shapes

    # --- the denoiser and its training target -------------------------------------------------
    def uses_guidance_embedding(self, denoiser) -> bool:
        return bool(inner(denoiser).config.guidance_embeds)

    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        """The velocity [B, C, H, W]: one token per latent pixel, ``timesteps / 1000``, ``cond["guidance"]`` (else
        3.5, the training script's) where the transformer embeds guidance."""
        batch, _, height, width = latents.shape
        guidance = None
        if self.uses_guidance_embedding(denoiser):
            guidance = cond.get("guidance")
            if guidance is None:
                guidance = torch.full((batch,), TRAINING_GUIDANCE, device=latents.device, dtype=torch.float32)
        embeds = cond["prompt_embeds"]
        tokens = denoiser(hidden_states=tokens_of(latents), timestep=timesteps.to(latents.dtype) / 1000, guidance=guidance,
                          encoder_hidden_states=embeds, txt_ids=text_ids(batch, embeds.shape[1], latents.device),
                          img_ids=position_ids(batch, height, width, 0, latents.device), return_dict=False)[0]
        return latents_of(tokens[:, : height * width], height, width)

    def guided_prediction(self, denoiser, latents, timesteps, cond, uncond, guidance_scale: float) -> torch.Tensor:
        """[dev]: the scale as the guidance input. [klein]: as Flux2KleinPipeline, two calls (conditional, then the
        empty prompt) combined at scales above 1, none when the pipeline is step-distilled."""
        if self.uses_guidance_embedding(denoiser):
            return super().guided_prediction(denoiser, latents, timesteps, cond, uncond, guidance_scale)
        cond_out = self.predict(denoiser, latents, timesteps, cond).float()
        if guidance_scale <= 1.0 or getattr(inner(denoiser), DISTILLED_ATTRIBUTE, False):
            return cond_out
        uncond_out = self.predict(denoiser, latents, timesteps, uncond).float()
        return uncond_out + guidance_scale * (cond_out - uncond_out)

    def pipeline_latents(self, pipe, noise: torch.Tensor) -> torch.Tensor:
        return noise  # the pipelines take (and draw) the patchified [B, 4C, H/2, W/2] latents and pack them themselves

    def flow_sigmas(self, pipe, num_inference_steps: int, resolution: int) -> torch.Tensor:
        """As the FLUX.2 pipelines: linspace(1, 1/N, N) (left to the scheduler when it uses flow sigmas) shifted with the
        empirical μ of the image's token count and the number of steps."""
        side = self.latent_shape(pipe, resolution)[1]
        sigmas = None if pipe.scheduler.config.get("use_flow_sigmas", False) else np.linspace(
            1.0, 1 / num_inference_steps, num_inference_steps)
        mu = compute_empirical_mu(side * side, num_inference_steps)
        return flow_common.set_timesteps_copy(pipe.scheduler, num_inference_steps, sigmas=sigmas, mu=mu)

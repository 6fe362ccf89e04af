"""FLUX.1: CLIP pooled + T5 tokens, a transformer on 2x2-packed latent tokens, rectified flow with a
resolution-dependent shift; FLUX.1-dev takes the guidance scale as an input (guidance embedding).

Matches diffusers' FluxPipeline (conditioning, packing, ``timestep / 1000``, guidance, σ schedule,
VAE shift and scale) and examples/dreambooth/train_dreambooth_lora_flux.py (uniform timestep draw,
velocity target ε - x0, guidance 3.5 in training, LoRA targets). Deliberate differences:

- σ of a timestep: timestep / 1000 instead of the script's lookup in the training table (the same
  to float rounding; also serves timesteps off the table).
- the T5 length: the one the model was trained with (``flow_testbed.json``), else the pipeline's 512.
- ``text_ids`` (all zeros, one row per prompt token) and ``img_ids`` are rebuilt in ``predict`` from
  the shapes, so the conditioning stays a dict of batch-first tensors.
- Without a guidance embedding (FLUX.1-schnell) ``guided_prediction`` with a scale above 1 runs true
  classifier-free guidance against the empty prompt, i.e. ``pipe(negative_prompt="", true_cfg_scale=s)``;
  ``pipe(guidance_scale=s)`` alone ignores s for schnell, so pass 1.0 to sample as it does.
"""

from __future__ import annotations

import numpy as np
import torch

from align.families import flow_common
from align.families.base import Conditioning, pretrained_pipeline, vae_scale_factor

DEFAULT_MAX_SEQUENCE_LENGTH = 512  # FluxPipeline.__call__ / encode_prompt default
TRAINING_GUIDANCE = 3.5  # train_dreambooth_lora_flux.py --guidance_scale default (FLUX.1-dev is guidance-distilled)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: each 2x2 patch one token, row-major, channels then the patch's rows/cols."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The inverse of ``pack_latents`` for latents of ``height`` x ``width``."""
    b, _, features = tokens.shape
    patches = tokens.reshape(b, height // 2, width // 2, features // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, features // 4, height, width)


def latent_image_ids(height: int, width: int, device, dtype) -> torch.Tensor:
    """[(H/2)(W/2), 3] position ids of the packed tokens: (0, row, column)."""
    rows = torch.arange(height // 2, device=device).repeat_interleave(width // 2)
    cols = torch.arange(width // 2, device=device).repeat(height // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(dtype)


def denoiser_config(denoiser):
    """The transformer's config through an accelerate/DDP wrapper."""
    return getattr(denoiser, "module", denoiser).config


class Flux(flow_common.FlowMatchingFamily):
    name = "flux"
    title = "FLUX"
    pipeline_class_names = ("FluxPipeline",)
    default_max_sequence_length = DEFAULT_MAX_SEQUENCE_LENGTH
    # train_dreambooth_lora_flux.py's default --lora_layers: joint blocks' attention (both streams) and MLPs
    lora_targets = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
                    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    weighting_scheme = "none"  # the script's default: uniform timesteps, loss weight 1
    default_sample_size = 128  # FluxPipeline's: its transformer config names no sample size
    shard_blocks = ("FluxTransformerBlock", "FluxSingleTransformerBlock")

    def pipeline_class(self):
        from diffusers import FluxPipeline

        return FluxPipeline

    # --- loading and saving -------------------------------------------------------------------
    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        flow_common.loadable_model_index(model)
        pipe = pretrained_pipeline(self.pipeline_class(), model, dtype, self.title, quantization)
        return flow_common.finish_loading(pipe, model, device, self.default_max_sequence_length)

    def frozen_modules(self, pipe) -> list[torch.nn.Module]:
        return [pipe.vae, pipe.text_encoder, pipe.text_encoder_2]

    # --- conditioning and latents -------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """``pipe.encode_prompt``: T5 tokens and the CLIP pooled embedding (``text_ids`` are zeros, rebuilt
        in ``predict``). ``[""]`` is what FluxPipeline encodes for ``negative_prompt=""``."""
        prompt_embeds, pooled, _ = pipe.encode_prompt(list(prompts), None, max_sequence_length=self.max_sequence_length(pipe))
        return {"prompt_embeds": prompt_embeds, "pooled_embeds": pooled}

    def latent_shape_of(self, denoiser_config, vae_config, resolution: int) -> tuple[int, int, int]:
        # as FluxPipeline.prepare_latents: the VAE's downsampling, rounded down to whole 2x2 patches; the transformer
        # takes the 2x2 patches' channels
        side = 2 * (int(resolution) // (vae_scale_factor(vae_config) * 2))
        return (denoiser_config["in_channels"] // 4, side, side)

    def text_tokens(self, model: str | None = None) -> int:
        """The T5 tokens (CLIP gives the pooled embedding only)."""
        return self.trained_t5_tokens(model)

    def conditioning_shapes(self, denoiser_config, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        shapes = {"prompt_embeds": (batch, text_tokens, denoiser_config["joint_attention_dim"]),
                  "pooled_embeds": (batch, denoiser_config["pooled_projection_dim"])}
        if denoiser_config.get("guidance_embeds"):
            shapes["guidance"] = (batch,)
        return shapes

    # --- the denoiser and its training target -------------------------------------------------
    def uses_guidance_embedding(self, denoiser) -> bool:
        return bool(denoiser_config(denoiser).guidance_embeds)

    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        """The velocity [B, C, H, W]: latents packed into 2x2 tokens, ``timesteps / 1000`` (the transformer
        multiplies by 1000 again), ``cond["guidance"]`` (else 3.5, the training script's) where the
        transformer embeds guidance, and the output unpacked."""
        batch, _, height, width = latents.shape
        guidance = None
        if self.uses_guidance_embedding(denoiser):
            guidance = cond.get("guidance")
            if guidance is None:
                guidance = torch.full((batch,), TRAINING_GUIDANCE, device=latents.device, dtype=torch.float32)
        prompt_embeds = cond["prompt_embeds"]
        tokens, ids = pack_latents(latents), latent_image_ids(height, width, latents.device, latents.dtype)
        reference = self.reference_tokens(cond, latents.dtype)
        if reference is not None:  # an editing family's source image: its tokens after the latents' (FLUX.1 Kontext)
            tokens, ids = torch.cat([tokens, reference[0]], dim=1), torch.cat([ids, reference[1]])
        out = denoiser(
            hidden_states=tokens,
            timestep=timesteps.to(latents.dtype) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_embeds"],
            encoder_hidden_states=prompt_embeds,
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=latents.device, dtype=prompt_embeds.dtype),
            img_ids=ids,
            return_dict=False,
        )[0]
        return unpack_latents(out[:, : (height // 2) * (width // 2)], height, width)

    def reference_tokens(self, cond: Conditioning, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(packed tokens, position ids) of images the prediction sees besides its latents; FLUX.1 has none."""
        return None

    def pipeline_latents(self, pipe, noise: torch.Tensor) -> torch.Tensor:
        return pack_latents(noise)  # FluxPipeline takes (and draws) its latents as 2x2 patch tokens

    def flow_sigmas(self, pipe, num_inference_steps: int, resolution: int) -> torch.Tensor:
        """As FluxPipeline: base σ = linspace(1, 1/N, N) (left to the scheduler when it uses flow sigmas),
        shifted with μ = calculate_shift(number of packed image tokens)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = pipe.scheduler.config
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        tokens = (self.latent_shape(pipe, resolution)[1] // 2) ** 2
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        return flow_common.set_timesteps_copy(pipe.scheduler, num_inference_steps, sigmas=sigmas, mu=mu)

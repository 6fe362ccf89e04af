"""Stable Diffusion 3 / 3.5: two CLIPs (+ optional T5), an MMDiT transformer, rectified flow.

Matches diffusers' StableDiffusion3Pipeline (conditioning, denoiser call, σ schedule, VAE shift and
scale) and examples/dreambooth/train_dreambooth_lora_sd3.py (training draw, target, LoRA targets).
Deliberate differences from the script:

- target: the velocity ε - x0. The script's default ``precondition_outputs=1`` regresses
  x_σ - σ·v on x0 instead, which is the same loss times σ²; a trainer wanting that weights by σ².
- σ of a timestep: timestep / 1000 instead of a lookup in the training table (the same to float
  rounding; it also serves timesteps that are not in the table, e.g. a sampler's).
- the T5 length: the one the model was trained with (``flow_testbed.json``), else the pipeline's
  default 256 (the script defaults to 77 for training and validates with the pipeline's 256).
"""

from __future__ import annotations

import torch

from align.families import flow_common
from align.families.base import Conditioning, pretrained_pipeline

DEFAULT_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline.__call__ / encode_prompt default


class StableDiffusion3(flow_common.FlowMatchingFamily):
    name = "sd3"
    title = "Stable Diffusion 3"
    pipeline_class_names = ("StableDiffusion3Pipeline",)
    default_max_sequence_length = DEFAULT_MAX_SEQUENCE_LENGTH
    # train_dreambooth_lora_sd3.py's default --lora_layers (joint blocks' attention, both streams)
    lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")
    shard_blocks = ("JointTransformerBlock",)
    weighting_scheme = "logit_normal"  # the script's default timestep density (loss weight 1)

    def pipeline_class(self):
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    # --- loading and saving -------------------------------------------------------------------
    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        index = flow_common.loadable_model_index(model)
        # diffusers refuses a null T5 entry unless it is passed as None (SD3 without T5, the flow testbed)
        no_t5 = {name: None for name in ("text_encoder_3", "tokenizer_3")
                 if flow_common.is_null_component(index.get(name))}
        pipe = pretrained_pipeline(self.pipeline_class(), model, dtype, self.title, quantization, **no_t5)
        return flow_common.finish_loading(pipe, model, device, self.default_max_sequence_length)

    def frozen_modules(self, pipe) -> list[torch.nn.Module]:
        encoders = [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
        return [pipe.vae] + [encoder for encoder in encoders if encoder is not None]

    # --- conditioning and latents -------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        """``pipe.encode_prompt``'s positive outputs (CLIP-L/G penultimate states + T5 tokens, both pooled
        CLIP embeddings); ``[""]`` is the unconditional side, as the pipeline encodes a missing negative."""
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            list(prompts), None, None, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length(pipe),
        )
        return {"prompt_embeds": prompt_embeds, "pooled_embeds": pooled}

    def text_tokens(self, model: str | None = None) -> int:
        """CLIP's 77 tokens and the T5 tokens, concatenated (zeros where the pipeline has no T5)."""
        return self.text_tokens_clip + self.trained_t5_tokens(model)

    def conditioning_shapes(self, denoiser_config, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        return {"prompt_embeds": (batch, text_tokens, denoiser_config["joint_attention_dim"]),
                "pooled_embeds": (batch, denoiser_config["pooled_projection_dim"])}

    # --- the denoiser and its training target -------------------------------------------------
    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        """The velocity; ``timesteps`` = σ·1000 as the pipeline passes them."""
        return denoiser(
            hidden_states=latents, timestep=timesteps, encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_embeds"], return_dict=False,
        )[0]

    def flow_sigmas(self, pipe, num_inference_steps: int, resolution: int) -> torch.Tensor:
        """As StableDiffusion3Pipeline: ``set_timesteps(N)`` with the static shift; with dynamic shifting
        (``use_dynamic_shifting``, SD3.5 variants that set it) μ from the image's patch count."""
        kwargs = {}
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            side = resolution // pipe.vae_scale_factor // pipe.transformer.config.patch_size
            config = pipe.scheduler.config
            kwargs["mu"] = calculate_shift(side * side, config.get("base_image_seq_len", 256),
                                           config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                           config.get("max_shift", 1.16))
        return flow_common.set_timesteps_copy(pipe.scheduler, num_inference_steps, **kwargs)

"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, a UNet, DDPM training (epsilon or v-prediction)."""

from __future__ import annotations

from pathlib import Path

import torch

from align.families.base import (
    LORA_WEIGHTS,
    Conditioning,
    ModelFamily,
    lora_metadata,
    pretrained_pipeline,
)


def peft_lora_state_dict(denoiser) -> dict[str, torch.Tensor]:
    """The denoiser's LoRA weights in diffusers' key format, float32 on the CPU."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    state = convert_state_dict_to_diffusers(get_peft_model_state_dict(denoiser))
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


class StableDiffusion(ModelFamily):
    name = "sd"
    title = "Stable Diffusion"
    pipeline_class_names = ("StableDiffusionPipeline",)
    denoiser_name = "unet"

    def pipeline_class(self):
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline

    def load_pipeline(self, model: str, dtype: torch.dtype, device, quantization=None):
        from diffusers import DDIMScheduler

        pipe = pretrained_pipeline(self.pipeline_class(), model, dtype, self.title, quantization,
                                   safety_checker=None, requires_safety_checker=False)
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        pipe.set_progress_bar_config(disable=True)
        return pipe.to(device)

    def frozen_modules(self, pipe) -> list[torch.nn.Module]:
        return [pipe.vae, pipe.text_encoder]

    def save_lora(self, denoiser, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.pipeline_class().save_lora_weights(folder, unet_lora_layers=peft_lora_state_dict(denoiser),
                                                unet_lora_adapter_metadata=lora_metadata(denoiser), safe_serialization=True)
        return folder / LORA_WEIGHTS

    def load_lora(self, pipe, folder: str | Path) -> None:
        # Our LoRA files hold UNet weights only: loaded into the UNet alone (pipe.load_lora_weights gives the
        # same images and warns that the text encoder has no LoRA keys).
        pipe.unet.load_lora_adapter(str(folder), prefix="unet", weight_name=LORA_WEIGHTS)

    @torch.no_grad()
    def encode_prompts(self, pipe, prompts: list[str], resolution: int | None = None) -> Conditioning:
        tokens = pipe.tokenizer(
            list(prompts), padding="max_length", max_length=pipe.tokenizer.model_max_length,
            truncation=True, return_tensors="pt",
        ).input_ids.to(pipe.text_encoder.device)
        return {"prompt_embeds": pipe.text_encoder(tokens)[0]}

    @torch.no_grad()
    def encode_images(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        vae = pipe.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
        return latents * vae.config.scaling_factor

    def decode_latents(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        # differentiable (reward backpropagation decodes with gradients); sampling callers run under no_grad
        vae = pipe.vae
        images = vae.decode(latents.to(vae.device, vae.dtype) / vae.config.scaling_factor).sample
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def set_training_attention(self, denoiser) -> None:
        """SDPA attention: diffusers' default AttnProcessor2_0 (torch's scaled_dot_product_attention), put back if a
        loaded model carries another processor. LoRA (PEFT) wraps the projections, not the processor, so it stays."""
        from diffusers.models.attention_processor import AttnProcessor2_0

        processors = getattr(denoiser, "attn_processors", {})
        if processors and not all(isinstance(p, AttnProcessor2_0) for p in processors.values()):
            denoiser.set_attn_processor(AttnProcessor2_0())

    def predict(self, denoiser, latents, timesteps, cond: Conditioning) -> torch.Tensor:
        return denoiser(latents, timesteps, encoder_hidden_states=cond["prompt_embeds"]).sample

    def draw_training_timesteps(self, scheduler, batch: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=generator)

    def noisy_and_target(self, scheduler, x0, noise, timesteps):
        noisy = scheduler.add_noise(x0, noise, timesteps)
        prediction_type = scheduler.config.prediction_type
        if prediction_type == "epsilon":
            return noisy, noise
        if prediction_type == "v_prediction":
            return noisy, scheduler.get_velocity(x0, noise, timesteps)
        raise ValueError(f"scheduler prediction_type {prediction_type!r} is not trained here; valid: epsilon, v_prediction")

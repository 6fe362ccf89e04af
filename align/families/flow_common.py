"""What SD3 and FLUX share: loading a flow pipeline, the trained T5 length, VAE shift + scale, the
rectified-flow training draw and target of diffusers' DreamBooth LoRA scripts, LoRA save/load."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from align.families.base import LORA_WEIGHTS, ModelFamily, ModelLoadError, lora_metadata, one_line
from align.testbed.flow_models import FLOW_SETTINGS_FILE

# The pipeline attribute that holds the T5 length the model was trained with (set at load).
MAX_SEQUENCE_LENGTH_ATTRIBUTE = "align_max_sequence_length"


def model_index(model: str) -> dict:
    """model_index.json of a local pipeline folder or a hub id (read through the hub cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return json.loads((path / "model_index.json").read_text())
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.load_config(model)


def loadable_model_index(model: str) -> dict:
    """``model_index`` for a family's loader: a folder or hub id whose index cannot be read is one ModelLoadError line."""
    try:
        return model_index(model)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read the model_index.json of {model!r}: {one_line(err)}") from err


def is_null_component(entry) -> bool:
    """model_index.json spells a component saved as None as null or [null, null]."""
    return entry is None or (isinstance(entry, (list, tuple)) and all(part is None for part in entry))


# The pipeline attribute that holds the image side stored beside the model (set at load; None: the pipeline's default).
RESOLUTION_ATTRIBUTE = "align_resolution"


def stored_setting(model: str, key: str) -> int | None:
    """An integer setting (``max_sequence_length``, ``resolution``) stored in ``flow_testbed.json`` beside a local
    pipeline, if any."""
    path = Path(model).expanduser() / FLOW_SETTINGS_FILE
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get(key)
    return int(value) if value is not None else None


def trained_max_sequence_length(model: str) -> int | None:
    """``max_sequence_length`` stored in ``flow_testbed.json`` beside a local pipeline, if any."""
    return stored_setting(model, "max_sequence_length")


def finish_loading(pipe, model: str, device, default_max_sequence_length: int):
    """Progress bars off, the trained T5 length and the stored image side remembered on the pipe, moved to
    ``device``."""
    pipe.set_progress_bar_config(disable=True)
    stored = trained_max_sequence_length(model)
    setattr(pipe, MAX_SEQUENCE_LENGTH_ATTRIBUTE, stored if stored is not None else default_max_sequence_length)
    setattr(pipe, RESOLUTION_ATTRIBUTE, stored_setting(model, "resolution"))
    return pipe.to(device)


def max_sequence_length(pipe, default: int) -> int:
    """The T5 length to encode with: the one set at load, else the pipeline's default."""
    return int(getattr(pipe, MAX_SEQUENCE_LENGTH_ATTRIBUTE, default))


@torch.no_grad()
def encode_shifted(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(posterior mean - shift_factor) · scaling_factor, as SD3/FLUX training scripts scale latents."""
    latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mean
    return (latents - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor


def decode_shifted(vae, latents: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] from latents / scaling_factor + shift_factor, as the SD3/FLUX pipelines decode; differentiable
    (reward backpropagation decodes with gradients), so sampling callers run it under no_grad."""
    latents = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    return (vae.decode(latents).sample.float() / 2 + 0.5).clamp(0, 1)


def training_schedule(scheduler):
    """A fresh copy of the scheduler with its 1000 training timesteps/sigmas (as ``noise_scheduler_copy`` in
    diffusers' scripts; the pipeline's own scheduler holds the last inference schedule instead)."""
    return type(scheduler).from_config(copy.deepcopy(dict(scheduler.config)))


def draw_flow_timesteps(scheduler, batch: int, generator: torch.Generator | None, weighting_scheme: str,
                        logit_mean: float = 0.0, logit_std: float = 1.0, mode_scale: float = 1.29) -> torch.Tensor:
    """u from the weighting scheme's density, index = floor(u · 1000) into the training timesteps (descending).

    As train_dreambooth_lora_sd3.py / _flux.py with ``compute_density_for_timestep_sampling``; our own
    generator makes the draw reproducible (the scripts use the global RNG).
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    table = training_schedule(scheduler)
    u = compute_density_for_timestep_sampling(weighting_scheme=weighting_scheme, batch_size=batch, logit_mean=logit_mean,
                                              logit_std=logit_std, mode_scale=mode_scale, generator=generator)
    indices = (u * table.config.num_train_timesteps).long().clamp(max=len(table.timesteps) - 1)
    return table.timesteps[indices]


def rectified_flow_pair(scheduler, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor):
    """(x_σ = (1 - σ)·x0 + σ·ε, target ε - x0) with σ = timestep / num_train_timesteps.

    The scripts look σ up in the training table (``get_sigmas``), whose timesteps are exactly σ·1000;
    dividing gives the same σ to float rounding and also works for timesteps off the table (a sampler's).
    """
    sigma = (timesteps.to(x0.device, torch.float32) / scheduler.config.num_train_timesteps).reshape(-1, *([1] * (x0.ndim - 1)))
    noisy = (1.0 - sigma) * x0.float() + sigma * noise.float()
    return noisy.to(x0.dtype), (noise.float() - x0.float()).to(x0.dtype)


def set_timesteps_copy(scheduler, num_inference_steps: int, **kwargs) -> torch.Tensor:
    """The sigmas (N + 1, last 0) of ``set_timesteps`` on a copy, leaving the pipeline's scheduler untouched."""
    table = training_schedule(scheduler)
    table.set_timesteps(num_inference_steps=num_inference_steps, device="cpu", **kwargs)
    return table.sigmas.to(torch.float32)


def transformer_lora_state_dict(denoiser) -> dict[str, torch.Tensor]:
    """PEFT's LoRA state dict as the SD3/FLUX scripts save it (``lora_A``/``lora_B`` keys: unlike the UNet
    scripts they do not convert to the older ``lora.down``/``lora.up`` names, which these loaders misread),
    float32 on the CPU."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(denoiser)
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


def save_transformer_lora(pipeline_class, denoiser, folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pipeline_class.save_lora_weights(folder, transformer_lora_layers=transformer_lora_state_dict(denoiser),
                                     transformer_lora_adapter_metadata=lora_metadata(denoiser), safe_serialization=True)
    return folder / LORA_WEIGHTS


def load_transformer_lora(pipe, folder: str | Path) -> None:
    """Our LoRA files hold transformer weights only: loaded into the transformer alone (``pipe.load_lora_weights``
    gives the same outputs and warns once per text encoder that it has no LoRA keys; tested both ways)."""
    pipe.transformer.load_lora_adapter(str(folder), prefix="transformer", weight_name=LORA_WEIGHTS)


class FlowMatchingFamily(ModelFamily):
    """What SD3 and FLUX share: a transformer predicting the flow velocity, a T5 length remembered on the
    pipeline, shifted VAE latents, LoRA on the transformer alone, the rectified-flow training pair."""

    denoiser_name = "transformer"
    is_flow = True
    default_max_sequence_length = 256  # the pipeline's own default, overridden per family
    weighting_scheme = "none"  # the family's training script's timestep density

    def save_lora(self, denoiser, folder: str | Path) -> Path:
        return save_transformer_lora(self.pipeline_class(), denoiser, folder)

    def load_lora(self, pipe, folder: str | Path) -> None:
        load_transformer_lora(pipe, folder)

    def max_sequence_length(self, pipe) -> int:
        return max_sequence_length(pipe, self.default_max_sequence_length)

    def trained_t5_tokens(self, model: str | None) -> int:
        """The T5 length the model encodes with, from its folder (``flow_testbed.json``) or the pipeline's default."""
        return (trained_max_sequence_length(model) if model else None) or self.default_max_sequence_length

    def native_resolution(self, pipe) -> int:
        """The image side stored beside the model (a testbed's), else the pipeline's default."""
        return getattr(pipe, RESOLUTION_ATTRIBUTE, None) or super().native_resolution(pipe)

    def encode_images(self, pipe, pixels: torch.Tensor) -> torch.Tensor:
        return encode_shifted(pipe.vae, pixels)

    def decode_latents(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        return decode_shifted(pipe.vae, latents)

    def generation_kwargs(self, pipe) -> dict:
        return {"max_sequence_length": self.max_sequence_length(pipe)}

    def draw_training_timesteps(self, scheduler, batch: int, generator: torch.Generator) -> torch.Tensor:
        return draw_flow_timesteps(scheduler, batch, generator, self.weighting_scheme)

    def noisy_and_target(self, scheduler, x0, noise, timesteps):
        return rectified_flow_pair(scheduler, x0, noise, timesteps)

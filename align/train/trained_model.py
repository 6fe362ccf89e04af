"""The trained denoiser of the diffusion trainers (Diffusion-DPO, online RL): the pipeline loaded for training, the
denoiser made trainable (a LoRA adapter or every weight) with the family's FSDP2 units, and its reference."""

from __future__ import annotations

import torch

from align.cli import ConfigError
from align.families import UnknownFamilyError, family_of, family_of_pipeline
from align.families.base import ModelFamily, ModelLoadError, one_line
from align.pipeline import add_lora, cast_frozen, check_model, frozen_copy, load_pipeline
from align.train.sharding import pipeline_device, place_frozen_parts, shard_frozen, use_family_blocks

COMPUTE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def compute_dtype(mixed_precision: str) -> torch.dtype:
    return COMPUTE_DTYPES.get(mixed_precision, torch.float32)


def detect_family(model: str) -> ModelFamily:
    """The model's family, from its model_index.json, before any weight loads."""
    try:
        return family_of(check_model(model))
    except ModelLoadError:
        raise
    except (UnknownFamilyError, OSError, ValueError) as err:
        raise ModelLoadError(f"--model {model!r}: {one_line(err)}") from None


def load_for_training(run, family, frozen_dtype: torch.dtype):
    """The pipeline of ``run.config.model``, its frozen parts (text encoders, VAE) in ``frozen_dtype`` without
    gradients. A LoRA run loads the denoiser in that dtype too (its adapter is cast to float32 when added); a full
    fine-tuning loads it in float32. Under FSDP2 the pipeline loads on the CPU and only the frozen parts move to the
    device (sharding places each process's share of the denoiser)."""
    config = run.config
    pipe = load_pipeline(config.model, dtype=frozen_dtype if config.finetune == "lora" else torch.float32,
                         device=pipeline_device(run.accelerator))
    if family_of_pipeline(pipe) is not family:
        raise ConfigError(f"--model {config.model!r} loaded as {family_of_pipeline(pipe).name}, detected as {family.name}")
    place_frozen_parts(run.accelerator, family, pipe)
    for module in family.frozen_modules(pipe):
        module.requires_grad_(False)
        cast_frozen(module, frozen_dtype)
    return pipe


def trainable_denoiser(run, family, pipe, keep_reference: bool):
    """(the denoiser, its reference, the trainable parameters). LoRA: the family's attention projections get an
    adapter in float32 and the reference is the same denoiser with the adapter off (None). Full fine-tuning: every
    weight trains and the reference, where ``keep_reference``, is a frozen copy sharded like the policy."""
    config = run.config
    denoiser = family.denoiser(pipe)
    family.set_training_attention(denoiser)
    reference = None
    if config.finetune == "lora":
        add_lora(denoiser, rank=config.lora_rank, alpha=config.lora_alpha, target_modules=family.lora_targets)
        for p in denoiser.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    else:
        denoiser.requires_grad_(True)
    use_family_blocks(run.accelerator, family, denoiser)  # FSDP2's units; nothing without sharding
    if config.finetune == "full" and keep_reference:
        reference = shard_frozen(run.accelerator, frozen_copy(denoiser))
    if config.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    return denoiser, reference, [p for p in denoiser.parameters() if p.requires_grad]

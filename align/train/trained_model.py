"""The trained denoiser of the diffusion trainers (Diffusion-DPO, online RL): the pipeline loaded for training, the
denoiser made trainable (a LoRA adapter or every weight) with the family's FSDP2 units, and its reference."""

from __future__ import annotations

import warnings

import torch

from align.cli import ConfigError
from align.families import UnknownFamilyError, family_of, family_of_pipeline
from align.families.base import ModelFamily, ModelLoadError, one_line
from align.pipeline import add_lora, cast_frozen, check_model, frozen_copy, load_pipeline
from align.train.offload import offload_frozen_parts
from align.train.quantization import (
    NONE,
    cast_inputs_to,
    keep_dequantized_weights_out_of_autograd,
    pipeline_quantization,
)
from align.train.sharding import (
    is_sharded,
    pipeline_device,
    place_frozen_parts,
    shard_frozen,
    use_family_blocks,
)

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


def text_encoder_names(model: str) -> list[str]:
    """The pipeline's text encoders, as its model_index.json names them (text_encoder, text_encoder_2, ...)."""
    from diffusers import DiffusionPipeline

    index = DiffusionPipeline.load_config(check_model(model))
    return [name for name, entry in index.items()
            if name.startswith("text_encoder") and isinstance(entry, list) and entry[0] is not None]


def load_for_training(run, family, frozen_dtype: torch.dtype):
    """The pipeline of ``run.config.model``, its frozen parts (text encoders, VAE) in ``frozen_dtype`` without
    gradients. A LoRA run loads the denoiser in that dtype too (its adapter is cast to float32 when added); a full
    fine-tuning loads it in float32. Under FSDP2 the pipeline loads on the CPU and only the frozen parts move to the
    device (sharding places each process's share of the denoiser).

    ``--quantize_base`` / ``--quantize_text_encoders`` load those parts quantized (align/train/quantization.py), the
    quantized denoiser in the compute dtype, as diffusers' scripts load it; ``--offload`` keeps the frozen parts on the
    CPU between uses (align/train/offload.py): the pipeline then loads on the CPU and only the denoiser moves."""
    config, accelerator = run.config, run.accelerator
    quantized_base = config.quantize_base != NONE
    if quantized_base and is_sharded(accelerator):
        raise ConfigError(f"--quantize_base {config.quantize_base} is for one process per model (a LoRA on a frozen "
                          "base that fits one GPU); under FSDP2 use --quantize_base none: sharding divides the base instead")
    dtype = frozen_dtype if config.finetune == "lora" else torch.float32
    if quantized_base and compute_dtype(config.mixed_precision) != dtype:
        dtype = {"default": dtype, family.denoiser_name: compute_dtype(config.mixed_precision)}
    encoders = text_encoder_names(config.model) if config.quantize_text_encoders != NONE else []
    quantization = pipeline_quantization(config.quantize_base, config.quantize_text_encoders, family.denoiser_name,
                                         encoders, compute_dtype(config.mixed_precision))
    pipe = load_pipeline(config.model, dtype=dtype, device="cpu" if config.offload else pipeline_device(accelerator),
                         quantization=quantization)
    if family_of_pipeline(pipe) is not family:
        raise ConfigError(f"--model {config.model!r} loaded as {family_of_pipeline(pipe).name}, detected as {family.name}")
    if quantized_base:
        keep_dequantized_weights_out_of_autograd(family.denoiser(pipe))
        cast_inputs_to(family.denoiser(pipe), compute_dtype(config.mixed_precision))
    for module in family.frozen_modules(pipe):
        module.requires_grad_(False)
        cast_frozen(module, frozen_dtype)
    if config.offload:
        if not is_sharded(accelerator):
            family.denoiser(pipe).to(accelerator.device)
        offload_frozen_parts(family.frozen_modules(pipe), family.denoiser(pipe), accelerator.device)
    else:
        place_frozen_parts(accelerator, family, pipe)
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
        with warnings.catch_warnings():  # PEFT warns that a torchao base cannot be merged into; it never is (merged_adapter)
            warnings.filterwarnings("ignore", message=".*get_apply_tensor_subclass")
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

"""The counts a memory plan needs (align/train/memory_plan.py), from a pipeline's config files alone.

Every part is built on the meta device (shapes, no weights, no memory; a hub id costs its small config files), the
LoRA adapter is attached as the trainer attaches it, and the activations are counted by running one training
forward of the denoiser on the meta device at the run's batch and resolution, summing the unique storages
autograd saves for the backward (parameters excluded). That count follows the architecture exactly (every block,
its channels and tokens at the run's resolution) where a closed formula would need a coefficient per block type.
Attention is counted as the fused kernels save it (query, key, value, output and the log-sum-exp; no attention
matrix), as torch's SDPA does on GPUs and on CPUs; on the meta device torch would take its unfused path instead.
With gradient checkpointing a block keeps only its inputs, and the backward recomputes one block at a time: the
count is what stays outside the blocks, the blocks' inputs, and the largest block's own saved activations.
Under mixed precision the forward runs in the compute dtype (autocast keeps a few tensors, the normalisations'
inputs, in fp32: a slight undercount).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from align.cli import ConfigError
from align.families import family_named
from align.families.base import ModelLoadError, one_line
from align.pipeline import add_lora, check_model
from align.train.accelerator import resolve_mixed_precision
from align.train.memory_plan import (
    FP32,
    PLAIN,
    FrozenPart,
    Quantization,
    RunShape,
    compute_bytes,
    optimizer_bytes_per_parameter,
)
from align.train.objectives import algorithm
from align.train.quantization import NONE, SCHEMES

FROZEN_PARTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")


def read_model_index(model: str) -> dict:
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.load_config(model)


def build_on_meta(model: str, subfolder: str, library: str, class_name: str) -> torch.nn.Module:
    """One pipeline component from its config file, its parameters on the meta device."""
    import diffusers
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):
        if library == "diffusers":
            cls = getattr(diffusers, class_name)
            return cls.from_config(cls.load_config(model, subfolder=subfolder))
        cls = getattr(transformers, class_name)
        return cls(cls.config_class.from_pretrained(model, subfolder=subfolder))


def parameter_count(module: torch.nn.Module, trained_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trained_only)


def fsdp_unit_counts(model: torch.nn.Module, is_unit) -> tuple[int, int]:
    """(the largest unit's own parameters, the root's): units are the modules ``is_unit(name, module)`` picks, and
    a unit's parameters are those of no unit nested inside it, as fully_shard assigns them."""
    units = [name for name, module in model.named_modules() if name and is_unit(name, module)]
    owned = dict.fromkeys(units, 0)
    root = 0
    for name, p in model.named_parameters():
        owners = [u for u in units if name.startswith(u + ".")]
        if owners:
            owned[max(owners, key=len)] += p.numel()
        else:
            root += p.numel()
    return max(owned.values(), default=0), root


def not_converted(module: torch.nn.Module) -> list[str]:
    """The modules a quantization config leaves whole, as the library that loads ``module`` decides: transformers'
    defaults (tied weights, the last module, the output embeddings) for a transformers model, the class's
    ``_keep_in_fp32_modules`` for a diffusers one."""
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel):
        from transformers.quantizers.base import get_keys_to_not_convert

        return get_keys_to_not_convert(module)
    return list(getattr(module, "_keep_in_fp32_modules", None) or ())


def frozen_part(module: torch.nn.Module, quantizable: bool = True) -> FrozenPart:
    """A frozen module's counts (align/train/memory_plan.py): its parameters, and the ``nn.Linear`` weights a
    quantization config would quantize (every linear but those ``not_converted`` names) with their rows."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    skipped = not_converted(module) if quantizable else []
    linears = [m for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and should_convert_module(name, skipped)]
    return FrozenPart(parameter_count(module), sum(m.weight.numel() for m in linears),
                      sum(m.out_features for m in linears), quantizable)


def scheme_quantization(name: str) -> Quantization:
    """A --quantize_* value as the planner counts it."""
    scheme = SCHEMES.get(name)
    return PLAIN if scheme is None else Quantization(scheme.weight_bits, scheme.row_scale_bytes)


def class_units(class_names):
    """The trainers' FSDP2 units: the modules of the family's block classes (``ModelFamily.shard_blocks``,
    align/train/sharding.py)."""
    names = set(class_names)
    return lambda name, module: type(module).__name__ in names


# ----------------------------------------------------------------------------------------------
# Activations


class SavedStorages:
    """The unique storages autograd saves for the backward inside ``hooks()``, parameters excluded."""

    def __init__(self, excluded: list[torch.Tensor]):
        self.excluded = {id(t.untyped_storage()) for t in excluded}
        self.nbytes: dict[int, int] = {}
        self._alive = []  # the storages stay referenced, so no id is reused while counting

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._alive.append(storage)
        if id(storage) not in self.excluded:
            self.nbytes.setdefault(id(storage), storage.nbytes())
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.add, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.nbytes.values())


class _FusedAttention(torch.autograd.Function):
    """What a fused SDPA kernel saves (q, k, v, output, log-sum-exp), for counting on the meta device."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        ctx.save_for_backward(query, key, value, out, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, *_ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


@contextlib.contextmanager
def fused_attention_on_meta():
    original = torch.nn.functional.scaled_dot_product_attention

    def attention(query, key, value, *args, **kwargs):
        return _FusedAttention.apply(query, key, value)

    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def activation_bytes(denoiser: torch.nn.Module, forward, checkpointing: bool) -> int:
    """Bytes kept for the backward of ``forward()`` (a training forward of ``denoiser``), plus with checkpointing
    the largest block's recomputed activations (the module docstring)."""
    params = list(denoiser.parameters())
    kept = SavedStorages(params)
    recomputed = [0]

    def counting_checkpoint(block, *args):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                kept.add(arg)
        inside = SavedStorages(params)
        with inside.hooks():
            out = block(*args)
        recomputed.append(inside.total)
        return out

    if checkpointing:
        denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=counting_checkpoint)
    try:
        with torch.enable_grad(), kept.hooks(), fused_attention_on_meta():
            forward()
    finally:
        if checkpointing:
            denoiser.disable_gradient_checkpointing()
    return kept.total + max(recomputed)


def training_forward(family, denoiser, vae_config: dict, batch: int, resolution: int, text_tokens: int, dtype):
    """A no-argument call of the family's training prediction on meta inputs of the run's shapes (the family says
    what they are: align/families)."""
    config = dict(denoiser.config)

    def meta(shape):
        return torch.zeros(*shape, device="meta", dtype=dtype)

    cond = {key: meta(shape) for key, shape in family.conditioning_shapes(config, batch, text_tokens).items()}
    latents = meta((batch, *family.latent_shape_of(config, vae_config, resolution)))
    if family.edits:  # an editing family's source image: its latents' shape (the family's rule)
        cond["source_latents"] = meta((batch, *family.source_latent_shape_of(config, vae_config, resolution)))
    timesteps = meta((batch,))
    return lambda: family.predict(denoiser, latents, timesteps, cond)


# ----------------------------------------------------------------------------------------------
# A run's shape from its config


@dataclass(frozen=True)
class PlannedRun:
    shape: RunShape
    family: str
    resolution: int
    forward_batch: int   # samples per training forward and process
    precision: str
    summary: str


@dataclass
class PipelineParts:
    """A pipeline's parts built on the meta device: the denoiser, the VAE's config, the other frozen parts."""

    family: object
    denoiser: torch.nn.Module
    vae_config: dict
    others: list[torch.nn.Module]
    text_tokens: int


def read_pipeline_parts(model_spec: str) -> PipelineParts:
    """The parts of a pipeline folder or hub id from its config files; one that cannot be read is a ConfigError."""
    try:
        model = check_model(model_spec)
        index = read_model_index(model)
        family = family_named(index.get("_class_name", ""))
        name = family.denoiser_name
        denoiser = build_on_meta(model, name, *index[name])
        vae_config = dict(build_on_meta(model, "vae", *index["vae"]).config)
        others = [build_on_meta(model, part, *index[part]) for part in FROZEN_PARTS if (index.get(part) or [None])[0]]
    except ModelLoadError as err:
        raise ConfigError(str(err)) from None
    except Exception as err:  # the hub, a missing or broken config file: one line
        raise ConfigError(f"--model {model_spec!r}: cannot read the pipeline's config files ({one_line(err)})") from None
    return PipelineParts(family, denoiser, vae_config, others, family.text_tokens(model))


def plan_run(config) -> PlannedRun:
    """The RunShape of a trainer's config (DPOConfig, or DDPOConfig when it has an ``algorithm``), from the
    pipeline's config files."""
    return plan_parts(read_pipeline_parts(config.model), config)


def plan_parts(parts: PipelineParts, config) -> PlannedRun:
    """The RunShape of a trainer's config for a pipeline's parts (the denoiser gets the run's LoRA and dtype)."""
    from transformers import PreTrainedModel

    online = hasattr(config, "algorithm")
    precision = resolve_mixed_precision(config.mixed_precision)
    family, denoiser, vae_config, others = parts.family, parts.denoiser, parts.vae_config, parts.others
    denoiser_params = parameter_count(denoiser)
    base_part = frozen_part(denoiser)  # before the adapter: LoRA's frozen base
    quantize_base = getattr(config, "quantize_base", NONE)
    quantize_text = getattr(config, "quantize_text_encoders", NONE)
    largest_unit, root = fsdp_unit_counts(denoiser, class_units(family.shard_blocks))
    lora = config.finetune == "lora"
    if lora:
        add_lora(denoiser, rank=config.lora_rank, alpha=config.lora_alpha, target_modules=family.lora_targets)
    trained = parameter_count(denoiser, trained_only=True) if lora else denoiser_params
    compute = compute_bytes(precision)
    # Frozen weights' dtype as the trainers load them: DPO the whole pipeline in fp32; the online-RL trainer its text
    # encoders and VAE in the compute dtype, the denoiser's frozen weights (LoRA's base) too, a full fine-tuning's
    # reference copy in fp32.
    # A quantized base loads in the compute dtype in both trainers (align/train/trained_model.py).
    frozen = compute if (online and lora) or quantize_base != NONE else FP32
    others_bytes = compute if online else FP32
    if online:
        cfg_rows = 2 if config.guidance_scale != 1.0 and not family.uses_guidance_embedding(denoiser) else 1
        # reward backpropagation holds several steps' (or copies') activations for one backward
        forward_batch = config.train_batch_size * cfg_rows * algorithm(config.algorithm).objective.kept_forwards(config)
        reference = int(not lora and config.kl_coef > 0)
        old_policy = int(algorithm(config.algorithm).objective.keeps_old_policy(config))
    else:
        forward_batch, reference, old_policy = 2 * config.train_batch_size, int(not lora), 0  # winner and loser
    resolution = config.resolution or family.native_resolution_of(dict(denoiser.config), vae_config)
    dtype = {2: torch.bfloat16, FP32: torch.float32}[compute]
    torch.nn.Module.to(denoiser, dtype)  # diffusers' own .to() warns about fp32-kept modules on a plain cast
    forward = training_forward(family, denoiser, vae_config, forward_batch, resolution, parts.text_tokens, dtype)
    activations = activation_bytes(denoiser, forward, config.gradient_checkpointing)
    shape = RunShape(
        denoiser_params=denoiser_params, trained_params=trained, frozen_denoiser_bytes=frozen,
        other_params=sum(parameter_count(part) for part in others), other_bytes=others_bytes,
        optimizer_bytes=optimizer_bytes_per_parameter(config.use_8bit_adam), reference_copies=reference,
        old_policy_copies=old_policy, compute_bytes=compute, largest_unit_params=largest_unit, root_params=root,
        activation_bytes=activations, base_part=base_part, base_quantization=scheme_quantization(quantize_base),
        other_parts=tuple(frozen_part(part, quantizable=isinstance(part, PreTrainedModel)) for part in others),
        text_quantization=scheme_quantization(quantize_text), offload=bool(getattr(config, "offload", False)),
    )
    what = f"--algorithm {config.algorithm}" if online else "Diffusion-DPO"
    summary = (f"{what}, {family.name} ({denoiser_params:,} denoiser parameters, {trained:,} trained, "
               f"{shape.other_params:,} in text encoders + VAE), --finetune {config.finetune}, mixed precision "
               f"{precision}, {forward_batch} samples per forward at {resolution} px, gradient checkpointing "
               f"{'on' if config.gradient_checkpointing else 'off'}, --quantize_base {quantize_base}, "
               f"--quantize_text_encoders {quantize_text}, --offload {'on' if shape.offload else 'off'}, "
               f"{'8-bit AdamW' if config.use_8bit_adam else 'AdamW'}")
    return PlannedRun(shape, family.name, resolution, forward_batch, precision, summary)

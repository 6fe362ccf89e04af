"""Per-process memory of a training run, from the model's parameter counts: pure arithmetic, no torch.

What one process holds, part by part (bytes):

- trained parameters: fp32 (accelerate keeps trained weights in fp32 and autocasts the compute; the trainers
  upcast LoRA weights; under FSDP2 accelerate upcasts the trained parameters to fp32 and the
  MixedPrecisionPolicy casts them for the compute);
- the denoiser's frozen weights (LoRA: the base model; full fine-tuning: none), in the dtype the trainer loads
  them in (Diffusion-DPO: fp32; the online-RL trainer: the compute dtype for LoRA, fp32 for full fine-tuning);
- gradients: fp32, one per trained parameter; under DDP with more than one process also DDP's gradient buckets
  (accelerate keeps torch's default ``gradient_as_bucket_view=False``: a second fp32 copy of the gradients);
- optimiser states: AdamW's two fp32 moments (8 bytes per trained parameter), bitsandbytes' 8-bit AdamW two
  bytes (its per-block scales, 1/1024 of that, are left out);
- the frozen reference copy of the denoiser (Diffusion-DPO --finetune full; the online-RL trainer with --kl_coef > 0
  and full fine-tuning; LoRA: none, the adapter switched off is the reference), in the trained dtype;
- the old policy of DiffusionNFT / AWM (an EMA clone of the trained parameters, fp32: align/train/old_policy.py);
- the pipeline's other parts that stay on the device (text encoders, VAE), never sharded; with --offload only the
  largest of them, which visits the device alone (align/train/offload.py: counted as if it stayed, an upper bound);
- a frozen part loaded quantized (--quantize_base, --quantize_text_encoders: align/train/quantization.py): its
  ``nn.Linear`` weights at the scheme's bits per weight plus its bytes per output row (the scales), the rest of it
  in the load dtype;
- activations: the bytes autograd keeps for the backward of one training forward (align/train/memory_model.py
  counts them on the meta device), plus, with gradient checkpointing, one block's recomputed activations.

DDP replicates everything. FSDP2 with N processes divides by N what it shards: the denoiser's parameters (trained
and frozen), their gradients and optimiser states, and the reference and old-policy copies when they are sharded
too (``copies_sharded``: they are copies of the sharded module, so a trainer that builds them after sharding
shards them). It adds the unsharded parameters of the FSDP units being computed: with reshard_after_forward one
unit at a time plus the next one prefetched (two of the largest unit, in the compute dtype), the root unit's own
parameters (not resharded after the forward), and the largest unit's unsharded fp32 gradients before their
reduce-scatter. Not counted: CUDA's context and allocator slack (~1-2 GB on a GPU), communication buffers,
the data, transient tensors of one operation, and the sampling of the online-RL trainer (no gradients, less
than its training step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MIB = 1024**2
GIB = 1024**3
FP32 = 4


def optimizer_bytes_per_parameter(use_8bit_adam: bool) -> int:
    """AdamW: exp_avg and exp_avg_sq in fp32; 8-bit AdamW: one byte each."""
    return 2 if use_8bit_adam else 2 * FP32


def compute_bytes(mixed_precision: str) -> int:
    """Bytes per element of the compute dtype: fp16 / bf16 halves fp32."""
    return 2 if mixed_precision in ("fp16", "bf16") else FP32


@dataclass(frozen=True)
class FrozenPart:
    """A frozen module's counts, for its bytes loaded plain or quantized."""

    params: int                # every parameter
    linear_params: int = 0     # the nn.Linear weights a quantization config quantizes
    linear_rows: int = 0       # their output features (one scale each)
    quantizable: bool = True   # False: never quantized (the VAE)


@dataclass(frozen=True)
class Quantization:
    """How quantized linear weights are held: bits per weight (0: not quantized) and bytes per output row."""

    weight_bits: float = 0.0
    row_bytes: int = 0


PLAIN = Quantization()


def part_bytes(part: FrozenPart, dtype_bytes: int, quantization: Quantization) -> int:
    """A frozen part's bytes: quantized linear weights at their bits and row bytes, everything else in the dtype."""
    if not quantization.weight_bits or not part.quantizable:
        return part.params * dtype_bytes
    quantized = part.linear_params * quantization.weight_bits / 8 + part.linear_rows * quantization.row_bytes
    return int((part.params - part.linear_params) * dtype_bytes + quantized)


@dataclass(frozen=True)
class RunShape:
    """What the memory of one training process depends on: parameter counts (elements) and dtypes (bytes)."""

    denoiser_params: int          # every parameter of the denoiser (UNet or transformer), LoRA's not included
    trained_params: int           # full: = denoiser_params; LoRA: the adapter's parameters
    frozen_denoiser_bytes: int    # bytes per frozen denoiser weight (LoRA's base model, the reference copy)
    other_params: int             # text encoders and VAE
    other_bytes: int              # their dtype's bytes
    optimizer_bytes: int          # per trained parameter
    reference_copies: int         # 0 or 1: a frozen copy of the denoiser
    old_policy_copies: int        # 0 or 1: an EMA clone of the trained parameters
    compute_bytes: int            # the compute dtype's bytes (FSDP2's all-gathered parameters)
    largest_unit_params: int      # the largest FSDP unit's own parameters (nested units excluded)
    root_params: int              # parameters in no unit (the root's)
    activation_bytes: int         # kept for the backward of one training forward, per process
    copies_sharded: bool = True   # the reference and old policy are sharded under FSDP2
    base_part: FrozenPart | None = None           # LoRA's frozen base by kind of weight (None: all at its dtype)
    base_quantization: Quantization = PLAIN       # --quantize_base
    other_parts: tuple[FrozenPart, ...] = ()      # the text encoders and the VAE (empty: other_params at other_bytes)
    text_quantization: Quantization = PLAIN       # --quantize_text_encoders
    offload: bool = False                         # --offload: one of the other parts on the device at a time

    @property
    def full(self) -> bool:
        return self.trained_params == self.denoiser_params


def _shard(nbytes: int, processes: int) -> int:
    return -(-nbytes // processes)


def frozen_base_bytes(shape: RunShape) -> int:
    """LoRA's frozen base as loaded (none for full fine-tuning)."""
    if shape.full:
        return 0
    if shape.base_part is None:
        return shape.denoiser_params * shape.frozen_denoiser_bytes
    return part_bytes(shape.base_part, shape.frozen_denoiser_bytes, shape.base_quantization)


def other_parts_bytes(shape: RunShape) -> int:
    """The text encoders and VAE on the device: all of them, or with --offload the largest."""
    if not shape.other_parts:
        return shape.other_params * shape.other_bytes
    sizes = [part_bytes(part, shape.other_bytes, shape.text_quantization) for part in shape.other_parts]
    return max(sizes) if shape.offload else sum(sizes)


def ddp_plan(shape: RunShape, processes: int) -> dict[str, int]:
    """Bytes per process under DDP (or one process), by part."""
    grads = shape.trained_params * FP32
    frozen_base = frozen_base_bytes(shape)
    return {
        "trained parameters (fp32)": shape.trained_params * FP32,
        "frozen denoiser weights": frozen_base,
        "gradients": grads,
        "DDP gradient buckets": grads if processes > 1 else 0,
        "optimizer states": shape.trained_params * shape.optimizer_bytes,
        "reference copy": shape.reference_copies * shape.denoiser_params * shape.frozen_denoiser_bytes,
        "old policy (EMA)": shape.old_policy_copies * shape.trained_params * FP32,
        "text encoders + VAE": other_parts_bytes(shape),
        "activations": shape.activation_bytes,
    }


def fsdp2_plan(shape: RunShape, processes: int) -> dict[str, int]:
    """Bytes per process under FSDP2 with ``processes`` shards, by part (assumptions: the module docstring)."""
    replicated = ddp_plan(shape, 1)
    sharded_parts = ["trained parameters (fp32)", "frozen denoiser weights", "gradients", "optimizer states"]
    if shape.copies_sharded:
        sharded_parts += ["reference copy", "old policy (EMA)"]
    plan = {part: _shard(nbytes, processes) if part in sharded_parts else nbytes
            for part, nbytes in replicated.items() if part != "DDP gradient buckets"}
    trained_fraction = shape.trained_params / max(shape.denoiser_params, 1)
    gathered = (2 * shape.largest_unit_params + shape.root_params) * shape.compute_bytes
    unit_grads = int(shape.largest_unit_params * trained_fraction) * FP32
    plan["all-gathered units"] = gathered + unit_grads
    return plan


def total(plan: dict[str, int]) -> int:
    return sum(plan.values())


def plan_table(shape: RunShape, process_counts: list[int], sharded: bool = True) -> str:
    """A text table: one row per part, one column per (strategy, processes), in GiB (MiB for a small model), and
    the total. FSDP2 from 2 processes (the trainers shard nothing on one), where ``sharded``."""
    columns = [(f"DDP x{n}", ddp_plan(shape, n)) for n in process_counts]
    columns += [(f"FSDP2 x{n}", fsdp2_plan(shape, n)) for n in process_counts if n > 1 and sharded]
    parts = list(dict.fromkeys(part for _, plan in columns for part in plan))
    unit, scale = ("GiB", GIB) if max(total(plan) for _, plan in columns) >= GIB else ("MiB", MIB)
    width = max(len(part) for part in parts + ["total"])
    lines = [f"{unit + ' per process':<{width}} " + " ".join(f"{name:>10}" for name, _ in columns)]
    for part in parts + ["total"]:
        cells = [total(plan) if part == "total" else plan.get(part) for _, plan in columns]
        lines.append(f"{part:<{width}} " + " ".join(f"{'-' if c is None else f'{c / scale:.2f}':>10}" for c in cells))
    return "\n".join(lines)


def choices_table(shape: RunShape, schemes: dict[str, Quantization], processes: int = 1) -> str:
    """One process's total (DDP x ``processes``) for each quantization scheme (rows) applied to the frozen base alone or
    to the base and the text encoders, each without and with --offload (columns); the rest of the run as planned.
    A full fine-tuning has no frozen base: only its text encoders can be quantized."""
    headers = ("base", "base, offload", "base + text encoders", "base + text, offload")
    unit, scale = ("GiB", GIB) if total(ddp_plan(shape, processes)) >= GIB else ("MiB", MIB)
    width = max(len(name) for name in schemes) + 2
    lines = [f"{unit + ' per process':<{width + 6}} " + " ".join(f"{h:>22}" for h in headers)]
    for name, quantization in schemes.items():
        cells = []
        for text, offload in ((PLAIN, False), (PLAIN, True), (quantization, False), (quantization, True)):
            choice = replace(shape, base_quantization=quantization, text_quantization=text, offload=offload)
            cells.append(f"{total(ddp_plan(choice, processes)) / scale:.2f}")
        if shape.full and quantization.weight_bits:
            cells[:2] = ["- (full fine-tuning)", "-"]
        lines.append(f"{name:<{width + 6}} " + " ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)

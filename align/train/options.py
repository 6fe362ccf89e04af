"""The options every trainer shares, declared and checked once: the run folder, the model and its adapter, and the
held-out evaluation. Each trainer's config inherits them (``DPOConfig(RunOptions, ModelOptions, HeldOutOptions)``)
and re-declares a field only to give it its own default and help (DDPO trains LoRA by default, DPO the whole
UNet). An option whose meaning differs between trainers (DPO's --learning_rate is per pair and scaled, DDPO's is
absolute) stays in each trainer's own config.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.cli import option
from align.data.prompt_sets import load_prompt_list
from align.declared import (
    BATCH,
    COEFFICIENT,
    COUNT_OR_ZERO,
    PROMPT_FILES,
    SEED,
    WEIGHT_DECAY,
)
from align.judges import check_judge_names
from align.train.quantization import CHOICES, NONE, check_scheme_names, choices_help

FINETUNES = ("full", "lora")
LORA_RANKS = "[1, 4096]"
LORA_ALPHAS = "(0, 65536]"
PRECISIONS = (None, "no", "fp16", "bf16")
TRACKERS = ("tensorboard", "wandb", "all", "none")
LORA_RANK_HELP = ("LoRA rank of the model family's attention projections (SD, SDXL: to_q, to_k, to_v, to_out.0; SD3, "
                  "FLUX: align/families)")


@dataclass
class RunOptions:
    """The run folder: where it is, how a run starts, resumes and logs."""

    output_dir: str = option("runs/run", "the run folder (config, metrics, checkpoints, final weights, report)", "output",
                             path="output")
    resume: str | None = option(None, "continue a run: 'latest' or a checkpoint folder", "output", path="folder",
                                or_name=True)
    overwrite: bool = option(False, "replace a run already in --output_dir", "output")
    seed: int = option(0, "seed of everything random in the run", "optimisation", within=SEED)
    report_to: str = option("tensorboard", "tracker: tensorboard, wandb, all, or none", "output", choices=TRACKERS)
    quiet: bool = option(False, "no progress bars (they are also off when stderr is not a terminal)", "output")
    checkpoints_total_limit: int = option(3, "checkpoints kept (older ones are deleted; 0: all)", "output",
                                          within=COUNT_OR_ZERO)
    dry_run: bool = option(False, "print the per-process memory under DDP and FSDP2 for 1-8 processes (the model "
                           "built from its config files, no weights) and exit: nothing is trained or written", "output")

    def check_run_options(self) -> None:
        """Declared (option's within/choices/path), checked with every field: align.validation.check_config_values."""


@dataclass
class ModelOptions:
    """The diffusion model fine-tuned, what of it is trained, and the precision and memory switches."""

    model: str = option("stable-diffusion-v1-5/stable-diffusion-v1-5",
                        "the pipeline to fine-tune: a hub id, a local pipeline folder, or 'testbed'", "model",
                        path="folder", or_name=True)
    finetune: str = option("lora", "'lora' (the adapter off is the reference) or 'full' (every denoiser weight)", "model",
                           choices=FINETUNES)
    lora_rank: int = option(4, LORA_RANK_HELP, "model", within=LORA_RANKS)
    lora_alpha: float | None = option(None, "LoRA alpha: the update is scaled by alpha / rank (None: alpha = rank, as "
                                      "diffusers' training scripts; Flow-GRPO and DiffusionNFT use 2 x rank)", "model",
                                      within=LORA_ALPHAS)
    mixed_precision: str | None = option(
        None, "no, fp16 (the papers) or bf16; unset: accelerate's setting (accelerate launch --mixed_precision, its "
        "config file), else no", "optimisation", choices=PRECISIONS[1:])
    gradient_checkpointing: bool = option(False, "recompute the denoiser's activations in the backward: less memory, "
                                          "slower", "model")
    use_8bit_adam: bool = option(False, "bitsandbytes' 8-bit AdamW (needs bitsandbytes)", "optimisation")
    quantize_base: str = option(NONE, "load the frozen denoiser quantized under a LoRA (its adapter and optimiser "
                                f"states stay fp32; the reference runs through the same weights): none; {choices_help()}",
                                "model", choices=CHOICES)
    quantize_text_encoders: str = option(NONE, "load the text encoders quantized: none, or a scheme of --quantize_base",
                                         "model", choices=CHOICES)
    offload: bool = option(False, "keep the text encoders and the VAE on the CPU between uses: each moves to the "
                           "device when it is called and back when the denoiser runs (diffusers' scripts' --offload)",
                           "model")
    adam_weight_decay: float = option(1e-2, "AdamW weight decay", "optimisation", within=WEIGHT_DECAY)
    max_grad_norm: float = option(1.0, "gradient-norm clipping (0: none)", "optimisation", within=COEFFICIENT)

    def check_model_options(self) -> None:
        """Ranges and choices declared, checked with every field (align.validation.check_config_values); a quantized
        base needs a LoRA."""
        check_scheme_names(self.quantize_base, self.quantize_text_encoders, self.finetune)


@dataclass
class HeldOutOptions:
    """The held-out evaluation before, during and after training, and the spending limit of paid judges."""

    eval_prompts: str | None = option(None, "held-out prompts scored before and after training (a file, a "
                                      "prompt set or testbed:<n>:<seed>)", "evaluation", path="file", or_name=True,
                                      formats=PROMPT_FILES, reads=load_prompt_list)
    eval_judge: str | None = option(None, "judge of the held-out evaluation (None: --reward)", "evaluation")
    eval_images_per_prompt: int = option(1, "seeds per held-out prompt (more: a smaller standard error)",
                                         "evaluation", within=BATCH)
    eval_batch_size: int = option(8, "images per pipeline call in the evaluation (each image's seed fixes it, "
                                  "not the batching)", "evaluation", within=BATCH)
    max_api_cost: float = option(5.0, "refuse to start when the paid API judge calls are estimated above this many "
                                 "USD (answers already cached count as free)", "judge", within=COEFFICIENT)
    eval_second_judge: str | None = option(None, "a second local judge scored on the same held-out images (e.g. "
                                           "shapes-oracle beside a learned --reward): the report draws both judges' "
                                           "gains along the run", "evaluation", applies="--eval_prompts")

    def check_held_out_options(self) -> None:
        """Ranges declared, checked with every field (align.validation.check_config_values); the second judge's name."""
        if self.eval_second_judge:
            check_judge_names((self.eval_second_judge,), "--eval_second_judge")

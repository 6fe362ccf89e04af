"""The options every trainer shares, declared and checked once: the run folder, the model and its adapter, and the
held-out evaluation. Each trainer's config inherits them (``DPOConfig(RunOptions, ModelOptions, HeldOutOptions)``)
and re-declares a field only to give it its own default and help (DDPO trains LoRA by default, DPO the whole
UNet). An option whose meaning differs between trainers (DPO's --learning_rate is per pair and scaled, DDPO's is
absolute) stays in each trainer's own config.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.cli import ConfigError, option
from align.train.quantization import NONE, check_scheme_names, choices_help

FINETUNES = ("full", "lora")
PRECISIONS = (None, "no", "fp16", "bf16")
TRACKERS = ("tensorboard", "wandb", "all", "none")
LORA_RANK_HELP = ("LoRA rank of the model family's attention projections (SD, SDXL: to_q, to_k, to_v, to_out.0; SD3, "
                  "FLUX: align/families)")


@dataclass
class RunOptions:
    """The run folder: where it is, how a run starts, resumes and logs."""

    output_dir: str = option("runs/run", "the run folder (config, metrics, checkpoints, final weights, report)", "output")
    resume: str | None = option(None, "continue a run: 'latest' or a checkpoint folder", "output")
    overwrite: bool = option(False, "replace a run already in --output_dir", "output")
    seed: int = option(0, "seed of everything random in the run", "optimisation")
    report_to: str = option("tensorboard", "tracker: tensorboard, wandb, all, or none", "output")
    quiet: bool = option(False, "no progress bars (they are also off when stderr is not a terminal)", "output")
    checkpoints_total_limit: int = option(3, "checkpoints kept (older ones are deleted; 0: all)", "output")
    dry_run: bool = option(False, "print the per-process memory under DDP and FSDP2 for 1-8 processes (the model "
                           "built from its config files, no weights) and exit: nothing is trained or written", "output")

    def check_run_options(self) -> None:
        if self.report_to not in TRACKERS:
            raise ConfigError(f"--report_to must be {', '.join(TRACKERS[:-1])} or {TRACKERS[-1]}, got {self.report_to!r}")


@dataclass
class ModelOptions:
    """The diffusion model fine-tuned, what of it is trained, and the precision and memory switches."""

    model: str = option("stable-diffusion-v1-5/stable-diffusion-v1-5",
                        "the pipeline to fine-tune: a hub id, a local pipeline folder, or 'testbed'", "model")
    finetune: str = option("lora", "'lora' (the adapter off is the reference) or 'full' (every denoiser weight)", "model")
    lora_rank: int = option(4, LORA_RANK_HELP, "model")
    lora_alpha: float | None = option(None, "LoRA alpha: the update is scaled by alpha / rank (None: alpha = rank, as "
                                      "diffusers' training scripts; Flow-GRPO and DiffusionNFT use 2 x rank)", "model")
    mixed_precision: str | None = option(
        None, "no, fp16 (the papers) or bf16; unset: accelerate's setting (accelerate launch --mixed_precision, its "
        "config file), else no", "optimisation")
    gradient_checkpointing: bool = option(False, "recompute the denoiser's activations in the backward: less memory, "
                                          "slower", "model")
    use_8bit_adam: bool = option(False, "bitsandbytes' 8-bit AdamW (needs bitsandbytes)", "optimisation")
    quantize_base: str = option(NONE, "load the frozen denoiser quantized under a LoRA (its adapter and optimiser "
                                f"states stay fp32; the reference runs through the same weights): none; {choices_help()}",
                                "model")
    quantize_text_encoders: str = option(NONE, "load the text encoders quantized: none, or a scheme of --quantize_base",
                                         "model")
    offload: bool = option(False, "keep the text encoders and the VAE on the CPU between uses: each moves to the "
                           "device when it is called and back when the denoiser runs (diffusers' scripts' --offload)",
                           "model")
    adam_weight_decay: float = option(1e-2, "AdamW weight decay", "optimisation")
    max_grad_norm: float = option(1.0, "gradient-norm clipping (0: none)", "optimisation")

    def check_model_options(self) -> None:
        if self.finetune not in FINETUNES:
            raise ConfigError(f"--finetune must be full or lora, got {self.finetune!r}")
        if self.mixed_precision not in PRECISIONS:
            raise ConfigError(f"--mixed_precision must be no, fp16 or bf16, got {self.mixed_precision!r}")
        if self.lora_rank < 1:
            raise ConfigError(f"--lora_rank must be >= 1, got {self.lora_rank}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(f"--lora_alpha must be > 0, got {self.lora_alpha}")
        check_scheme_names(self.quantize_base, self.quantize_text_encoders, self.finetune)


@dataclass
class HeldOutOptions:
    """The held-out evaluation before, during and after training, and the spending limit of paid judges."""

    eval_prompts: str | None = option(None, "held-out prompts scored before and after training (a file, a "
                                      "prompt set or testbed:<n>:<seed>)", "evaluation")
    eval_judge: str | None = option(None, "judge of the held-out evaluation (None: --reward)", "evaluation")
    eval_images_per_prompt: int = option(1, "seeds per held-out prompt (more: a smaller standard error)",
                                         "evaluation")
    eval_batch_size: int = option(8, "images per pipeline call in the evaluation (each image's seed fixes it, "
                                  "not the batching)", "evaluation")
    max_api_cost: float = option(5.0, "refuse to start when the paid API judge calls are estimated above this many "
                                 "USD (answers already cached count as free)", "judge")

    def check_held_out_options(self) -> None:
        for name in ("eval_images_per_prompt", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not self.max_api_cost >= 0:
            raise ConfigError(f"--max_api_cost must be a number of USD >= 0, got {self.max_api_cost}")

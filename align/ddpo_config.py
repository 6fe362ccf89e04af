"""DDPO's options: the dataclass behind `align/ddpo.py`'s flags and its YAML configs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from align.advantages import MODES
from align.cli import ConfigError
from align.training import check_lr_schedule, check_periodic_evaluation

TIMESTEP_SELECTIONS = ("random", "high_noise")


@dataclass
class DDPOConfig:
    # --- what to train and with which reward
    model: str = "stable-diffusion-v1-5/stable-diffusion-v1-5"  # hub id, local pipeline folder, or "testbed"
    reward: str = "aesthetic"  # judge spec: a name, name[opt=value], or a mix such as pickscore:0.7,aesthetic:0.3
    prompts: str | None = None  # text file, dataset column, or testbed:<n>[:<seed>]
    # --- output
    output_dir: str = "runs/ddpo"
    resume: str | None = None  # "latest" or a checkpoint folder
    overwrite: bool = False  # replace a run already in output_dir
    seed: int = 0
    report_to: str = "tensorboard"  # tensorboard, wandb, all, or none
    # --- model and adapter
    finetune: str = "lora"  # "lora" (paper) or "full"
    lora_rank: int = 4
    lora_alpha: float | None = None  # None = rank
    lora_targets: str = "to_q,to_k,to_v,to_out.0"
    # Training forward: each LoRA layer as one matmul with W + B·A, the same gradients as PEFT's
    # three-matmul path. Small UNets: faster (testbed: ~18% faster training steps, less memory);
    # SD v1.5 on a CPU: 1.02x the speed at 1.16x the peak memory (the merged weights are kept for
    # the backward), hence off by default. scripts/bench_dpo.py measures both.
    lora_merged_forward: bool = False
    mixed_precision: str = "no"  # no, fp16 (paper), bf16
    cpu_threads: int | None = None  # torch CPU threads (None = torch's default); 1 is fastest on a busy CPU
    # Compile the UNet for the no-grad sampling chain ahead of time, in a child process
    # (align/compiled_sampling.py: ~30 CPU-s once, then a testbed sampling forward takes 36 ms instead
    # of 52; with --finetune full, torch.compile in process). Not the training step: with torch 2.13
    # on a CPU inductor's backward is wrong for some UNets (scripts/check_compiled_backward.py).
    compile_sampling: bool = False
    # --- sampling (paper: 50 DDIM steps, η = 1, guidance 5)
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    # Guidance of the held-out evaluations (None: guidance_scale), so that a run sampled and trained at
    # another guidance (1.0: one UNet row per sample instead of two) is scored as the model is used (README).
    eval_guidance_scale: float | None = None
    eta: float = 1.0  # must be > 0: the log-probability of a deterministic step is undefined
    resolution: int | None = None  # None = the model's native size
    samples_per_epoch: int = 256  # over all processes (paper: 256)
    sample_batch_size: int = 8  # images per process per sampling batch
    images_per_prompt: int = 1  # images drawn per prompt in a batch (>= 2 for group advantages or pairwise judges)
    # One initial noise per group (DanceGRPO): reward differences within a group then come only from the
    # sampler's own per-step noise, the actions the policy gradient credits, not from the starting point.
    shared_group_noise: bool = False
    # --- advantages
    advantage: str = "per-prompt"  # per-prompt (DDPO stat tracking), group (GRPO), group-mean (Dr. GRPO: no std division), or batch
    stat_buffer_size: int = 32  # per-prompt reward buffer (ddpo-pytorch: 16-32)
    stat_min_count: int = 16  # below this many rewards a prompt uses the batch statistics
    # --- objective (paper: PPO-clip, no KL)
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0  # > 0 adds kl_coef x KL(step ‖ reference step) (Flow-GRPO); reference = adapter off
    timestep_fraction: float = 1.0  # share of the denoising steps trained per sample, in (0, 1]
    # which steps: "random" (paper: a random subset per sample) or "high_noise" (the first, noisiest
    # steps, where layout and counts are decided; low-noise steps add large, reward-blind gradient noise)
    timestep_selection: str = "random"
    # With high_noise: sample the untrained low-noise tail of the chain with η = 0, as the evaluation
    # sampler does (MixGRPO); noise there changes rewards in ways no trained step can take credit for.
    deterministic_tail: bool = False
    # DDIM steps for that deterministic tail (None: the schedule's own). Fewer is faster (MixGRPO-Flash),
    # but the judge then scores images from a coarser sampler than the one evaluated.
    tail_steps: int | None = None
    # Trajectory branching (TempFlow-GRPO): a group's chains share their starting noise and run
    # deterministic DDIM (η = 0) except at one step, drawn per group from the trained window
    # (timestep_fraction, timestep_selection), where each chain draws its own noise; only that step
    # is trained. Reward differences in a group then belong to that one step.
    branch_sampling: bool = False
    timestep_batch: int = 1  # trained timesteps per UNet call (1 = one at a time; more: faster, more memory, same gradient)
    # --- optimisation (paper: AdamW, lr 3e-4, LoRA)
    num_epochs: int = 100
    num_inner_epochs: int = 1  # passes of PPO over each epoch's samples
    train_batch_size: int = 4  # samples per process per micro-batch
    gradient_accumulation_steps: int = 2  # micro-batches per optimiser step (each spans the trained timesteps)
    learning_rate: float = 3e-4
    # diffusers' get_scheduler over all optimiser steps: constant (paper), constant_with_warmup, linear, cosine, ...
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    # LoRA+ (Hayou et al. 2024): the lora_B matrices learn at this multiple of learning_rate (1 = plain LoRA)
    lora_plus_ratio: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    # --- checkpoints, samples, evaluation
    checkpointing_epochs: int = 10
    checkpoints_total_limit: int = 3
    num_logged_images: int = 8  # images (with their rewards) saved under samples/ each logged epoch
    sample_log_epochs: int = 10
    eval_prompts: str | None = None  # held-out prompts scored before and after training
    eval_judge: str | None = None  # defaults to --reward
    eval_seed: int = 1234
    eval_images_per_prompt: int = 1  # seeds per held-out prompt (more: a smaller standard error)
    eval_batch_size: int = 8  # images per pipeline call in the evaluation (each image's seed fixes it, not the batching)
    eval_every_epochs: int = 0  # > 0: also score the held-out prompts every N epochs (evals/, the report's held-out curve)
    num_validation_images: int = 4  # images per row of the before/after grids

    def validate(self) -> None:
        """Cheap checks, before any model or judge is loaded."""
        from align.validation import check_common_inputs, check_optimiser_ranges

        check_common_inputs(self)
        check_optimiser_ranges(self)
        if not self.prompts:
            raise ConfigError("--prompts is required (a text file, a dataset column, or testbed:<n>)")
        if not (self.eta > 0 and math.isfinite(self.eta)):
            raise ConfigError(f"--eta must be > 0 (DDPO samples stochastically; the paper uses 1.0), got {self.eta}")
        if not 0.0 < self.timestep_fraction <= 1.0:
            raise ConfigError(f"--timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.timestep_selection not in TIMESTEP_SELECTIONS:
            raise ConfigError(
                f"--timestep_selection must be one of {', '.join(TIMESTEP_SELECTIONS)}, got {self.timestep_selection!r}"
            )
        if self.deterministic_tail and self.timestep_selection != "high_noise":
            raise ConfigError("--deterministic_tail needs --timestep_selection high_noise (the trained steps must be the first ones)")
        if self.tail_steps is not None:
            if not self.deterministic_tail:
                raise ConfigError("--tail_steps needs --deterministic_tail true (only a deterministic tail can be coarsened)")
            if not 1 <= self.tail_steps <= self.num_untrained_timesteps:
                raise ConfigError(
                    f"--tail_steps must be between 1 and the {self.num_untrained_timesteps} untrained steps, got {self.tail_steps}"
                )
        if self.branch_sampling:
            if self.images_per_prompt < 2:
                raise ConfigError("--branch_sampling needs --images_per_prompt >= 2 (a group branches from one chain)")
            if self.deterministic_tail:
                raise ConfigError(
                    "--branch_sampling already samples every step but the branch step with eta 0; drop --deterministic_tail"
                )
        check_lr_schedule(self.lr_scheduler, self.lr_warmup_steps)
        check_periodic_evaluation("eval_every_epochs", self.eval_every_epochs, self.eval_prompts, self.eval_judge or self.reward)
        if self.finetune not in ("full", "lora"):
            raise ConfigError(f"--finetune must be full or lora, got {self.finetune!r}")
        if not (self.lora_plus_ratio > 0 and math.isfinite(self.lora_plus_ratio)):
            raise ConfigError(f"--lora_plus_ratio must be a positive number, got {self.lora_plus_ratio}")
        if self.lora_plus_ratio != 1.0 and self.finetune != "lora":
            raise ConfigError("--lora_plus_ratio applies to LoRA's B matrices only (--finetune lora)")
        if self.advantage not in MODES:
            raise ConfigError(f"--advantage must be one of {', '.join(MODES)}, got {self.advantage!r}")
        if self.mixed_precision not in ("no", "fp16", "bf16"):
            raise ConfigError(f"--mixed_precision must be no, fp16 or bf16, got {self.mixed_precision!r}")
        if self.report_to not in ("tensorboard", "wandb", "all", "none"):
            raise ConfigError(f"--report_to must be tensorboard, wandb, all or none, got {self.report_to!r}")
        for name in ("num_inference_steps", "samples_per_epoch", "sample_batch_size", "images_per_prompt",
                     "num_epochs", "num_inner_epochs", "train_batch_size", "gradient_accumulation_steps",
                     "lora_rank", "checkpointing_epochs", "stat_buffer_size", "stat_min_count", "timestep_batch",
                     "eval_images_per_prompt", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("learning_rate", "clip_range", "adv_clip_max"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"--cpu_threads must be >= 1, got {self.cpu_threads}")
        if not self.kl_coef >= 0:
            raise ConfigError(f"--kl_coef must be >= 0, got {self.kl_coef}")
        if self.guidance_scale < 1:
            raise ConfigError(f"--guidance_scale must be >= 1, got {self.guidance_scale}")
        if self.eval_guidance_scale is not None and not self.eval_guidance_scale >= 1:
            raise ConfigError(f"--eval_guidance_scale must be >= 1, got {self.eval_guidance_scale}")
        if self.stat_min_count > self.stat_buffer_size:
            raise ConfigError(
                f"--stat_min_count ({self.stat_min_count}) must not exceed --stat_buffer_size ({self.stat_buffer_size})"
            )
        if self.sample_batch_size % self.images_per_prompt:
            raise ConfigError(
                f"--sample_batch_size ({self.sample_batch_size}) must be a multiple of --images_per_prompt ({self.images_per_prompt})"
            )
        if self.shared_group_noise and self.images_per_prompt < 2:
            raise ConfigError("--shared_group_noise needs --images_per_prompt >= 2 (a group shares one starting noise)")
        if self.advantage in ("group", "group-mean") and self.images_per_prompt < 2:
            raise ConfigError(f"--advantage {self.advantage} needs --images_per_prompt >= 2 (a group per prompt)")

    @property
    def num_train_timesteps(self) -> int:
        return max(1, int(self.num_inference_steps * self.timestep_fraction))

    @property
    def evaluation_guidance(self) -> float:
        return self.guidance_scale if self.eval_guidance_scale is None else self.eval_guidance_scale

    @property
    def trained_steps_per_sample(self) -> int:
        """Steps of each chain that the update trains: its one noisy step when branching."""
        return 1 if self.branch_sampling else self.num_train_timesteps

    @property
    def branch_window(self) -> int:
        """With branch_sampling: a group branches at one of the first this many steps of the chain."""
        return self.num_train_timesteps if self.timestep_selection == "high_noise" else self.num_inference_steps

    @property
    def num_untrained_timesteps(self) -> int:
        return self.num_inference_steps - self.num_train_timesteps

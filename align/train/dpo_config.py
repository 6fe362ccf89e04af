"""Diffusion-DPO's options: the dataclass behind `align/dpo.py`'s flags and its YAML configs (45 fields;
the options removed after measurements: experiments/notes/removed-options.md).

Defaults follow the paper's recipe (Wallace et al. 2024, official code); configs/testbed_dpo.yaml holds
the settings measured best on the shapes testbed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from align.cli import ConfigError, option
from align.data.pairs import check_pair_file
from align.data.prompt_sets import load_prompt_list
from align.declared import (
    BATCH,
    COUNT,
    COUNT_OR_ZERO,
    GUIDANCE,
    LEARNING_RATE,
    POSITIVE,
    PROMPT_FILES,
    RESOLUTION,
    SAMPLING_STEPS,
    SEED,
    SHARE,
)
from align.train.command import lr_schedules
from align.train.heldout import check_periodic_evaluation
from align.train.options import (
    FINETUNES,
    LORA_RANK_HELP,
    LORA_RANKS,
    HeldOutOptions,
    ModelOptions,
    RunOptions,
)
from align.validation import check_common_inputs

RUN_STORE, NO_STORE = "run", "none"  # --latent_store's two words; anything else is a store folder


@dataclass
class DPOConfig(RunOptions, ModelOptions, HeldOutOptions):
    # Fixed values the shared evaluation reads (not flags; see experiments/notes/removed-options.md).
    eval_seed: ClassVar[int] = 1234  # seed of the first held-out image, the same before, during and after
    num_validation_images: ClassVar[int] = 4  # the report's before/after rows show 4 x this many held-out images

    # --- what to train and on what feedback
    reward: str | None = option(None, "judge that labels fresh generations (AI feedback), e.g. gpt4o, pickscore; "
                                "give this or --dataset", "judge")
    prompts: str = option("parti", "prompts for AI feedback: a prompt set (parti, drawbench, testbed:<n>, ...) or "
                          "a file", "data", path="file", or_name=True, formats=PROMPT_FILES, reads=load_prompt_list)
    dataset: str | None = option(None, "offline preference pairs: a Pick-a-Pic-schema parquet/folder or an HF "
                                 "dataset id; give this or --reward", "data", path="any", or_name=True,
                                 formats=(".parquet",), reads=check_pair_file)
    dataset_split: str = option("train", "split of --dataset", "data")
    max_pairs: int | None = option(None, "cap on the pairs used (None: all)", "data", within=COUNT)
    # --- AI feedback (used with --reward)
    images_per_prompt: int = option(2, "K generations per prompt for the judge to label", "judge", within="[2, 1024]")
    feedback_rounds: int = option(
        1, "> 1: online DPO: the prompts split into this many rounds of max_steps / rounds steps, each round "
        "labelled from the model trained so far (the reference stays the base model)", "judge", within=COUNT)
    # --- output
    output_dir: str = option("runs/dpo", "the run folder (config, metrics, feedback pairs, checkpoints, final "
                             "weights, report)", "output", path="output")
    seed: int = option(0, "seed of generation, pair order, timesteps and noise", "optimisation", within=SEED)
    # --- model and adapter
    finetune: str = option("full", "'full' (the paper: a frozen copy is the reference) or 'lora' (the adapter "
                           "off is the reference)", "model", choices=FINETUNES)
    lora_rank: int = option(8, LORA_RANK_HELP, "model", within=LORA_RANKS)
    # --- objective (Diffusion-DPO's loss)
    beta: float = option(5000.0, "DPO's β: how tightly the model stays at the reference (the official "
                         "normalisation; diffusers' LoRA script's 2500 is this / 2)", "optimisation", within=POSITIVE)
    # --- optimisation (paper: 16 GPUs x 1 pair x 128 accumulation = 2048 pairs per step)
    learning_rate: float = option(1e-8, "AdamW learning rate per pair, multiplied by the pairs per step when "
                                  "--scale_lr (the paper: 1e-8 x 2048); β 0.9 / 0.999, ε 1e-8", "optimisation",
                                  within=LEARNING_RATE)
    scale_lr: bool = option(True, "multiply --learning_rate by the pairs per optimiser step (the official code)",
                            "optimisation")
    lr_scheduler: str = option("constant_with_warmup", "diffusers' get_scheduler: constant, constant_with_warmup, "
                               "linear, cosine, ...", "optimisation", choices=lr_schedules)
    lr_warmup_steps: int = option(500, "optimiser steps of learning-rate warm-up", "optimisation", within=COUNT_OR_ZERO)
    train_batch_size: int = option(1, "pairs per process per micro-step", "optimisation", within=BATCH)
    gradient_accumulation_steps: int = option(128, "micro-steps per optimiser step", "optimisation", within=BATCH)
    max_steps: int = option(2000, "optimiser steps in all", "optimisation", within=COUNT)
    # --- data processing
    resolution: int | None = option(512, "training image side in pixels (None: the model's native size)", "data",
                                    within=RESOLUTION)
    random_flip: bool = option(True, "flip training images horizontally at random", "data")
    caption_dropout: float = option(0.2, "share of captions replaced by '' (keeps classifier-free guidance "
                                    "working)", "data", within=SHARE)
    dataloader_num_workers: int = option(0, "DataLoader worker processes that decode, crop and flip the images (or "
                                         "read the latent store); 0: in the training process", "data",
                                         within="[0, 1024]")
    latent_store: str = option(
        "run", "where the pairs' latents and text conditioning come from: 'run' (encoded once, both flips, into the run "
        "folder's latents/), a store folder (python -m align.precompute; with --dataset a missing one is built there "
        "first), or 'none' (the images decoded and encoded at every step)", "data", path="output", or_name=True)
    # --- sampling (feedback, before/after evaluation)
    num_inference_steps: int | None = option(None, "sampling steps of every generation (DDIM; flow families: their "
                                             "Euler scheduler; None: the testbed's settings file if any, else 50)",
                                             "sampling", within=SAMPLING_STEPS)
    guidance_scale: float | None = option(None, "classifier-free guidance of every generation (None: the "
                                          "model's testbed.json if any, else 7.5)", "sampling", within=GUIDANCE)
    # --- checkpoints, evaluation
    checkpointing_steps: int = option(500, "save a resumable checkpoint every N optimiser steps", "output", within=COUNT)
    eval_every_steps: int = option(0, "> 0: also score the held-out prompts every N steps (evals/, the report's "
                                   "held-out curve)", "evaluation", within=COUNT_OR_ZERO)
    allow_tf32: bool = option(False, "TF32 tensor cores for fp32 matmuls on Ampere+ GPUs (faster, slightly less exact)",
                              "optimisation")

    @property
    def store_folder(self) -> str | None:
        """The store folder --latent_store names (None for 'run' and 'none')."""
        return None if self.latent_store in (RUN_STORE, NO_STORE) else self.latent_store

    def validate(self) -> None:
        """Cheap checks, before any model or judge is loaded."""
        check_common_inputs(self)  # every value against its declaration: types, ranges, choices, paths, what applies
        if bool(self.reward) == bool(self.dataset or self.store_folder):
            raise ConfigError("give exactly one of --reward (AI feedback on --prompts) or --dataset/--latent_store (offline pairs)")
        self.check_run_options()
        self.check_model_options()
        self.check_held_out_options()

        if self.max_steps % self.feedback_rounds:
            raise ConfigError(
                f"--max_steps ({self.max_steps}) must be a multiple of --feedback_rounds ({self.feedback_rounds})"
            )
        if self.feedback_rounds > 1 and not self.reward:
            raise ConfigError("--feedback_rounds > 1 needs --reward: online rounds label the model's own generations")
        check_periodic_evaluation("eval_every_steps", self.eval_every_steps, self.eval_prompts, self.eval_judge or self.reward)

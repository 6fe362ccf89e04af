"""The online-RL trainer's options: the dataclass behind `align/ddpo.py`'s flags and its YAML configs.

``--algorithm ppo`` (the default) is DDPO (Black et al. 2023) as released in ddpo-pytorch on DDIM families (SD 1.x/2.x,
SDXL) and Flow-GRPO (Liu et al. 2025) as its authors run it on flow-matching families (SD3, FLUX); ``nft`` is
DiffusionNFT (Zheng et al. 2025) and ``awm`` Advantage Weighted Matching (Xue et al. 2025), on every family. The
sampler options left unset (``None``) take the family's and the algorithm's value in ``resolve_for_family``.
configs/testbed_ddpo.yaml holds the settings measured best on the shapes testbed
(experiments/notes/removed-options.md lists the options removed after measurements showed they did not help).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from align.cli import ConfigError, option
from align.train.advantages import MODES
from align.train.heldout import check_periodic_evaluation
from align.train.options import HeldOutOptions, ModelOptions, RunOptions
from align.validation import check_common_inputs, check_optimiser_ranges

TIMESTEP_SELECTIONS = ("random", "high_noise", "stratified")
ALGORITHMS = ("ppo", "nft", "awm")
SAMPLERS = ("ddim", "sde", "cps", "ode", "dpm2")
OLD_POLICY_DECAYS = ("none", "linear-0.5", "delayed-linear-0.999")
AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
# Sampler defaults per kind of family. DDIM: the DDPO paper (50 steps, η 1), evaluated with the same sampler.
# Flow: Flow-GRPO's configs (config/grpo.py: sample.num_steps 10, eval_num_steps 40, noise_level 0.7).
DDIM_DEFAULTS = {"num_inference_steps": 50, "eta": 1.0}
FLOW_DEFAULTS = {"num_inference_steps": 10, "eval_inference_steps": 40, "eta": 0.7}


@dataclass
class DDPOConfig(RunOptions, ModelOptions, HeldOutOptions):
    # --- what to train and with which reward
    algorithm: str = option("ppo", "ppo: PPO-clip on the sampled steps' log-probabilities (DDPO on SD 1.x/2.x and SDXL, "
                            "Flow-GRPO on SD3/FLUX); nft: DiffusionNFT (the forward process, an implicit positive and "
                            "negative policy); awm: Advantage Weighted Matching", "optimisation")
    reward: str = option("aesthetic", "the reward: a judge name, name[opt=value], or a weighted mix such as "
                         "pickscore:0.7,aesthetic:0.3", "judge")
    prompts: str | None = option(None, "training prompts (required): a text file, a dataset column, or "
                                 "testbed:<n>[:<seed>]", "data")
    # --- output
    output_dir: str = option("runs/ddpo", "the run folder (config, metrics, checkpoints, final weights, report)", "output")
    seed: int = option(0, "seed of the sampling noise, prompt draws and timestep order", "optimisation")
    # --- model and adapter
    finetune: str = option("lora", "'lora' (the paper) or 'full' (every UNet weight)", "model")
    # --- sampling (DDPO paper: 50 DDIM steps, η = 1, guidance 5; Flow-GRPO: 10 SDE steps, a = 0.7, 40 to evaluate)
    num_inference_steps: int | None = option(
        None, "denoising steps of the training sampler (None: 50 for DDIM families, the DDPO paper; 10 for "
        "flow families, Flow-GRPO)", "sampling")
    eval_inference_steps: int | None = option(
        None, "steps of the held-out evaluation sampler, the pipeline's own (None: --num_inference_steps for "
        "DDIM families; 40 for flow families, as Flow-GRPO evaluates)", "evaluation")
    guidance_scale: float = option(5.0, "classifier-free guidance of sampling, training and the held-out "
                                   "evaluation (the DDPO paper: 5; Flow-GRPO on SD3.5: 4.5; FLUX.1-dev: the "
                                   "guidance embedding's value)", "sampling")
    eta: float | None = option(
        None, "noise of the training sampler, > 0 (a deterministic step has no log-probability): DDIM's η for "
        "DDIM families (None: 1, the paper; testbed: 0.7); for flow families the SDE noise level a of Flow-GRPO, "
        "step std a·√(σ/(1-σ))·√Δσ (None: 0.7, the authors')", "sampling")
    sampler: str | None = option(
        None, "the training sampler: ddim (stochastic DDIM, DDIM families), sde (Flow-GRPO's SDE) or cps (Flow-CPS, the "
        "Flow-GRPO authors' current Fast configs) for flow families, ode (deterministic: Euler / DDIM eta 0; no "
        "log-probabilities), dpm2 (flow: DiffusionNFT's deterministic DPM-Solver++(2M)). None: ddim or sde for ppo, ode "
        "for nft and awm", "sampling")
    resolution: int | None = option(None, "image side in pixels (None: the model's native size)", "sampling")
    samples_per_epoch: int = option(256, "samples drawn per epoch over all processes (the paper: 256)", "sampling")
    sample_batch_size: int = option(8, "images per process per sampling batch", "sampling")
    images_per_prompt: int = option(1, "images drawn per prompt in a batch (>= 2 for group advantages or "
                                    "pairwise judges)", "sampling")
    # --- advantages
    advantage: str = option("per-prompt", "per-prompt (DDPO's stat tracking), group (GRPO), global-std (the group's "
                            "mean, the std of the whole batch: Flow-GRPO's and DiffusionNFT's global_std), group-mean "
                            "(Dr. GRPO: no std division) or batch", "optimisation")
    drop_zero_advantage: bool | None = option(
        None, "leave samples whose advantage is exactly 0 (tied groups) out of the update and average it over the rest, "
        "as Flow-GRPO's train_sd3.py (None: on for flow families with ppo, off otherwise: DDPO keeps them)", "optimisation")
    # --- AWM
    awm_weighting: str = option("ghuber", "AWM's weighting of the flow-matching error: uniform, t, t2, huber or ghuber "
                                "(generalised Huber, the authors' recipes)", "optimisation")
    awm_ghuber_power: float = option(0.25, "the generalised Huber's power p (the authors: 0.25)", "optimisation")
    ema_kl_coef: float = option(1.0, "AWM: weight of the KL to the old (EMA) policy (the authors' ema_beta: 1)",
                                "optimisation")
    # --- DiffusionNFT
    nft_beta: float = option(1.0, "DiffusionNFT's beta: how far the implicit positive/negative policies sit from the old "
                             "policy (the authors: 1.0; 0.1 for OCR)", "optimisation")
    old_policy_decay: str = option("linear-0.5", "DiffusionNFT's old (sampling) policy, an average of the trained "
                                   "weights updated each epoch with decay: none (0: the trained weights), linear-0.5 "
                                   "(min(0.001 x step, 0.5), the authors' default), delayed-linear-0.999 (0 for 75 steps, "
                                   "then +0.0075 a step up to 0.999, their OCR recipe)", "optimisation")
    # --- objective (paper: PPO-clip, no KL)
    clip_range: float = option(1e-4, "PPO clip range of the probability ratio (the paper: 1e-4)", "optimisation")
    adv_clip_max: float = option(5.0, "advantages are clipped to [-this, this]", "optimisation")
    kl_coef: float = option(0.0, "> 0 adds kl_coef x KL(step ‖ reference step) (Flow-GRPO's beta: 0.04 / 0.01; "
                            "flow families use the authors' form, mean((μ-μ_ref)²)/(2s²)); the reference is the "
                            "adapter off (LoRA) or a frozen copy", "optimisation")
    timestep_fraction: float = option(1.0, "share of the denoising steps trained per sample, in (0, 1] (Flow-GRPO: "
                                      "0.99, 9 of 10 steps); with --deterministic_tail also the size of the "
                                      "stochastic window", "optimisation")
    timestep_selection: str = option(
        "random", "which steps are trained: random (the paper: a random subset per sample), high_noise (the "
        "first, noisiest steps, where layout and counts are decided; Flow-GRPO trains the first steps) or stratified "
        "(one step in each of k equal strata of the first 90% of the steps, AWM's draw). With "
        "--deterministic_tail on a flow family: where the window sits, high_noise at the start, random drawn per "
        "sampling batch within the first half of the steps (Flow-GRPO-Fast)", "optimisation")
    deterministic_tail: bool = option(
        False, "stochastic steps only where trained, deterministic (η = 0 / the ODE) elsewhere, as the evaluation "
        "sampler: DDIM families with high_noise (MixGRPO's tail); flow families: Flow-GRPO-Fast's window of "
        "--timestep_fraction of the steps, only the window trained", "sampling")
    timestep_batch: int = option(1, "trained timesteps per UNet call: more is faster and takes more memory, "
                                 "the same gradient", "optimisation")
    # --- optimisation (paper: AdamW, lr 3e-4, LoRA)
    num_epochs: int = option(100, "epochs of sampling then one PPO pass over the samples", "optimisation")
    train_batch_size: int = option(4, "samples per process per micro-batch", "optimisation")
    gradient_accumulation_steps: int = option(2, "micro-batches per optimiser step (each spans the trained "
                                              "timesteps)", "optimisation")
    learning_rate: float = option(3e-4, "AdamW learning rate (the paper: 3e-4; β 0.9 / 0.999, ε 1e-8, PyTorch's "
                                  "and every recipe's)", "optimisation")
    adam_weight_decay: float = option(1e-4, "AdamW weight decay", "optimisation")
    # --- checkpoints, samples, evaluation
    checkpointing_epochs: int = option(10, "save a resumable checkpoint every N epochs", "output")
    eval_seed: int = option(1234, "first seed of the held-out images (the same before and after)", "evaluation")
    eval_every_epochs: int = option(0, "> 0: also score the held-out prompts every N epochs (evals/, the "
                                    "report's held-out curve)", "evaluation")

    def validate(self) -> None:
        """Cheap checks, before any model or judge is loaded."""
        check_common_inputs(self)
        check_optimiser_ranges(self)
        self.check_run_options()
        self.check_model_options()
        self.check_held_out_options()
        if not self.prompts:
            raise ConfigError("--prompts is required (a text file, a dataset column, or testbed:<n>)")
        if self.eta is not None and not (self.eta > 0 and math.isfinite(self.eta)):
            raise ConfigError(f"--eta must be > 0 (DDPO samples stochastically; the paper uses 1.0), got {self.eta}")
        if not 0.0 < self.timestep_fraction <= 1.0:
            raise ConfigError(f"--timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        if self.timestep_selection not in TIMESTEP_SELECTIONS:
            raise ConfigError(
                f"--timestep_selection must be one of {', '.join(TIMESTEP_SELECTIONS)}, got {self.timestep_selection!r}"
            )
        check_periodic_evaluation("eval_every_epochs", self.eval_every_epochs, self.eval_prompts, self.eval_judge or self.reward)
        if self.advantage not in MODES:
            raise ConfigError(f"--advantage must be one of {', '.join(MODES)}, got {self.advantage!r}")
        for name in ("num_inference_steps", "eval_inference_steps", "samples_per_epoch", "sample_batch_size",
                     "images_per_prompt", "num_epochs", "train_batch_size", "gradient_accumulation_steps",
                     "checkpointing_epochs", "timestep_batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("learning_rate", "clip_range", "adv_clip_max"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name} must be > 0, got {getattr(self, name)}")
        if not self.kl_coef >= 0:
            raise ConfigError(f"--kl_coef must be >= 0, got {self.kl_coef}")
        if self.guidance_scale < 1:
            raise ConfigError(f"--guidance_scale must be >= 1, got {self.guidance_scale}")
        if self.sample_batch_size % self.images_per_prompt:
            raise ConfigError(
                f"--sample_batch_size ({self.sample_batch_size}) must be a multiple of --images_per_prompt ({self.images_per_prompt})"
            )
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise ConfigError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.old_policy_decay not in OLD_POLICY_DECAYS:
            raise ConfigError(f"--old_policy_decay must be one of {', '.join(OLD_POLICY_DECAYS)}, got {self.old_policy_decay!r}")
        if self.awm_weighting not in AWM_WEIGHTINGS:
            raise ConfigError(f"--awm_weighting must be one of {', '.join(AWM_WEIGHTINGS)}, got {self.awm_weighting!r}")
        if not self.awm_ghuber_power > 0:
            raise ConfigError(f"--awm_ghuber_power must be > 0, got {self.awm_ghuber_power}")
        if not self.ema_kl_coef >= 0:
            raise ConfigError(f"--ema_kl_coef must be >= 0, got {self.ema_kl_coef}")
        if not self.nft_beta > 0:
            raise ConfigError(f"--nft_beta must be > 0, got {self.nft_beta}")
        if self.advantage in ("group", "group-mean", "global-std") and self.images_per_prompt < 2:
            raise ConfigError(f"--advantage {self.advantage} needs --images_per_prompt >= 2 (a group per prompt)")

    def resolve_for_family(self, is_flow: bool) -> None:
        """Fill the sampler options left unset with the family's defaults (DDIM or flow) and check what depends
        on the family; called before anything is written, so the run's config.yaml records the values used."""
        for name, value in (FLOW_DEFAULTS if is_flow else DDIM_DEFAULTS).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.eval_inference_steps is None:
            self.eval_inference_steps = self.num_inference_steps
        if self.sampler is None:
            self.sampler = "ode" if self.algorithm != "ppo" else "sde" if is_flow else "ddim"
        if self.drop_zero_advantage is None:
            self.drop_zero_advantage = is_flow and self.algorithm == "ppo"
        kind = "flow-matching" if is_flow else "DDIM"
        if self.sampler in (("ddim",) if is_flow else ("sde", "cps", "dpm2")):
            raise ConfigError(f"--sampler {self.sampler} is not a sampler of {kind} models (they take "
                              f"{'sde, cps, ode or dpm2' if is_flow else 'ddim or ode'})")
        if self.timestep_selection == "stratified" and self.num_train_timesteps > int(0.9 * self.num_inference_steps):
            raise ConfigError(f"--timestep_selection stratified draws one step in each of {self.num_train_timesteps} "
                              f"strata of the first 90% of the {self.num_inference_steps} steps: lower --timestep_fraction")
        if self.algorithm == "ppo" and self.sampler in ("ode", "dpm2"):
            raise ConfigError("--algorithm ppo needs a stochastic sampler (its steps' log-probabilities): --sampler "
                              f"{'sde or cps' if is_flow else 'ddim'}, or --algorithm nft / awm")
        if self.deterministic_tail and self.algorithm != "ppo":
            raise ConfigError("--deterministic_tail is a window of stochastic steps for --algorithm ppo; nft and awm "
                              "sample with the ODE")
        if self.deterministic_tail and not is_flow and self.timestep_selection != "high_noise":
            raise ConfigError("--deterministic_tail needs --timestep_selection high_noise (the trained steps must be the first ones)")

    @property
    def num_train_timesteps(self) -> int:
        return max(1, int(self.num_inference_steps * self.timestep_fraction))

    @property
    def num_untrained_timesteps(self) -> int:
        return self.num_inference_steps - self.num_train_timesteps

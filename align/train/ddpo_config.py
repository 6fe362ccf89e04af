"""The online-RL trainer's options: the dataclass behind `align/ddpo.py`'s flags and its YAML configs.

The algorithms (``--algorithm``: align/train/objectives/) and samplers (``--sampler``: align/sampling/registry.py) are
plug-ins: this config inherits each algorithm's own options dataclass (its flags, under their own --help section), and
the checks below read the two tables. The sampler options left unset (``None``) take the family's and the algorithm's
values in ``resolve_for_family``.
configs/testbed_ddpo.yaml holds the settings measured best on the shapes testbed
(experiments/notes/removed-options.md lists the options removed after measurements showed they did not help).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from align.cli import ConfigError, option
from align.data.prompt_sets import load_prompt_list
from align.declared import (
    BATCH,
    COEFFICIENT,
    COUNT,
    COUNT_OR_ZERO,
    LEARNING_RATE,
    POSITIVE,
    PROMPT_FILES,
    RESOLUTION,
    SAMPLING_STEPS,
    SEED,
    WEIGHT_DECAY,
)
from align.sampling.registry import SAMPLER_OPTIONS, SAMPLERS, sampler_entry, sampler_names
from align.train.advantages import GROUP_MODES, MODES
from align.train.heldout import check_periodic_evaluation
from align.train.objectives import ALGORITHMS, OPTIONS, algorithm, algorithm_help
from align.train.options import FINETUNES, HeldOutOptions, ModelOptions, RunOptions
from align.validation import check_common_inputs

TIMESTEP_SELECTIONS = ("random", "high_noise", "stratified")
# Sampler defaults per kind of family. DDIM: the DDPO paper (50 steps, η 1), evaluated with the same sampler.
# Flow: Flow-GRPO's configs (config/grpo.py: sample.num_steps 10, eval_num_steps 40, noise_level 0.7).
DDIM_DEFAULTS = {"num_inference_steps": 50, "eta": 1.0}
FLOW_DEFAULTS = {"num_inference_steps": 10, "eval_inference_steps": 40, "eta": 0.7}


def sampler_help() -> str:
    kinds = {False: "DDIM families", True: "flow families"}
    named = "; ".join(f"{name} ({', '.join(f'{kinds[e.flow]}: {e.title}' for e in SAMPLERS if e.name == name)})"
                      for name in sampler_names())
    defaults = ", ".join(f"{a.name}: {a.ddpm_defaults['sampler']} / {a.flow_defaults['sampler']}" for a in ALGORITHMS)
    return (f"the training sampler: {named}. Only the stochastic ones record log-probabilities (what ppo trains on). "
            f"None: the algorithm's own on DDIM / flow families ({defaults})")


@dataclass
class DDPOConfig(RunOptions, ModelOptions, HeldOutOptions, *OPTIONS, *SAMPLER_OPTIONS):
    # --- what to train and with which reward
    algorithm: str = option("ppo", algorithm_help(), "optimisation", choices=lambda: [a.name for a in ALGORITHMS])
    reward: str = option("aesthetic", "the reward: a judge name, name[opt=value], or a weighted mix such as "
                         "pickscore:0.7,aesthetic:0.3", "judge")
    prompts: str | None = option(None, "training prompts (required): a text file, a dataset column, or "
                                 "testbed:<n>[:<seed>]", "data", path="file", or_name=True, formats=PROMPT_FILES,
                                 reads=load_prompt_list)
    # --- output
    output_dir: str = option("runs/ddpo", "the run folder (config, metrics, checkpoints, final weights, report)", "output",
                             path="output")
    seed: int = option(0, "seed of the sampling noise, prompt draws and timestep order", "optimisation", within=SEED)
    # --- model and adapter
    finetune: str = option("lora", "'lora' (the paper) or 'full' (every UNet weight)", "model", choices=FINETUNES)
    # --- sampling (DDPO paper: 50 DDIM steps, η = 1, guidance 5; Flow-GRPO: 10 SDE steps, a = 0.7, 40 to evaluate)
    num_inference_steps: int | None = option(
        None, "denoising steps of the training sampler (None: 50 for DDIM families, the DDPO paper; 10 for "
        "flow families, Flow-GRPO)", "sampling", within=SAMPLING_STEPS)
    eval_inference_steps: int | None = option(
        None, "steps of the held-out evaluation sampler, the pipeline's own (None: --num_inference_steps for "
        "DDIM families; 40 for flow families, as Flow-GRPO evaluates)", "evaluation", within=SAMPLING_STEPS)
    guidance_scale: float = option(5.0, "classifier-free guidance of sampling, training and the held-out "
                                   "evaluation (the DDPO paper: 5; Flow-GRPO on SD3.5: 4.5; FLUX.1-dev: the "
                                   "guidance embedding's value)", "sampling", within="[1, 100]")
    eta: float | None = option(
        None, "noise of the training sampler, > 0 (a deterministic step has no log-probability): DDIM's η for "
        "DDIM families (None: 1, the paper; testbed: 0.7); for flow families the SDE noise level a of Flow-GRPO, "
        "step std a·√(σ/(1-σ))·√Δσ (None: 0.7, the authors')", "sampling", within="(0, 10]")
    sampler: str | None = option(None, sampler_help(), "sampling", choices=sampler_names)
    resolution: int | None = option(None, "image side in pixels (None: the model's native size)", "sampling",
                                    within=RESOLUTION)
    cache_prompt_embeddings: bool = option(False, "encode each training prompt once and keep its conditioning on the "
                                           "CPU (with --offload the text encoders then visit the device only for "
                                           "prompts not seen before)", "sampling")
    samples_per_epoch: int = option(256, "samples drawn per epoch over all processes (the paper: 256)", "sampling",
                                    within=COUNT)
    sample_batch_size: int = option(8, "images per process per sampling batch", "sampling", within=BATCH)
    images_per_prompt: int = option(1, "images drawn per prompt in a batch (>= 2 for group advantages or "
                                    "pairwise judges)", "sampling", within=BATCH)
    group_shared_noise: bool = option(
        False, "every image of a prompt's group starts from the same initial noise, so the group differs only by the "
        "stochastic sampler's noise (DanceGRPO's and MixGRPO's init_same_noise)", "sampling")
    # --- advantages
    advantage: str = option("per-prompt", "per-prompt (DDPO's stat tracking), group (GRPO), global-std (the group's "
                            "mean, the std of the whole batch: Flow-GRPO's and DiffusionNFT's global_std), group-mean "
                            "(Dr. GRPO: no std division), batch, or gdpo (several judges: each normalised within the "
                            "prompt's group before the weighted sum, then the batch; GDPO)", "optimisation",
                            choices=MODES)
    drop_zero_advantage: bool | None = option(
        None, "leave samples whose advantage is exactly 0 (tied groups) out of the update and average it over the rest, "
        "as Flow-GRPO's train_sd3.py (None: on for flow families with ppo, off otherwise: DDPO keeps them)", "optimisation")
    # --- objective (paper: PPO-clip, no KL)
    clip_range: float = option(1e-4, "PPO clip range of the probability ratio (the paper: 1e-4)", "optimisation",
                               within="(0, 10]")
    adv_clip_max: float = option(5.0, "advantages are clipped to [-this, this]", "optimisation", within=POSITIVE)
    kl_coef: float = option(0.0, "> 0 adds kl_coef x KL(step ‖ reference step) (Flow-GRPO's beta: 0.04 / 0.01; "
                            "flow families use the authors' form, mean((μ-μ_ref)²)/(2s²)); the reference is the "
                            "adapter off (LoRA) or a frozen copy", "optimisation", within=COEFFICIENT)
    timestep_fraction: float = option(1.0, "share of the denoising steps trained per sample, in (0, 1] (Flow-GRPO: "
                                      "0.99, 9 of 10 steps); with --deterministic_tail also the size of the "
                                      "stochastic window", "optimisation", within="(0, 1]")
    timestep_selection: str = option(
        "random", "which steps are trained: random (the paper: a random subset per sample), high_noise (the "
        "first, noisiest steps, where layout and counts are decided; Flow-GRPO trains the first steps) or stratified "
        "(one step in each of k equal strata of the first 90% of the steps, AWM's draw). With "
        "--deterministic_tail on a flow family: where the window sits, high_noise at the start, random drawn per "
        "sampling batch within the first half of the steps (Flow-GRPO-Fast)", "optimisation",
        choices=TIMESTEP_SELECTIONS)
    deterministic_tail: bool = option(
        False, "stochastic steps only where trained, deterministic (η = 0 / the ODE) elsewhere, as the evaluation "
        "sampler: DDIM families with high_noise (MixGRPO's tail); flow families: Flow-GRPO-Fast's window of "
        "--timestep_fraction of the steps, only the window trained", "sampling")
    timestep_batch: int = option(1, "trained timesteps per UNet call: more is faster and takes more memory, "
                                 "the same gradient", "optimisation", within=BATCH)
    # --- optimisation (paper: AdamW, lr 3e-4, LoRA)
    num_epochs: int = option(100, "epochs of sampling then one PPO pass over the samples", "optimisation", within=COUNT)
    train_batch_size: int = option(4, "samples per process per micro-batch", "optimisation", within=BATCH)
    gradient_accumulation_steps: int = option(2, "micro-batches per optimiser step (each spans the trained "
                                              "timesteps)", "optimisation", within=BATCH)
    learning_rate: float = option(3e-4, "AdamW learning rate (the paper: 3e-4; β 0.9 / 0.999, ε 1e-8, PyTorch's "
                                  "and every recipe's)", "optimisation", within=LEARNING_RATE)
    adam_weight_decay: float = option(1e-4, "AdamW weight decay", "optimisation", within=WEIGHT_DECAY)
    # --- checkpoints, samples, evaluation
    checkpointing_epochs: int = option(10, "save a resumable checkpoint every N epochs", "output", within=COUNT)
    eval_seed: int = option(1234, "first seed of the held-out images (the same before and after)", "evaluation",
                            within=SEED)
    eval_every_epochs: int = option(0, "> 0: also score the held-out prompts every N epochs (evals/, the "
                                    "report's held-out curve)", "evaluation", within=COUNT_OR_ZERO)

    def validate(self) -> None:
        """Cheap checks, before any model or judge is loaded."""
        check_common_inputs(self)  # every value against its declaration: types, ranges, choices, paths, what applies
        self.check_model_options()
        self.check_held_out_options()
        if not self.prompts:
            raise ConfigError("--prompts is required (a text file, a dataset column, or testbed:<n>)")
        check_periodic_evaluation("eval_every_epochs", self.eval_every_epochs, self.eval_prompts, self.eval_judge or self.reward)
        if self.sample_batch_size % self.images_per_prompt:
            raise ConfigError(
                f"--sample_batch_size ({self.sample_batch_size}) must be a multiple of --images_per_prompt ({self.images_per_prompt})"
            )
        chosen = algorithm(self.algorithm)
        if chosen.options is not None:
            chosen.options.check(self)
        if self.advantage in GROUP_MODES and self.images_per_prompt < 2:
            raise ConfigError(f"--advantage {self.advantage} needs --images_per_prompt >= 2 (a group per prompt)")

    def choice_title(self, flag: str, value: str) -> str | None:
        """The title of a choice whose options another choice refuses (align.declared.check_applies): an algorithm's
        method. Options of another algorithm are refused from their declaration (their group, "--algorithm nft")."""
        return algorithm(value).method.title if flag == "algorithm" else None

    def resolve_for_family(self, is_flow: bool) -> None:
        """Fill the sampler options left unset with the family's defaults (DDIM or flow) and the algorithm's, and check
        what depends on the family; called before anything is written, so the run's config.yaml records the values
        used."""
        for name, value in (FLOW_DEFAULTS if is_flow else DDIM_DEFAULTS).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.eval_inference_steps is None:
            self.eval_inference_steps = self.num_inference_steps
        chosen = algorithm(self.algorithm)
        for name, value in chosen.defaults(is_flow).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        entry = sampler_entry(self.sampler, is_flow)
        if entry is None:
            kind = "flow-matching" if is_flow else "DDIM"
            raise ConfigError(f"--sampler {self.sampler} is not a sampler of {kind} models (they take "
                              f"{', '.join(sampler_names(is_flow))})")
        if self.timestep_selection == "stratified" and self.num_train_timesteps > int(0.9 * self.num_inference_steps):
            raise ConfigError(f"--timestep_selection stratified draws one step in each of {self.num_train_timesteps} "
                              f"strata of the first 90% of the {self.num_inference_steps} steps: lower --timestep_fraction")
        self.check_sampler_options(entry, is_flow)
        stochastic = [e.name for e in SAMPLERS if e.flow == is_flow and e.stochastic]
        without_log_probs = [a.name for a in ALGORITHMS if not a.needs_log_probs]
        if chosen.needs_log_probs and not entry.stochastic:
            raise ConfigError(f"--algorithm {chosen.name} needs a stochastic sampler (its steps' log-probabilities): "
                              f"--sampler {' or '.join(stochastic)}, or --algorithm {' / '.join(without_log_probs)}")
        if self.deterministic_tail and not chosen.needs_log_probs:
            with_log_probs = [a.name for a in ALGORITHMS if a.needs_log_probs]
            raise ConfigError(f"--deterministic_tail is a window of stochastic steps for --algorithm "
                              f"{' / '.join(with_log_probs)}; {' and '.join(without_log_probs)} train on the forward "
                              "process of the final images")
        if self.deterministic_tail and not is_flow and self.timestep_selection != "high_noise":
            raise ConfigError("--deterministic_tail needs --timestep_selection high_noise (the trained steps must be the first ones)")

    def check_sampler_options(self, entry, is_flow: bool) -> None:
        """The chosen sampler's own options checked, another sampler's refused in one line (as an algorithm's), and
        what needs a kind of family or a stochastic sampler."""
        chosen = algorithm(self.algorithm)
        if chosen.flow_only and not is_flow:
            raise ConfigError(f"--algorithm {chosen.name} ({chosen.method.title}) trains flow-matching models (SD3, FLUX); "
                              "this model is a DDPM/DDIM one")
        if entry.options is not None:
            entry.options.check(self)
        own = {f.name for f in dataclasses.fields(entry.options)} if entry.options is not None else set()
        for other in SAMPLERS:
            for field in dataclasses.fields(other.options) if other.options is not None else ():
                if field.name not in own and getattr(self, field.name) != field.default:
                    raise ConfigError(f"--{field.name} is an option of --sampler {other.name}; this run samples with "
                                      f"--sampler {self.sampler}: leave it out")
        if self.group_shared_noise and not entry.stochastic:
            raise ConfigError(f"--group_shared_noise with the deterministic --sampler {self.sampler} would draw one image "
                              "per group: use a stochastic sampler")

    @property
    def num_train_timesteps(self) -> int:
        return max(1, int(self.num_inference_steps * self.timestep_fraction))

    @property
    def num_untrained_timesteps(self) -> int:
        return self.num_inference_steps - self.num_train_timesteps

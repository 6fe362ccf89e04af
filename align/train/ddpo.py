"""Online RL for diffusion and flow models, one trainer: DDPO (Black et al. 2023) on SD 1.x/2.x and SDXL, Flow-GRPO
(Liu et al. 2025) with its Fast window and Flow-CPS on SD3/FLUX, DiffusionNFT (Zheng et al. 2025) and Advantage
Weighted Matching (Xue et al. 2025) on every family, with rewards from any judge in ``rewards``.

    accelerate launch align/ddpo.py --reward aesthetic --prompts prompts.txt                 # DDPO / Flow-GRPO
    accelerate launch align/ddpo.py --config configs/sd35_nft_lora_1gpu.yaml                 # DiffusionNFT
    python align/ddpo.py --config configs/testbed_ddpo.yaml                                  # offline, on a CPU

One epoch, in four files:
    1. sample (align/train/rollout.py): draw prompts and run the sampler the family and --algorithm chose (stochastic
       DDIM, Flow-GRPO's SDE or CPS, with or without a window; the ODE for nft/awm), recording each step;
    2. reward: the judge(s) score the final images in a worker thread while the next batch samples (pairwise-only
       judges give win rates within each prompt's group);
    3. advantages (align/train/advantages.py): over every process's rewards, then each process takes its share;
    4. update: the objective (align/train/policy_gradient.py, nft.py or awm.py) turns the trained steps of a
       micro-batch into a loss; gradients accumulate over the steps and micro-batches of one optimiser step.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from align.api_cost import ddpo_api_plan, guard_on_every_process
from align.cli import ConfigError
from align.data.pairs import DataError
from align.data.prompt_overlap import check_heldout_disjoint
from align.data.prompt_sets import load_prompt_list
from align.families import UnknownFamilyError, family_of, family_of_pipeline
from align.families.base import (
    ModelFamily,
    ModelLoadError,
    expand_conditioning,
    guided_prediction,
    one_line,
    repeat_conditioning,
    select_conditioning,
)
from align.health import images_finite
from align.judges import check_judge_names, check_judges_take_prompts, load_judge
from align.pipeline import (
    add_lora,
    cast_frozen,
    check_model,
    decode_latents,
    disabled_adapter,
    frozen_copy,
    load_pipeline,
    merged_adapter,
)
from align.progress import progress_bar
from align.run_folder import RunFolder, atomic_write_text, restores_old_run_on_failure
from align.sampling.ddim import check_scheduler_steps
from align.train.accelerator import (
    adamw_class,
    end_training,
    keep_default_attention,
    make_accelerator,
    tracker_config,
)
from align.train.advantages import PerPromptStatTracker, compute_advantages
from align.train.awm import AdvantageWeightedMatching, awm_timestep_indices
from align.train.checkpoints import (
    check_resume_settings,
    register_trainable_checkpoint_hooks,
    save_checkpoint,
    save_final_weights,
    start_run,
    stop_unless_weights_finite,
    write_diffusion_model_card,
)
from align.train.command import TrainingStopped, check_config_and_model, keep_judge_answers, run_trainer
from align.train.ddpo_config import DDPOConfig
from align.train.ddpo_order import gathered_slots, global_batch, in_global_order, stratified_order
from align.train.ddpo_rewards import BackgroundRewards, MixedReward, RewardError
from align.train.heldout import (
    evaluate_model,
    periodic_evaluation,
    periodic_evaluation_due,
    require_pointwise_eval_judge,
    save_image_row,
)
from align.train.nft import DiffusionNFT
from align.train.old_policy import OldPolicy
from align.train.policy_gradient import PolicyGradient
from align.train.report import write_training_report
from align.train.rollout import DDIMSampler, FlowSampler, ODESampler, Rollout, TrainBatch, cat_rollouts
from align.train.sharding import (
    consolidated_model,
    full_weights_for_main,
    is_sharded,
    pipeline_device,
    place_frozen_parts,
    shard_frozen,
    use_family_blocks,
)

STATE_FILE = "ddpo_state.json"
STAT_BUFFER_SIZE, STAT_MIN_COUNT = 32, 16  # --advantage per-prompt: ddpo-pytorch's per-prompt stat tracking
LOGGED_IMAGES = 8  # training images (with their rewards) saved under samples/ at each checkpoint epoch


def check_inputs(config: DDPOConfig) -> None:
    """Every bad input that can be found without loading a model or calling a judge."""
    check_config_and_model(config)
    check_judge_names((config.reward, config.eval_judge), "--reward/--eval_judge", allow_mix=True)
    for spec in filter(None, (config.prompts, config.eval_prompts)):
        try:
            if not load_prompt_list(spec):
                raise ConfigError(f"prompt source {spec!r} holds no prompts")
        except DataError as err:
            raise ConfigError(str(err)) from None
    check_heldout_disjoint(config.prompts, config.eval_prompts)


def resolve_family(config: DDPOConfig) -> ModelFamily:
    """The model's family (from its model_index.json, before any weight loads); fills the sampler options
    left unset with that family's and algorithm's defaults (DDIM: the DDPO paper's; flow: Flow-GRPO's)."""
    try:
        family = family_of(check_model(config.model))
    except ModelLoadError:
        raise
    except (UnknownFamilyError, OSError, ValueError) as err:
        raise ModelLoadError(f"--model {config.model!r}: {one_line(err)}") from None
    config.resolve_for_family(family.is_flow)
    return family


def check_batch_sizes(config: DDPOConfig, num_processes: int) -> int:
    """Sampling batches per process per epoch; the epoch must split into whole batches and optimiser steps."""
    per_round = config.sample_batch_size * num_processes
    if config.samples_per_epoch % per_round:
        raise ConfigError(
            f"--samples_per_epoch ({config.samples_per_epoch}) must be a multiple of --sample_batch_size x processes "
            f"({config.sample_batch_size} x {num_processes} = {per_round})"
        )
    per_process = config.samples_per_epoch // num_processes
    per_update = config.train_batch_size * config.gradient_accumulation_steps
    if per_process % per_update:
        raise ConfigError(
            f"samples per process per epoch ({per_process}) must be a multiple of --train_batch_size x "
            f"--gradient_accumulation_steps ({config.train_batch_size} x {config.gradient_accumulation_steps} = {per_update})"
        )
    return config.samples_per_epoch // per_round


# ----------------------------------------------------------------------------------------------
# Every random draw of epoch e comes from a generator seeded by (seed, e, part, process), so an
# interrupted run resumes exactly without saving sampler or data-loader state.

SAMPLE, TRAIN, NOISE = "sample", "train", "noise"


def epoch_generator(seed: int, epoch: int, part: str, index: int, process: int) -> torch.Generator:
    key = f"{seed}/{epoch}/{part}/{index}/{process}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))


def draw_prompts(prompts: list[str], config: DDPOConfig, gen: torch.Generator) -> list[str]:
    """sample_batch_size prompts: uniform draws (with replacement), each repeated images_per_prompt times (a group)."""
    n = config.sample_batch_size // config.images_per_prompt
    picks = torch.randint(len(prompts), (n,), generator=gen).tolist()
    return [prompts[i] for i in picks for _ in range(config.images_per_prompt)]


# ----------------------------------------------------------------------------------------------
# The sampler and the objective, chosen once from the family and the config


def build_sampler(family: ModelFamily, pipe, config: DDPOConfig, resolution: int, device):
    window = config.num_train_timesteps if config.deterministic_tail else None
    if family.is_flow:
        sigmas = family.flow_sigmas(pipe, config.num_inference_steps, resolution).to(device)
        num_train_timesteps = pipe.scheduler.config.num_train_timesteps
        if config.sampler in ("ode", "dpm2"):
            return ODESampler(config.num_inference_steps, sigmas=sigmas, num_train_timesteps=num_train_timesteps,
                              solver="dpm2" if config.sampler == "dpm2" else "euler")
        return FlowSampler(sigmas, config.eta, kind=config.sampler, window=window,
                           window_at="start" if config.timestep_selection == "high_noise" else "random",
                           num_train_timesteps=num_train_timesteps)
    if config.sampler == "ode":
        return ODESampler(config.num_inference_steps, scheduler=pipe.scheduler)
    check_scheduler_steps(pipe.scheduler, config.num_inference_steps, config.eta)
    return DDIMSampler(pipe.scheduler, config.num_inference_steps, config.eta, stochastic_steps=window)


def build_objective(config: DDPOConfig, sampler):
    if config.algorithm == "nft":
        return DiffusionNFT(sampler, beta=config.nft_beta, adv_clip_max=config.adv_clip_max, kl_coef=config.kl_coef,
                            decay_schedule=config.old_policy_decay)
    if config.algorithm == "awm":
        return AdvantageWeightedMatching.from_config(sampler, config)
    return PolicyGradient(sampler, clip_range=config.clip_range, adv_clip_max=config.adv_clip_max, kl_coef=config.kl_coef)


def method_name(config: DDPOConfig, family: ModelFamily) -> str:
    if config.algorithm == "nft":
        return "DiffusionNFT"
    if config.algorithm == "awm":
        return "AWM"
    return "Flow-GRPO" if family.is_flow else "DDPO"


PAPERS = {"DDPO": "Black et al. 2023", "Flow-GRPO": "Liu et al. 2025", "DiffusionNFT": "Zheng et al. 2025",
          "AWM": "Xue et al. 2025"}


class PolicyModels:
    """The denoiser as the objectives see it: the trained policy (with gradient, through accelerate's wrapper), the
    reference (the adapter off, or a frozen copy) and the old policy (DiffusionNFT, AWM), each as the guided
    prediction the sampler uses."""

    def __init__(self, family: ModelFamily, denoiser, trained, reference, old: OldPolicy | None, guidance_scale: float,
                 autocast, samples_with_old_policy: bool = False, merge_lora: bool = False):
        self.family, self.denoiser, self.trained, self.reference = family, denoiser, trained, reference
        self.old, self.guidance_scale, self.autocast = old, guidance_scale, autocast
        self.samples_with_old_policy, self.merge_lora = samples_with_old_policy, merge_lora

    def predict(self, latents, timesteps, cond, uncond, which: str = "policy") -> torch.Tensor:
        def guided(model):
            with self.autocast():
                return guided_prediction(self.family, model, latents, timesteps, cond, uncond, self.guidance_scale)

        if which == "policy":
            return guided(self.trained)
        with torch.no_grad():
            if which == "old":
                with self.old.swapped_in():
                    return guided(self.denoiser)
            if self.reference is not None:
                return guided(self.reference)
            with disabled_adapter(self.denoiser):
                return guided(self.denoiser)

    @contextlib.contextmanager
    def sampling(self):
        """The policy that samples: the old one where the objective keeps one, else the trained one; with LoRA folded
        into the weights when that computes what the training forward does (``merge_lora``)."""
        with self.old.swapped_in() if self.samples_with_old_policy else contextlib.nullcontext():
            with merged_adapter(self.denoiser) if self.merge_lora else contextlib.nullcontext():
                yield self.denoiser


def sampling_merges_lora(config: DDPOConfig, accelerator=None) -> bool:
    """Sample with the LoRA folded into the weights (~12% faster on the testbed) when that computes what the
    training forward does: in fp32 up to rounding; not under fp16/bf16 (the rounding differs, the first
    minibatch would be off-policy and PPO would clip it), nor under FSDP2 (the weights are shards between forwards)."""
    return config.mixed_precision == "no" and not (accelerator is not None and is_sharded(accelerator))


# ----------------------------------------------------------------------------------------------
# 1-2. Sample, reward


@torch.no_grad()
def collect_rollouts(pipe, family, models: PolicyModels, sampler, config, prompts, negative, epoch, process,
                     num_batches, background, latent_shape, resolution, num_processes=1):
    """Sample num_batches batches; rewards are computed in the background as each batch finishes."""
    rollouts, futures = [], []
    with models.sampling() as denoiser:
        for b in range(num_batches):
            # keyed by the global batch: N processes draw what one process with N times the batches draws
            gen = epoch_generator(config.seed, epoch, SAMPLE, global_batch(b, process, num_processes), 0)
            batch_prompts = draw_prompts(prompts, config, gen)
            cond = family.encode_prompts(pipe, batch_prompts, resolution)
            embeds = cond["prompt_embeds"]
            noise = torch.randn((len(batch_prompts), *latent_shape), generator=gen).to(embeds.device, embeds.dtype)
            uncond = expand_conditioning(negative, len(batch_prompts))

            def predict(x, t, cond=cond, uncond=uncond):
                return guided_prediction(family, denoiser, x, t, cond, uncond, config.guidance_scale)

            steps = sampler.run(predict, noise, gen)
            images = decode_latents(pipe, steps["final_latents"]).cpu()  # the family's decoder
            futures.append(background.submit(batch_prompts, images))
            rollouts.append(Rollout(prompts=batch_prompts, cond=cond, images=images, **steps))
    return rollouts, futures


def gather_rewards(accelerator, futures) -> tuple[torch.Tensor | None, dict[str, float], str | None]:
    """Wait for this process's rewards; every process learns whether any judge failed anywhere."""
    error, rewards, parts = None, [], {}
    for future in futures:
        try:
            total, members = future.result()
        except RewardError as err:
            error = str(err)
            break
        rewards.append(total)
        for name, values in members.items():
            parts.setdefault(name, []).append(values)
    failed = accelerator.gather(torch.tensor([1.0 if error else 0.0], device=accelerator.device)).max()
    if failed > 0:
        return None, {}, error or "a judge failed on another process"
    means = {f"reward_{n}": float(accelerator.gather(torch.cat(v).to(accelerator.device)).mean()) for n, v in parts.items()}
    return torch.cat(rewards), means, None


# ----------------------------------------------------------------------------------------------
# 4. The update


@dataclass
class Update:
    """What an epoch's update needs, built once per run."""

    config: DDPOConfig
    accelerator: object
    models: PolicyModels
    objective: object
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]


@dataclass
class EpochPlan:
    """The epoch's draws for this process: the order samples are trained in, each sample's trained steps (indices into
    its recorded steps) and, for forward-process objectives, the noise of each trained step."""

    order: torch.Tensor  # [n]
    steps: torch.Tensor  # [n, k]
    noise: torch.Tensor | None  # [n, k, C, H, W]


def train_timestep_indices(n: int, steps_total: int, k: int, selection: str, gen: torch.Generator) -> torch.Tensor:
    """[n, k] indices into each sample's recorded steps: a random subset per sample, the k noisiest steps, or one in
    each of k strata of the first 90% (AWM's draw, per sample here; the authors share it within a micro-batch)."""
    if selection == "stratified":
        return torch.stack([awm_timestep_indices(steps_total, k, gen) for _ in range(n)])
    if selection == "high_noise":
        # Sampling runs from high to low noise: the first k steps of the chain, in random order.
        return torch.stack([torch.randperm(k, generator=gen) for _ in range(n)])
    return torch.stack([torch.randperm(steps_total, generator=gen) for _ in range(n)])[:, :k]


def plan_epoch(config: DDPOConfig, rollout: Rollout, epoch: int, process: int, num_processes: int, num_batches: int,
               forward_noise: bool) -> EpochPlan:
    """Drawn from one generator per sampling batch, keyed by the global batch (ddpo_order.py), so that N processes
    train what one process with N times the accumulation trains."""
    keys = [global_batch(b, process, num_processes) for b in range(num_batches)]
    gens = [epoch_generator(config.seed, epoch, TRAIN, key, 0) for key in keys]
    k = min(config.num_train_timesteps, rollout.timesteps.shape[1])
    order, steps = stratified_order(gens, config.sample_batch_size, functools.partial(
        train_timestep_indices, config.sample_batch_size, rollout.timesteps.shape[1], k, config.timestep_selection))
    noise = None
    if forward_noise:
        shape = (config.sample_batch_size, k, *rollout.final_latents.shape[1:])
        noise = torch.cat([torch.randn(shape, generator=epoch_generator(config.seed, epoch, NOISE, key, 0)) for key in keys])
        noise = noise.to(rollout.final_latents.device, rollout.final_latents.dtype)
    return EpochPlan(order, steps, noise)


def update_members(update: Update, members: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(the samples of one optimiser step that go through the model, the divisor of the step's summed per-sample loss
    on this process).

    Without --drop_zero_advantage every sample counts (divisor: the samples per step); a sample whose advantage is 0
    and whose loss is then exactly 0 (PPO without KL) is skipped, which changes nothing but the time. With it, the
    zero-advantage samples are left out and the step is averaged over the rest, counted over every process, so that N
    processes still equal one. A process left with no sample keeps one with weight 0, so that it still takes the
    step's synchronising backward (DDP all-reduces there).
    """
    config, accelerator = update.config, update.accelerator
    per_update = len(members)
    informative = members[advantages[members] != 0]
    if config.drop_zero_advantage:
        kept = torch.tensor([float(len(informative))], device=accelerator.device)
        total = float(accelerator.reduce(kept, "sum")) if accelerator.num_processes > 1 else float(kept)
        divisor = total / accelerator.num_processes
        return (informative, divisor) if len(informative) else (members[:1], float("inf"))
    if update.objective.zero_advantage_is_zero_loss:
        return (informative if len(informative) else members[:1]), per_update
    return members, per_update


def train_epoch(update: Update, rollout: Rollout, advantages: torch.Tensor, plan: EpochPlan, negative,
                stats: dict[str, list[float]]) -> int:
    """One pass over this epoch's rollouts; returns the number of optimiser steps taken."""
    config = update.config
    per_update = config.train_batch_size * config.gradient_accumulation_steps
    updates = 0
    for u0 in range(0, len(plan.order), per_update):
        members, divisor = update_members(update, plan.order[u0 : u0 + per_update], advantages)
        stats.setdefault("trained_sample_fraction", []).append(len(members) / per_update if divisor != float("inf") else 0.0)
        micro_batches = list(members.split(config.train_batch_size))
        counted = len(micro_batches)
        micro_batches += [members[:1]] * (micro_batches_on_every_process(update.accelerator, counted) - counted)
        for m, idx in enumerate(micro_batches):
            train_micro_batch(update, rollout, advantages, plan, negative, idx, divisor if m < counted else float("inf"),
                              stats, last_of_update=m == len(micro_batches) - 1, recorded=m < counted)
        if config.max_grad_norm > 0:
            update.accelerator.clip_grad_norm_(update.params, config.max_grad_norm)
        update.optimizer.step()
        update.optimizer.zero_grad(set_to_none=True)
        updates += 1
    return updates


def micro_batches_on_every_process(accelerator, count: int) -> int:
    """How many micro-batches this process runs in an optimiser step: its own, or under FSDP2 the most any process
    has (the others add weight-0 ones), since every forward there all-gathers the weights with every process."""
    if not is_sharded(accelerator):
        return count
    return int(accelerator.gather(torch.tensor([count], device=accelerator.device)).max())


def train_micro_batch(update: Update, rollout: Rollout, advantages, plan: EpochPlan, negative, idx, divisor: float,
                      stats, last_of_update: bool, recorded: bool = True) -> None:
    """Forward and backward of the samples ``idx`` at their trained steps, ``timestep_batch`` steps per model call
    (flattened into the batch, sample-major). Each chunk's loss is its rows' mean, weighted so that the step's gradient
    is the sum over its samples' per-step losses divided by (k x divisor): one-step-at-a-time accumulation, exactly."""
    config, accelerator = update.config, update.accelerator
    device = accelerator.device
    chosen = plan.steps[idx]  # [b, k]
    k = chosen.shape[1]
    rows = idx[:, None]
    sample_cond = select_conditioning(rollout.cond, idx)
    weight_total = 0.0 if divisor == float("inf") else len(idx) / (k * divisor)
    for j0 in range(0, k, config.timestep_batch):
        js = slice(j0, min(j0 + config.timestep_batch, k))
        c = js.stop - js.start
        steps = chosen[:, js]
        batch = TrainBatch(
            latents=rollout.latents[rows, steps].flatten(0, 1),
            next_latents=rollout.next_latents[rows, steps].flatten(0, 1),
            timesteps=rollout.timesteps[rows, steps].flatten().to(device),
            step_indices=rollout.step_indices[rows, steps].flatten(),
            old_log_probs=rollout.log_probs[rows, steps].flatten(),
            advantages=advantages[idx].repeat_interleave(c),
            final_latents=rollout.final_latents[idx].repeat_interleave(c, dim=0),
            noise=plan.noise[rows, j0 + torch.arange(c)].flatten(0, 1) if plan.noise is not None else None,
            cond=repeat_conditioning(sample_cond, c),
            uncond=expand_conditioning(negative, len(idx) * c),
            num_samples=len(idx),
        )
        sync = last_of_update and js.stop == k
        with contextlib.nullcontext() if sync else accelerator.no_sync(update.models.trained):
            loss, metrics = update.objective.loss(update.models, batch)
            if not torch.isfinite(loss):
                raise TrainingStopped(f"non-finite {config.algorithm} loss; stopped before the update (lower --learning_rate)")
            accelerator.backward(loss * (weight_total * c))
        for key, value in ({"loss": loss.detach(), **metrics} if recorded else {}).items():
            stats.setdefault(key, []).append(float(value))


# ----------------------------------------------------------------------------------------------
# The run


@restores_old_run_on_failure
def train(config: DDPOConfig) -> Path:
    """Run the trainer; returns the run folder."""
    from accelerate.utils import gather_object, set_seed

    check_inputs(config)
    family = resolve_family(config)
    run = RunFolder(config.output_dir, resume=config.resume, overwrite=config.overwrite)
    check_resume_settings(run, config)  # a resumed run keeps its settings (or is refused in one line)
    log_with = None if config.report_to == "none" else config.report_to
    accelerator, config.mixed_precision = make_accelerator(  # the flag, else accelerate's setting; recorded resolved
        config.mixed_precision, "ddpo", shardable=True, log_with=log_with, project_dir=str(run.path))
    main, process = accelerator.is_main_process, accelerator.process_index
    num_batches = check_batch_sizes(config, accelerator.num_processes)
    method = method_name(config, family)

    # The judges and prompts before anything is written or generated: a missing API key stops us here,
    # and with --overwrite the old run is still whole.
    reward_fn = MixedReward(config.reward, loader=load_judge)
    if reward_fn.needs_groups and config.images_per_prompt < 2:
        raise ConfigError(
            f"--reward {config.reward!r} has a pairwise-only judge: rewards are win rates within a prompt's group, "
            "so --images_per_prompt must be >= 2"
        )
    eval_judge = None
    if main and config.eval_prompts:
        eval_reward = MixedReward(config.eval_judge, loader=load_judge) if config.eval_judge else reward_fn
        require_pointwise_eval_judge(eval_reward.spec, not eval_reward.needs_groups)
        eval_judge = ScoreOnly(eval_reward)
    prompts = load_prompt_list(config.prompts)
    check_judges_take_prompts([reward_fn], prompts, "--prompts")  # a rule judge that cannot parse one stops here
    if eval_judge is not None:
        check_judges_take_prompts([eval_judge.reward], load_prompt_list(config.eval_prompts), "--eval_prompts")
    # The paid judge calls, counted and priced before any is made (refused above --max_api_cost).
    eval_members = eval_judge.reward.members if eval_judge is not None else []  # the main process's only
    eval_prompts = len(load_prompt_list(config.eval_prompts)) if eval_judge is not None else 0
    guard_on_every_process(accelerator, ddpo_api_plan(config, reward_fn.members, eval_members, eval_prompts),
                           config.max_api_cost)

    start_run(accelerator, run, config)
    members = reward_fn.members + (eval_judge.reward.members if eval_judge is not None else [])
    keep_judge_answers([member.judge for member in members], run.path, process)
    set_seed(config.seed)

    # Frozen parts in the compute dtype (full fine-tuning loads the pipeline in float32 for its denoiser, then casts
    # the text encoders and VAE); trainable weights stay in float32.
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.mixed_precision, torch.float32)
    pipe = load_pipeline(config.model, dtype=weight_dtype if config.finetune == "lora" else torch.float32,
                         device=pipeline_device(accelerator))  # FSDP2: the CPU, then each process's shards
    if family_of_pipeline(pipe) is not family:
        raise ConfigError(f"--model {config.model!r} loaded as {family_of_pipeline(pipe).name}, detected as {family.name}")
    place_frozen_parts(accelerator, family, pipe)
    for module in family.frozen_modules(pipe):
        module.requires_grad_(False)
        cast_frozen(module, weight_dtype)
    denoiser = family.denoiser(pipe)  # the UNet (or transformer) that trains
    resolution = config.resolution or family.native_resolution(pipe)
    latent_shape = family.latent_shape(pipe, resolution)
    sampler = build_sampler(family, pipe, config, resolution, accelerator.device)
    objective = build_objective(config, sampler)

    if not family.is_flow:  # SD3/FLUX keep their joint-attention processors
        keep_default_attention(denoiser)
    if config.finetune == "lora":
        add_lora(denoiser, rank=config.lora_rank, alpha=config.lora_alpha, target_modules=family.lora_targets)
        for p in denoiser.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        reference = None  # the same denoiser with the adapter off
    else:
        denoiser.requires_grad_(True)
    use_family_blocks(accelerator, family, denoiser)  # FSDP2's units; nothing without sharding
    if config.finetune == "full":  # sharded like the policy under FSDP2
        reference = shard_frozen(accelerator, frozen_copy(denoiser)) if config.kl_coef > 0 else None
    if config.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    params = [p for p in denoiser.parameters() if p.requires_grad]

    samples_per_process = config.samples_per_epoch // accelerator.num_processes
    updates_per_epoch = samples_per_process // (config.train_batch_size * config.gradient_accumulation_steps)
    if main:
        print(
            f"[ddpo] {method} | samples per epoch: {config.samples_per_epoch} = {config.sample_batch_size} per batch x "
            f"{num_batches} batches x {accelerator.num_processes} processes | images per prompt: {config.images_per_prompt} | "
            f"train batch: {config.train_batch_size} x {config.gradient_accumulation_steps} accumulation x "
            f"{config.num_train_timesteps}/{config.num_inference_steps} timesteps | optimiser steps per epoch: "
            f"{updates_per_epoch} | epochs: {config.num_epochs} | finetune: {config.finetune} "
            f"({sum(p.numel() for p in params):,} trainable parameters) | reward: {config.reward} | "
            f"advantage: {config.advantage} | kl_coef: {config.kl_coef} | family: {family.name} ({sampler.describe()})",
            flush=True,
        )
        if reward_fn.needs_groups:  # what a paid judge will be asked, before it is asked
            per_epoch = config.samples_per_epoch * (config.images_per_prompt - 1) // 2
            print(f"[ddpo] pairwise judge: every pair of a caption's {config.images_per_prompt} images is compared, "
                  f"at least {per_epoch:,} comparisons per epoch ({per_epoch * config.num_epochs:,} in all; more when a "
                  "caption is drawn twice in a batch; API and VLM judges ask each in both image orders)", flush=True)

    optimizer = adamw_class(config.use_8bit_adam)(params, lr=config.learning_rate, weight_decay=config.adam_weight_decay)  # β, ε: PyTorch's
    trained, optimizer = accelerator.prepare(denoiser, optimizer)  # a constant learning rate, as the papers
    params = [p for p in trained.parameters() if p.requires_grad]  # FSDP2 replaced them with their shards
    old_policy = OldPolicy(params, trained) if objective.uses_old_policy else None  # sharded as they are
    register_trainable_checkpoint_hooks(accelerator, config.finetune == "lora")
    if old_policy is not None:
        accelerator.register_for_checkpointing(old_policy)  # resumed with the run
    models = PolicyModels(family, denoiser, trained, reference, old_policy, config.guidance_scale, accelerator.autocast,
                          objective.samples_with_old_policy, merge_lora=sampling_merges_lora(config, accelerator))
    update = Update(config, accelerator, models, objective, optimizer, params)
    tracker = PerPromptStatTracker(STAT_BUFFER_SIZE, STAT_MIN_COUNT)
    negative = family.unconditional(pipe, 1, resolution)  # what the family's pipeline uses without a negative prompt
    # Resume: weights, optimiser, old policy and the reward statistics; the epoch seeds do the rest.
    start_epoch, global_step = 0, 0
    checkpoint = run.resume_checkpoint()
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        state = json.loads((checkpoint / STATE_FILE).read_text())
        start_epoch, global_step = state["epoch"], state["global_step"]
        tracker.load_state_dict(state["tracker"])
        if main:
            run.truncate_metrics(start_epoch)
            print(f"[ddpo] resumed from {checkpoint} at epoch {start_epoch}", flush=True)
    elif config.resume and main:
        run.truncate_metrics(0)
        print("[ddpo] --resume latest: no checkpoint yet, starting from epoch 0", flush=True)
    if log_with:
        accelerator.init_trackers("ddpo", config=tracker_config(config))
    evaluating = bool(config.eval_prompts)  # every process knows; the main one holds the judge
    with full_weights_for_main(accelerator, denoiser, needed=evaluating and start_epoch == 0) as here:
        if here:
            evaluate_model(pipe, eval_judge, config, config.eval_inference_steps, config.guidance_scale,
                           run.path / "eval_before.json", "before")

    background = BackgroundRewards(reward_fn)
    last_good = run.latest_checkpoint()
    progress = progress_bar(range(start_epoch, config.num_epochs), desc="ddpo", unit="epoch", enabled=accelerator.is_local_main_process)
    try:
        for epoch in progress:
            epoch_start, epoch_cpu_start = time.perf_counter(), time.process_time()
            # 1-2. Sample and reward (the judge works on batch b while batch b+1 samples).
            denoiser.eval()
            with accelerator.autocast():
                batches, futures = collect_rollouts(pipe, family, models, sampler, config, prompts, negative, epoch,
                                                    process, num_batches, background, latent_shape, resolution,
                                                    accelerator.num_processes)
            local_rewards, reward_parts, error = gather_rewards(accelerator, futures)
            stop_on_nonfinite_images(accelerator, batches, epoch, last_good)
            if error:
                raise TrainingStopped(
                    f"reward failed at epoch {epoch}: {error}. Stopped before the update; the last good checkpoint is "
                    f"{last_good or 'none (no checkpoint was written yet)'} (continue with --resume latest)"
                )
            sample_seconds, sample_cpu_seconds = time.perf_counter() - epoch_start, time.process_time() - epoch_cpu_start

            # 3. Advantages on every process's rewards, then this process's share.
            rollout = cat_rollouts(batches)
            all_rewards = accelerator.gather(local_rewards.to(accelerator.device)).cpu().double().numpy()
            all_prompts = gather_object(rollout.prompts)
            advantages = in_global_order(lambda p, r: compute_advantages(config.advantage, p, r, tracker), all_prompts, all_rewards,
                                         gathered_slots(accelerator.num_processes, num_batches, config.sample_batch_size))
            advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(accelerator.num_processes, -1)[process]

            # 4. Update on the recorded steps; then the old policy follows the trained one.
            denoiser.train()
            stats: dict[str, list[float]] = {}
            plan = plan_epoch(config, rollout, epoch, process, accelerator.num_processes, num_batches,
                              objective.needs_forward_noise)
            global_step += train_epoch(update, rollout, advantages.to(accelerator.device), plan, negative, stats)
            if old_policy is not None:
                old_policy.update(objective.old_policy_decay(global_step))

            # 5. Log, save samples, checkpoint.
            done = epoch + 1
            stop_unless_weights_finite(params, f"epoch {epoch}", last_good, accelerator)
            logs = {k: float(np.mean(v)) for k, v in stats.items()}
            logs = {k: float(accelerator.reduce(torch.tensor(v, device=accelerator.device), "mean")) for k, v in logs.items()}
            logs.update(reward_parts)
            logs.update({
                "reward_mean": float(all_rewards.mean()), "reward_std": float(all_rewards.std()),
                "epoch": done, "global_step": global_step, "samples_seen": done * config.samples_per_epoch,
                "samples_per_second": config.samples_per_epoch / (time.perf_counter() - epoch_start),
                "sampling_seconds": sample_seconds, "sampling_cpu_seconds": sample_cpu_seconds,
                "epoch_cpu_seconds": time.process_time() - epoch_cpu_start,  # this process, all threads
            })
            if config.advantage == "per-prompt":
                logs.update(tracker.stats())
            due = evaluating and periodic_evaluation_due(config.eval_every_epochs, done, config.num_epochs)
            with full_weights_for_main(accelerator, denoiser, needed=due) as here:
                if here:
                    logs["heldout_score"] = periodic_evaluation(pipe, eval_judge, config, config.eval_inference_steps,
                                                                config.guidance_scale, run.path, done)
            if main:
                run.log(done, logs)
                progress.set_postfix(reward=f"{logs['reward_mean']:.3f}", loss=f"{logs.get('loss', 0):.2e}")
                if done % config.checkpointing_epochs == 0 or done == config.num_epochs or epoch == start_epoch:
                    log_samples(accelerator, run, rollout, local_rewards, LOGGED_IMAGES, done)
            accelerator.log(logs, step=done)
            if done % config.checkpointing_epochs == 0 or done == config.num_epochs:
                last_good = save_ddpo_checkpoint(accelerator, run, done, global_step, tracker, config.checkpoints_total_limit)
    finally:
        background.shutdown()

    # 6. After-evaluation, final weights with their model card (one folder, written as a whole), report.
    #    Each step is redone by --resume latest from the last checkpoint if the run stops before its end.
    accelerator.wait_for_everyone()
    check_weights_in_sync(accelerator, params)
    with full_weights_for_main(accelerator, denoiser, needed=evaluating) as here:
        if here:
            evaluate_model(pipe, eval_judge, config, config.eval_inference_steps, config.guidance_scale,
                           run.path / "eval_after.json", "after")
    final_model = consolidated_model(accelerator, trained)  # every process: FSDP2 gathers the shards onto the main one
    if main:
        save_final_weights(final_model, run.path, config.finetune,
                           lambda final: write_model_card(final, config, run, method, sampler), family=family)
        write_training_report(run.path, title=f"{method}: {config.model}", judge=config.eval_judge or config.reward, step_name="epoch",
                              metric_keys=("reward_mean", "approx_kl", "kl_to_reference", "clipfrac", "policy_loss", "loss"))
        run.let_go_of_old_run()
    reward_fn.close()
    del trained, final_model, optimizer
    end_training(accelerator)
    return run.path


def stop_on_nonfinite_images(accelerator, batches, epoch: int, last_good) -> None:
    """A NaN/inf image sampled on any process (a diverged model) stops every process before the update, as a
    failed reward does."""
    bad = 0.0 if all(images_finite(b.images) for b in batches) else 1.0
    if accelerator.gather(torch.tensor([bad], device=accelerator.device)).max() > 0:
        raise TrainingStopped(
            f"non-finite generated images at epoch {epoch}; stopped before the update. The last good checkpoint is "
            f"{last_good or 'none (no checkpoint was written yet)'} (lower --learning_rate, continue with --resume latest)"
        )


def check_weights_in_sync(accelerator, params) -> None:
    """Every process must end with the same trained weights (else gradients were not all-reduced). Under FSDP2 each
    process holds its own shard of one copy: nothing to compare."""
    if accelerator.num_processes == 1 or is_sharded(accelerator):
        return
    checksum = torch.stack([p.detach().double().sum() for p in params]).sum().reshape(1)
    sums = accelerator.gather(checksum.to(accelerator.device))
    if not bool((sums == sums[0]).all()):
        raise TrainingStopped(f"trained weights differ across processes ({sums.tolist()}): gradients were not synchronised")
    if accelerator.is_main_process:
        print(f"[ddpo] trained weights identical on all {accelerator.num_processes} processes", flush=True)


# ----------------------------------------------------------------------------------------------
# Checkpoints, samples, model card


class ScoreOnly:
    """A reward (mix) seen as a pointwise judge, for the before/after evaluation."""

    def __init__(self, reward: MixedReward):
        self.reward, self.name = reward, reward.spec

    def score(self, prompts, images) -> torch.Tensor:
        return self.reward(prompts, images)[0]


def save_ddpo_checkpoint(accelerator, run: RunFolder, epoch: int, global_step: int, tracker, keep: int) -> Path:
    """accelerate's state (LoRA or UNet, optimiser, RNG) plus the epoch and the reward statistics
    (ddpo_state.json, inside the checkpoint's manifest)."""
    state = {"epoch": epoch, "global_step": global_step, "tracker": tracker.state_dict()}
    return save_checkpoint(accelerator, run, epoch, keep, extra_files={STATE_FILE: json.dumps(state)})


def log_samples(accelerator, run: RunFolder, rollout: Rollout, rewards: torch.Tensor, count: int, epoch: int) -> None:
    """A row of this process's first images under samples/, with their prompts and rewards beside it."""
    images = rollout.images[:count]
    prompts = rollout.prompts[:count]
    values = rewards[:count].tolist()
    path = run.path / "samples" / f"epoch_{epoch:05d}.png"
    save_image_row(images, path)
    atomic_write_text(path.with_suffix(".json"), json.dumps([{"prompt": p, "reward": r} for p, r in zip(prompts, values)], indent=1))
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.log({"samples": [wandb.Image(img, caption=f"{r:.3f} | {p}") for img, p, r in
                                     zip(images.permute(0, 2, 3, 1).numpy(), prompts, values)]}, step=epoch)
        elif tracker.name == "tensorboard":
            tracker.writer.add_images("samples", images, epoch)


def write_model_card(folder: Path, config: DDPOConfig, run: RunFolder, method: str, sampler) -> None:
    metrics = run.read_metrics()
    first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
    objective = {"ppo": f"PPO clip range {config.clip_range}, advantage clip {config.adv_clip_max}",
                 "nft": f"beta {config.nft_beta}, advantage clip {config.adv_clip_max}, old policy {config.old_policy_decay}",
                 "awm": f"advantage clip {config.adv_clip_max}, clip range {config.clip_range}"}[config.algorithm]
    write_diffusion_model_card(folder, config.model, config.finetune, method, f"{method.lower()}, reinforcement-learning",
                               f"Trained with {method} ({PAPERS[method]}) to maximise the reward `{config.reward}`.", {
        "sampling": f"{sampler.describe()}, guidance {config.guidance_scale}",
        "evaluation sampler": f"the pipeline's own, {config.eval_inference_steps} steps",
        "trained steps per sample": f"{config.num_train_timesteps} ({config.timestep_selection})",
        "epochs x samples": f"{config.num_epochs} x {config.samples_per_epoch}",
        "advantages": config.advantage,
        "objective": f"{objective}, KL coefficient {config.kl_coef}",
        "learning rate": f"{config.learning_rate} (constant)",
        "reward mean, first epoch": f"{first.get('reward_mean', float('nan')):.4f}",
        "reward mean, last epoch": f"{last.get('reward_mean', float('nan')):.4f}",
    })


def main(argv: list[str] | None = None) -> None:
    run_trainer(DDPOConfig, train, argv, __doc__, stopped=(TrainingStopped, RewardError))


if __name__ == "__main__":
    main()

"""Online RL for diffusion and flow models, one trainer for every algorithm of align/train/objectives/ (DDPO, Flow-GRPO
with its Fast window and Flow-CPS, DiffusionNFT, AWM) and every family, with rewards from any judge in ``rewards``.

    accelerate launch align/ddpo.py --reward aesthetic --prompts prompts.txt                 # DDPO / Flow-GRPO
    accelerate launch align/ddpo.py --config configs/sd35_nft_lora_1gpu.yaml                 # DiffusionNFT
    python align/ddpo.py --config configs/testbed_ddpo.yaml                                  # offline, on a CPU

One epoch:
    1. sample (align/train/online_rollouts.py): draw prompts and run the sampler of --sampler (align/sampling/),
       recording each step;
    2. reward: the judge(s) score the final images in a worker thread while the next batch samples (pairwise-only
       judges give win rates within each prompt's group);
    3. advantages (align/train/advantages.py): over every process's rewards, then each process takes its share;
    4. update (align/train/online_update.py): the algorithm's objective turns the trained steps of a micro-batch into
       a loss; gradients accumulate over the steps and micro-batches of one optimiser step.
The run around the epochs (folder, resume, checkpoints, evaluation, report) is align/train/lifecycle.py's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from align.api_cost import ddpo_api_plan, guard_on_every_process
from align.cli import ConfigError
from align.data.pairs import DataError
from align.data.prompt_overlap import check_heldout_disjoint
from align.data.prompt_sets import load_prompt_list
from align.judges import check_judge_names, check_judges_take_prompts, load_judge
from align.run_folder import RunFolder, restores_old_run_on_failure
from align.sampling.registry import sampler_entry
from align.train.accelerator import adamw_class, launched_processes
from align.train.advantages import PerPromptStatTracker, normalises_each_reward
from align.train.checkpoints import stop_unless_weights_finite, write_diffusion_model_card
from align.train.command import TrainingStopped, check_config_and_model, run_trainer, way_on
from align.train.ddpo_config import DDPOConfig
from align.train.ddpo_rewards import BackgroundRewards, MixedReward, RewardError
from align.train.epoch_outcome import EpochOutcome
from align.train.heldout import HeldOutCheck, require_pointwise_eval_judge
from align.train.lifecycle import TrainingRun
from align.train.objectives import algorithm
from align.train.objectives.base import Method
from align.train.old_policy import OldPolicy
from align.train.online_rollouts import (
    Sampling,
    collect_rollouts,
    epoch_advantages,
    gather_rewards,
    log_samples,
    stop_on_nonfinite_images,
)
from align.train.online_update import Epoch, Update, plan_epoch, train_epoch
from align.train.policy_models import PolicyModels, sampling_merges_lora
from align.train.report import Curve
from align.train.reward_backprop import BackpropEpochs
from align.train.rollout import cat_rollouts
from align.train.sharding import consolidated_model, is_sharded
from align.train.trained_model import compute_dtype, detect_family, load_for_training, trainable_denoiser

STATE_FILE = "ddpo_state.json"
STAT_BUFFER_SIZE, STAT_MIN_COUNT = 32, 16  # --advantage per-prompt: ddpo-pytorch's per-prompt stat tracking
LOGGED_IMAGES = 8  # training images (with their rewards) saved under samples/ at each checkpoint epoch
REWARD_CURVE = Curve("reward (mean over the epoch's samples)", ("reward_mean",))


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


def check_run(config: DDPOConfig):
    """Everything checkable before anything loads or is written, the options left unset filled with the family's
    and the algorithm's values (so that config.yaml records them); returns the model's family. ``--dry_run`` runs
    this too."""
    check_inputs(config)
    family = detect_family(config.model)
    config.resolve_for_family(family.is_flow)
    check_batch_sizes(config, launched_processes())  # the launch's processes, as the run checks them
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


class ScoreOnly:
    """A reward (mix) seen as a pointwise judge, for the before/after evaluation."""

    def __init__(self, reward: MixedReward):
        self.reward, self.name = reward, reward.spec

    def score(self, prompts, images) -> torch.Tensor:
        return self.reward(prompts, images)[0]


def load_judges(config: DDPOConfig, accelerator):
    """(the reward, the held-out judge on the main process or None, the training prompts): loaded and checked against
    their prompts, and the paid calls priced (refused above --max_api_cost), before anything is written or generated:
    a missing API key stops the run here, and with --overwrite the old run is still whole."""
    reward_fn = MixedReward(config.reward, loader=load_judge, normalise_each=normalises_each_reward(config.advantage))
    if reward_fn.needs_groups and config.images_per_prompt < 2:
        raise ConfigError(
            f"--reward {config.reward!r} has a pairwise-only judge: rewards are win rates within a prompt's group, "
            "so --images_per_prompt must be >= 2"
        )
    eval_judge = None
    if accelerator.is_main_process and config.eval_prompts:
        eval_reward = MixedReward(config.eval_judge, loader=load_judge) if config.eval_judge else reward_fn
        require_pointwise_eval_judge(eval_reward.spec, not eval_reward.needs_groups)
        eval_judge = ScoreOnly(eval_reward)
    prompts = load_prompt_list(config.prompts)
    check_judges_take_prompts([reward_fn], prompts, "--prompts")  # a rule judge that cannot parse one stops here
    eval_members, eval_prompts = [], 0  # the main process's only
    if eval_judge is not None:
        eval_prompts = load_prompt_list(config.eval_prompts)
        check_judges_take_prompts([eval_judge.reward], eval_prompts, "--eval_prompts")
        eval_members, eval_prompts = eval_judge.reward.members, len(eval_prompts)
    guard_on_every_process(accelerator, ddpo_api_plan(config, reward_fn.members, eval_members, eval_prompts),
                           config.max_api_cost)
    return reward_fn, eval_judge, prompts


def describe_run(run: TrainingRun, method: Method, sampler, trainable: int, reward_fn: MixedReward) -> None:
    """The derived batch sizes and settings, printed so that they can be checked, and what a pairwise judge will be
    asked before it is asked."""
    config, processes = run.config, run.accelerator.num_processes
    updates = config.samples_per_epoch // processes // (config.train_batch_size * config.gradient_accumulation_steps)
    run.say(f"{method.title} | samples per epoch: {config.samples_per_epoch} = {config.sample_batch_size} per batch x "
            f"{config.samples_per_epoch // (config.sample_batch_size * processes)} batches x {processes} processes | "
            f"images per prompt: {config.images_per_prompt} | train batch: {config.train_batch_size} x "
            f"{config.gradient_accumulation_steps} accumulation x {config.num_train_timesteps}/{config.num_inference_steps} "
            f"timesteps | optimiser steps per epoch: {updates} | epochs: {config.num_epochs} | finetune: {config.finetune} "
            f"({trainable:,} trainable parameters) | reward: {config.reward} | advantage: {config.advantage} | "
            f"kl_coef: {config.kl_coef} | {sampler.describe()}")
    if reward_fn.needs_groups:
        per_epoch = config.samples_per_epoch * (config.images_per_prompt - 1) // 2
        run.say(f"pairwise judge: every pair of a caption's {config.images_per_prompt} images is compared, at least "
                f"{per_epoch:,} comparisons per epoch ({per_epoch * config.num_epochs:,} in all; more when a caption is "
                "drawn twice in a batch; API and VLM judges ask each in both image orders)")


@restores_old_run_on_failure
def train(config: DDPOConfig) -> Path:
    """Run the trainer; returns the run folder."""
    family = check_run(config)
    entry = algorithm(config.algorithm)
    method = entry.method_for(family.is_flow)
    run = TrainingRun(config, "ddpo", step_name="epoch", shardable=True)
    accelerator, main, process = run.accelerator, run.main, run.accelerator.process_index
    num_batches = check_batch_sizes(config, accelerator.num_processes)
    reward_fn, eval_judge, prompts = load_judges(config, accelerator)
    run.start([m.judge for m in reward_fn.members + (eval_judge.reward.members if eval_judge is not None else [])])

    pipe = load_for_training(run, family, compute_dtype(config.mixed_precision))  # frozen parts: the compute dtype
    resolution = config.resolution or family.native_resolution(pipe)
    sampler = sampler_entry(config.sampler, family.is_flow).build(config, family, pipe, resolution, accelerator.device)
    objective = entry.objective.from_config(sampler, config)
    denoiser, reference, params = trainable_denoiser(run, family, pipe, keep_reference=config.kl_coef > 0)
    describe_run(run, method, sampler, sum(p.numel() for p in params), reward_fn)
    models, optimizer, params = trained_policy(run, family, objective, denoiser, reference, params)
    trained = models.trained
    negative = family.unconditional(pipe, 1, resolution)  # what the family's pipeline uses without a negative prompt
    update = Update(config, accelerator, models, objective, optimizer, params, negative)
    sampling = Sampling(config, pipe, family, sampler, prompts, negative, family.latent_shape(pipe, resolution),
                        resolution, num_batches, process, accelerator.num_processes)
    tracker = PerPromptStatTracker(STAT_BUFFER_SIZE, STAT_MIN_COUNT)
    start_epoch, state = run.resume(STATE_FILE)  # weights, optimiser, old policy, reward statistics; seeds do the rest
    global_step = state.get("global_step", 0)
    if state:
        tracker.load_state_dict(state["tracker"])
    run.init_trackers("ddpo")
    held_out = HeldOutCheck(run, pipe, eval_judge, config.eval_inference_steps, config.guidance_scale,
                            config.eval_every_epochs, config.num_epochs)
    held_out.before(start_epoch)

    epochs = (BackpropEpochs(update, sampling, reward_fn) if entry.samples_with_gradients  # reward backpropagation
              else RolloutEpochs(update, sampling, BackgroundRewards(reward_fn), tracker))
    last_good = update.last_good = run.latest_checkpoint()
    progress = run.progress(start_epoch, config.num_epochs)
    try:
        for epoch in progress:
            epoch_start, epoch_cpu_start = time.perf_counter(), time.process_time()
            # 1-4. Sample, reward, advantages, update (or sample with gradients, score, backpropagate).
            outcome = epochs.run(epoch, last_good, global_step)
            global_step += outcome.steps

            # 5. Log, save samples, checkpoint.
            done = epoch + 1
            stop_unless_weights_finite(params, f"epoch {epoch}", last_good, accelerator)
            logs = epoch_logs(accelerator, config, outcome.stats, outcome.reward_parts, outcome.all_rewards, done,
                              global_step)
            logs.update(samples_per_second=config.samples_per_epoch / (time.perf_counter() - epoch_start),
                        **outcome.timing, epoch_cpu_seconds=time.process_time() - epoch_cpu_start)  # this process
            if config.advantage == "per-prompt":
                logs.update(tracker.stats())
            score = held_out.during(done)
            if score is not None:
                logs["heldout_score"] = score
            run.log(done, logs)
            checkpoint_due = done % config.checkpointing_epochs == 0 or done == config.num_epochs
            if main:
                progress.set_postfix(reward=f"{logs['reward_mean']:.3f}", loss=f"{logs.get('loss', 0):.2e}")
                if checkpoint_due or epoch == start_epoch:
                    log_samples(accelerator, run.path, outcome.shown, outcome.local_rewards, LOGGED_IMAGES, done)
            if checkpoint_due:
                last_good = update.last_good = save_ddpo_checkpoint(run, done, global_step, tracker)
    finally:
        epochs.close()

    # After-evaluation, final weights with their model card (one folder, written as a whole), report. Each is redone
    # by --resume latest from the last checkpoint if the run stops before its end.
    accelerator.wait_for_everyone()
    check_weights_in_sync(accelerator, params)
    held_out.after()
    final_model = consolidated_model(accelerator, trained)  # every process: FSDP2 gathers the shards onto the main one
    run.save_final(final_model, family, lambda final: write_model_card(final, config, run.folder, method, sampler, objective))
    run.report(f"{method.title}: {config.model}", (REWARD_CURVE, *entry.curves), judge=config.eval_judge or config.reward)
    del trained, final_model, optimizer, update, models
    run.end((reward_fn,))
    return run.path


def trained_policy(run: TrainingRun, family, objective, denoiser, reference, params):
    """(the policy as the objective sees it, AdamW at a constant learning rate as the papers, the trainable parameters
    as accelerate prepared them). The old policy, where the algorithm keeps one, is a copy of those parameters (their
    shards under FSDP2) and is checkpointed with the run."""
    config, accelerator = run.config, run.accelerator
    optimizer = adamw_class(config.use_8bit_adam)(params, lr=config.learning_rate, weight_decay=config.adam_weight_decay)
    trained, optimizer = run.prepare(denoiser, optimizer, only_trainable=config.finetune == "lora")
    params = [p for p in trained.parameters() if p.requires_grad]  # FSDP2 replaced them with their shards
    old_policy = OldPolicy(params, trained) if type(objective).keeps_old_policy(config) else None
    if old_policy is not None:
        accelerator.register_for_checkpointing(old_policy)  # resumed with the run
    models = PolicyModels(family, denoiser, trained, reference, old_policy, config.guidance_scale, accelerator.autocast,
                          objective.samples_with_old_policy, merge_lora=sampling_merges_lora(config, accelerator))
    return models, optimizer, params


class RolloutEpochs:
    """Steps 1-4 of the rollout epoch: sample (recording each step), reward in the background while the next batch
    samples, advantages over every process's rewards, the update on the recorded steps; then the old policy, where the
    algorithm keeps one, follows the trained one."""

    def __init__(self, update: Update, sampling: Sampling, background: BackgroundRewards, tracker: PerPromptStatTracker):
        self.update, self.sampling, self.background, self.tracker = update, sampling, background, tracker

    def close(self) -> None:
        self.background.shutdown()

    def run(self, epoch: int, last_good, global_step: int) -> EpochOutcome:
        update, sampling, accelerator = self.update, self.sampling, self.update.accelerator
        config, models, objective = update.config, update.models, update.objective
        start, cpu_start = time.perf_counter(), time.process_time()
        # 1-2. Sample and reward (the judge works on batch b while batch b+1 samples).
        rollout, local_rewards, reward_parts = sample_and_reward(sampling, models, epoch, self.background, accelerator,
                                                                 last_good)
        timing = {"sampling_seconds": time.perf_counter() - start, "sampling_cpu_seconds": time.process_time() - cpu_start}
        # 3. Advantages on every process's rewards, then this process's share.
        all_rewards = accelerator.gather(local_rewards.to(accelerator.device)).cpu().double().numpy()
        advantages = epoch_advantages(sampling, rollout, all_rewards, self.tracker)
        # 4. Update on the recorded steps; then the old policy follows the trained one.
        models.denoiser.train()
        stats: dict[str, list[float]] = {}
        plan = plan_epoch(config, rollout, epoch, sampling.process, sampling.num_processes, sampling.num_batches,
                          objective.needs_forward_noise, objective.trains_whole_groups)
        steps = train_epoch(update, Epoch(rollout, advantages.to(accelerator.device), plan), stats)
        if models.old is not None:
            models.old.update(objective.old_policy_decay(global_step + steps))
        return EpochOutcome(rollout, local_rewards, all_rewards, reward_parts, stats, steps, timing)


def sample_and_reward(sampling: Sampling, models: PolicyModels, epoch: int, background, accelerator, last_good):
    """(the epoch's rollouts on this process, their rewards, the reward's parts averaged over processes). A judge that
    failed or a non-finite image on any process stops every process here, before the update."""
    models.denoiser.eval()
    with accelerator.autocast():
        batches, futures = collect_rollouts(sampling, models, epoch, background)
    local_rewards, reward_parts, error = gather_rewards(accelerator, futures)
    stop_on_nonfinite_images(accelerator, batches, epoch, last_good)
    if error:
        raise TrainingStopped(f"reward failed at epoch {epoch}: {error}. Stopped before the update; {way_on(last_good)}")
    return cat_rollouts(batches), local_rewards, reward_parts


def epoch_logs(accelerator, config: DDPOConfig, stats, reward_parts, all_rewards, done: int, global_step: int) -> dict:
    """The epoch's metrics: the update's statistics averaged over processes, the rewards, the counters."""
    logs = {k: float(np.mean(v)) for k, v in stats.items()}
    logs = {k: float(accelerator.reduce(torch.tensor(v, device=accelerator.device), "mean")) for k, v in logs.items()}
    logs.update(reward_parts)
    logs.update({"reward_mean": float(all_rewards.mean()), "reward_std": float(all_rewards.std()), "epoch": done,
                 "global_step": global_step, "samples_seen": done * config.samples_per_epoch})
    return logs


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


def save_ddpo_checkpoint(run: TrainingRun, epoch: int, global_step: int, tracker) -> Path:
    """accelerate's state (LoRA or UNet, optimiser, old policy, RNG) plus the epoch and the reward statistics
    (ddpo_state.json, inside the checkpoint's manifest)."""
    state = {"epoch": epoch, "global_step": global_step, "tracker": tracker.state_dict()}
    return run.checkpoint(epoch, extra_files={STATE_FILE: json.dumps(state)})


def write_model_card(folder: Path, config: DDPOConfig, run: RunFolder, method: Method, sampler, objective) -> None:
    metrics = run.read_metrics()
    first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
    write_diffusion_model_card(folder, config.model, config.finetune, method.title,
                               f"{method.title.lower()}, reinforcement-learning",
                               f"Trained with {method.title} ({method.paper}) to maximise the reward `{config.reward}`.", {
        "sampling": f"{sampler.describe()}, guidance {config.guidance_scale}",
        "evaluation sampler": f"the pipeline's own, {config.eval_inference_steps} steps",
        "trained steps per sample": f"{config.num_train_timesteps} ({config.timestep_selection})",
        "epochs x samples": f"{config.num_epochs} x {config.samples_per_epoch}",
        "advantages": config.advantage,
        "objective": objective.describe(),
        "learning rate": f"{config.learning_rate} (constant)",
        "reward mean, first epoch": f"{first.get('reward_mean', float('nan')):.4f}",
        "reward mean, last epoch": f"{last.get('reward_mean', float('nan')):.4f}",
    })


def main(argv: list[str] | None = None) -> None:
    run_trainer(DDPOConfig, train, argv, __doc__, stopped=(TrainingStopped, RewardError), check=check_run)


if __name__ == "__main__":
    main()

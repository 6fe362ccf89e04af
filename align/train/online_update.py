"""The update of the online-RL trainer (step 4 of align/train/ddpo.py's epoch): the epoch's plan of trained steps,
the optimiser steps over its samples and the micro-batches of each, whose rows the objective turns into a loss.

Every draw of the plan comes from generators keyed by (seed, epoch, global batch), so N processes train what one
process with N times the accumulation trains (align/train/ddpo_order.py), and a resumed run trains what an
uninterrupted one does.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from align.families.base import Conditioning, expand_conditioning, repeat_conditioning, select_conditioning
from align.train.command import TrainingStopped, way_on
from align.train.ddpo_order import (
    NOISE,
    TRAIN,
    epoch_generator,
    global_batch,
    grouped_order,
    stratified_order,
)
from align.train.objectives.awm import awm_timestep_indices
from align.train.objectives.base import Objective
from align.train.policy_models import PolicyModels
from align.train.rollout import Rollout, TrainBatch
from align.train.sharding import is_sharded


@dataclass
class Update:
    """What an epoch's update needs, built once per run."""

    config: object  # the run's DDPOConfig
    accelerator: object
    models: PolicyModels
    objective: Objective
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    negative: Conditioning  # one row: the unconditional side of guidance
    last_good: object = None  # the run's last good checkpoint, named when a loss stops the run


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


def plan_epoch(config, rollout: Rollout, epoch: int, process: int, num_processes: int, num_batches: int,
               forward_noise: bool, whole_groups: bool = False) -> EpochPlan:
    """Drawn from one generator per sampling batch, keyed by the global batch (ddpo_order.py), so that N processes
    train what one process with N times the accumulation trains. ``whole_groups`` (objectives whose loss couples a
    prompt's images, DGPO): each prompt's images are trained together, at the same steps and with the same noise."""
    keys = [global_batch(b, process, num_processes) for b in range(num_batches)]
    gens = [epoch_generator(config.seed, epoch, TRAIN, key, 0) for key in keys]
    k = min(config.num_train_timesteps, rollout.timesteps.shape[1])
    group = config.images_per_prompt if whole_groups else 1
    draw = functools.partial(train_timestep_indices, config.sample_batch_size // group, rollout.timesteps.shape[1], k,
                             config.timestep_selection)
    if whole_groups:
        order, steps = grouped_order(gens, config.sample_batch_size, group, draw)
    else:
        order, steps = stratified_order(gens, config.sample_batch_size, draw)
    noise = None
    if forward_noise:
        shape = (config.sample_batch_size // group, k, *rollout.final_latents.shape[1:])
        noise = torch.cat([torch.randn(shape, generator=epoch_generator(config.seed, epoch, NOISE, key, 0)) for key in keys])
        noise = noise.repeat_interleave(group, dim=0).to(rollout.final_latents.device, rollout.final_latents.dtype)
    return EpochPlan(order, steps, noise)


@dataclass
class Epoch:
    """One epoch's samples as the update trains them: the rollouts, this process's advantages and the plan."""

    rollout: Rollout
    advantages: torch.Tensor
    plan: EpochPlan


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


def train_epoch(update: Update, epoch: Epoch, stats: dict[str, list[float]]) -> int:
    """One pass over this epoch's rollouts; returns the number of optimiser steps taken."""
    config = update.config
    per_update = config.train_batch_size * config.gradient_accumulation_steps
    updates = 0
    for u0 in range(0, len(epoch.plan.order), per_update):
        members, divisor = update_members(update, epoch.plan.order[u0 : u0 + per_update], epoch.advantages)
        stats.setdefault("trained_sample_fraction", []).append(len(members) / per_update if divisor != float("inf") else 0.0)
        micro_batches = list(members.split(config.train_batch_size))
        counted = len(micro_batches)
        micro_batches += [members[:1]] * (micro_batches_on_every_process(update.accelerator, counted) - counted)
        for m, idx in enumerate(micro_batches):
            train_micro_batch(update, epoch, idx, divisor if m < counted else float("inf"), stats,
                              last_of_update=m == len(micro_batches) - 1, recorded=m < counted)
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


def train_micro_batch(update: Update, epoch: Epoch, idx, divisor: float, stats, last_of_update: bool,
                      recorded: bool = True) -> None:
    """Forward and backward of the samples ``idx`` at their trained steps, ``timestep_batch`` steps per model call
    (flattened into the batch, sample-major). Each chunk's loss is its rows' mean, weighted so that the step's gradient
    is the sum over its samples' per-step losses divided by (k x divisor): one-step-at-a-time accumulation, exactly."""
    config, accelerator = update.config, update.accelerator
    rollout, advantages, plan = epoch.rollout, epoch.advantages, epoch.plan
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
            uncond=expand_conditioning(update.negative, len(idx) * c),
            num_samples=len(idx),
            old_means=rollout.means[rows, steps].flatten(0, 1) if rollout.means is not None else None,
        )
        sync = last_of_update and js.stop == k
        with contextlib.nullcontext() if sync else accelerator.no_sync(update.models.trained):
            loss, metrics = update.objective.loss(update.models, batch)
            if not torch.isfinite(loss):
                raise TrainingStopped(f"non-finite {config.algorithm} loss (a --learning_rate too high?); stopped before "
                                      f"the update. {way_on(update.last_good)}")
            accelerator.backward(loss * (weight_total * c))
        for key, value in ({"loss": loss.detach(), **metrics} if recorded else {}).items():
            stats.setdefault(key, []).append(float(value))

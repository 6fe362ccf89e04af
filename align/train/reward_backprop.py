"""The online-RL trainer's second shape of epoch, for the algorithms that sample WITH gradients: reward backpropagation
(DRaFT-K, DRaFT-LV, AlignProp, ReFL; align/train/objectives/). The rollout epoch records samples and trains on them
later (sample -> reward -> advantages -> update); this one trains on each micro-batch as it is drawn:

    1. sample: the prompts and noise of the micro-batch, the sampler's chain run by the objective with the trained
       model's gradients kept where the algorithm keeps them (align/train/backprop_sampling.py);
    2. score: the latents decoded with gradients and scored by a differentiable judge (rewards/differentiable.py; a
       weighted mix sums its judges' scores);
    3. backpropagate the algorithm's loss of the rewards through the judge, the decoder and the kept steps; gradients
       accumulate over --gradient_accumulation_steps micro-batches, then one optimiser step (AdamW, gradient clipping).

A micro-batch is one sampling batch (--sample_batch_size = --train_batch_size). What the trainer guarantees holds as
for the rollout epoch: every draw of micro-batch b (prompts, noise, the algorithm's random truncation or step) comes
from the generator of its global batch (align/train/ddpo_order.py), so N processes train what one process with N times
the accumulation trains and a resumed run continues exactly; a failed judge, a non-finite image or a non-finite loss on
any process stops every process before its backward; the checkpoints, held-out evaluation, cost guard and report are
the loop's (align/train/ddpo.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from align.cli import ConfigError
from align.families.base import cat_conditioning, expand_conditioning
from align.pipeline import decode_latents
from align.train.command import TrainingStopped, way_on
from align.train.ddpo_order import SAMPLE, epoch_generator, global_batch
from align.train.ddpo_rewards import MixedReward
from align.train.epoch_outcome import EpochOutcome
from align.train.online_rollouts import Sampling, draw_prompts
from align.train.online_update import Update


@dataclass
class SampledImages:
    """A micro-batch's images as the run's samples/ row shows them."""

    prompts: list[str]
    images: torch.Tensor  # [N, 3, H, W] in [0, 1], on the CPU


class DifferentiableReward:
    """Σ weight · score_differentiable over the judges of --reward (loaded, checked and priced with the rest of the run
    as a ``MixedReward``); raw scores, as the rollout epoch's mix."""

    def __init__(self, reward: MixedReward):
        for member in reward.members:
            if not callable(getattr(member.judge, "score_differentiable", None)):
                raise ConfigError(f"--reward {member.name!r} has no differentiable scoring path: reward "
                                  "backpropagation needs one (rewards/differentiable.py)")
        self.members = reward.members

    def __call__(self, prompts: list[str], images: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(rewards [N] float32 with gradients, each judge's scores detached on the CPU)."""
        total, parts = 0.0, {}
        for member in self.members:
            values = member.judge.score_differentiable(prompts, images).float().reshape(-1).to(images.device)
            parts[member.name] = values.detach().cpu()
            total = total + member.weight * values
        return total, parts


def stop_if_any(accelerator, failed: bool, why: str, epoch: int, last_good) -> None:
    """Every process stops together (before the backward that would wait on the others) when one of them failed."""
    flag = torch.tensor([1.0 if failed else 0.0], device=accelerator.device)
    if accelerator.gather(flag).max() > 0:
        raise TrainingStopped(f"{why or 'a failure on another process'} at epoch {epoch}; stopped before the update "
                              f"(a lower --learning_rate may help); {way_on(last_good)}")


class BackpropEpochs:
    """Reward backpropagation's epochs for the loop of align/train/ddpo.py (``run`` as the rollout epoch's)."""

    def __init__(self, update: Update, sampling: Sampling, reward: MixedReward):
        self.update, self.sampling, self.reward = update, sampling, DifferentiableReward(reward)

    def close(self) -> None:
        """Nothing runs in the background."""

    def run(self, epoch: int, last_good, global_step: int) -> EpochOutcome:
        """This process's micro-batches of the epoch, an optimiser step every --gradient_accumulation_steps."""
        update, accelerator = self.update, self.update.accelerator
        per_step = update.config.gradient_accumulation_steps
        update.models.denoiser.train()
        stats: dict[str, list[float]] = {}
        rewards, parts, shown, steps = [], {}, None, 0
        for first in range(0, self.sampling.num_batches, per_step):
            for b in range(first, first + per_step):
                images, batch_rewards, batch_parts = self.micro_batch(epoch, b, b == first + per_step - 1, stats,
                                                                      last_good)
                shown = shown or images
                rewards.append(batch_rewards)
                for name, values in batch_parts.items():
                    parts.setdefault(name, []).append(values)
            if update.config.max_grad_norm > 0:
                norm = accelerator.clip_grad_norm_(update.params, update.config.max_grad_norm)
                stats.setdefault("grad_norm", []).append(float(norm))
            update.optimizer.step()
            update.optimizer.zero_grad(set_to_none=True)
            steps += 1
        local = torch.cat(rewards)
        all_rewards = accelerator.gather(local.to(accelerator.device)).cpu().double().numpy()
        means = {f"reward_{name}": float(accelerator.gather(torch.cat(v).to(accelerator.device)).mean())
                 for name, v in parts.items()}
        return EpochOutcome(shown, local, all_rewards, means, stats, steps)

    def micro_batch(self, epoch: int, b: int, sync: bool, stats, last_good):
        """Sample, score and backpropagate micro-batch ``b`` of this process; returns (its images for the samples row,
        its rewards and each judge's scores per sample: the mean over DRaFT-LV's copies)."""
        sampling, update = self.sampling, self.update
        config, accelerator, models, objective = update.config, update.accelerator, update.models, update.objective
        gen = epoch_generator(config.seed, epoch, SAMPLE, global_batch(b, sampling.process, sampling.num_processes), 0)
        prompts = draw_prompts(sampling.prompts, config, gen)
        cond = sampling.family.encode_prompts(sampling.pipe, prompts, sampling.resolution)
        embeds = cond["prompt_embeds"]
        noise = torch.randn((len(prompts), *sampling.latent_shape), generator=gen).to(embeds.device, embeds.dtype)
        uncond = expand_conditioning(sampling.negative, len(prompts))

        def predict(latents, timesteps):  # copies of the batch (DRaFT-LV) take the batch's conditioning again
            copies = latents.shape[0] // len(prompts)
            return models.predict(latents, timesteps, cat_conditioning([cond] * copies),
                                  cat_conditioning([uncond] * copies))

        with contextlib.nullcontext() if sync else accelerator.no_sync(models.trained):
            with accelerator.autocast():
                latents, metrics = objective.sample(sampling.sampler, predict, noise, gen)
                images = decode_latents(sampling.pipe, latents)  # the family's decoder, with gradients
            stop_if_any(accelerator, not bool(torch.isfinite(images.detach()).all()), "non-finite generated images",
                        epoch, last_good)
            scored = prompts * objective.copies
            try:
                rewards, parts = self.reward(scored, images)
                loss, failure = objective.reward_loss(rewards), None
            except Exception as err:  # every process must learn of it before anyone waits in the backward
                loss, failure = None, f"reward failed: judge error {type(err).__name__}: {err}"
            if failure is None and not bool(torch.isfinite(loss.detach())):
                failure = f"non-finite {config.algorithm} loss"
            stop_if_any(accelerator, failure is not None, failure, epoch, last_good)
            accelerator.backward(loss / config.gradient_accumulation_steps)
        for key, value in {"loss": float(loss.detach()), "reward_backprop_mean": float(rewards.detach().mean()),
                           **metrics}.items():
            stats.setdefault(key, []).append(float(value))
        shown = SampledImages(prompts, images[: len(prompts)].detach().float().cpu())

        def per_sample(values):  # the mean over a sample's copies (DRaFT-LV), copy-major rows
            return values.detach().float().cpu().reshape(objective.copies, len(prompts)).mean(0)

        return shown, per_sample(rewards), {name: per_sample(values) for name, values in parts.items()}

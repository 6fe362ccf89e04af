"""Steps 1-3 of the online-RL trainer's epoch (align/train/ddpo.py): sample with the policy, reward in the background
while the next batch samples, and turn every process's rewards into this process's advantages."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from align.families.base import ModelFamily, expand_conditioning, guided_prediction
from align.health import images_finite
from align.pipeline import decode_latents
from align.run_folder import atomic_write_text
from align.sampling.base import Sampler
from align.train.advantages import compute_advantages
from align.train.command import TrainingStopped, way_on
from align.train.ddpo_order import SAMPLE, epoch_generator, gathered_slots, global_batch, in_global_order
from align.train.ddpo_rewards import RewardError
from align.train.heldout import save_image_row
from align.train.policy_models import PolicyModels
from align.train.prompt_cache import PromptEmbeddingCache
from align.train.rollout import Rollout


@dataclass
class Sampling:
    """What sampling an epoch needs, built once per run: the pipeline and its family, the sampler, the prompts, the
    unconditional side of guidance (one row), the latents' shape, and this process's share of the batches."""

    config: object  # the run's DDPOConfig
    pipe: object
    family: ModelFamily
    sampler: Sampler
    prompts: list[str]
    negative: dict
    latent_shape: tuple[int, int, int]
    resolution: int
    num_batches: int  # sampling batches per process per epoch
    process: int
    num_processes: int

    def __post_init__(self):
        self.prompt_cache = (PromptEmbeddingCache(self.family, self.pipe, self.resolution)
                             if getattr(self.config, "cache_prompt_embeddings", False) else None)

    def conditioning(self, prompts: list[str]) -> dict:
        """The prompts' conditioning: encoded by the family, or from the cache (--cache_prompt_embeddings)."""
        if self.prompt_cache is not None:
            return self.prompt_cache.conditioning(prompts)
        return self.family.encode_prompts(self.pipe, prompts, self.resolution)


def draw_prompts(prompts: list[str], config, gen: torch.Generator) -> list[str]:
    """sample_batch_size prompts: uniform draws (with replacement), each repeated images_per_prompt times (a group)."""
    n = config.sample_batch_size // config.images_per_prompt
    picks = torch.randint(len(prompts), (n,), generator=gen).tolist()
    return [prompts[i] for i in picks for _ in range(config.images_per_prompt)]


@torch.no_grad()
def collect_rollouts(sampling: Sampling, models: PolicyModels, epoch: int, background):
    """This process's sampling batches of the epoch; rewards are computed in the background as each batch finishes."""
    config, family, pipe = sampling.config, sampling.family, sampling.pipe
    rollouts, futures = [], []
    sampling.sampler.set_epoch(epoch)
    with models.sampling() as denoiser:
        for b in range(sampling.num_batches):
            # keyed by the global batch: N processes draw what one process with N times the batches draws
            gen = epoch_generator(config.seed, epoch, SAMPLE, global_batch(b, sampling.process, sampling.num_processes), 0)
            batch_prompts = draw_prompts(sampling.prompts, config, gen)
            cond = sampling.conditioning(batch_prompts)
            embeds = cond["prompt_embeds"]
            noise = torch.randn((len(batch_prompts), *sampling.latent_shape), generator=gen).to(embeds.device, embeds.dtype)
            if config.group_shared_noise:  # a group's images are consecutive (draw_prompts): its first one's noise
                noise = noise[:: config.images_per_prompt].repeat_interleave(config.images_per_prompt, dim=0)
            uncond = expand_conditioning(sampling.negative, len(batch_prompts))

            def predict(x, t, cond=cond, uncond=uncond):
                return guided_prediction(family, denoiser, x, t, cond, uncond, config.guidance_scale)

            steps = sampling.sampler.run(predict, noise, gen)
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


def stop_on_nonfinite_images(accelerator, batches, epoch: int, last_good) -> None:
    """A NaN/inf image sampled on any process (a diverged model) stops every process before the update, as a
    failed reward does."""
    bad = 0.0 if all(images_finite(b.images) for b in batches) else 1.0
    if accelerator.gather(torch.tensor([bad], device=accelerator.device)).max() > 0:
        cause = ("sampling settings the model cannot take: --guidance_scale, --eta, --mixed_precision?" if last_good is None
                 else "a diverged model (a --learning_rate too high?) or sampling settings it cannot take")
        raise TrainingStopped(f"non-finite generated images at epoch {epoch} ({cause}); stopped before the update. "
                              f"{way_on(last_good)}")


def epoch_advantages(sampling: Sampling, rollout: Rollout, all_rewards, tracker) -> torch.Tensor:
    """This process's advantages: computed over every process's rewards in global order, then its share."""
    from accelerate.utils import gather_object

    all_prompts = gather_object(rollout.prompts)
    slots = gathered_slots(sampling.num_processes, sampling.num_batches, sampling.config.sample_batch_size)
    advantages = in_global_order(lambda p, r: compute_advantages(sampling.config.advantage, p, r, tracker), all_prompts,
                                 all_rewards, slots)
    return torch.as_tensor(advantages, dtype=torch.float32).reshape(sampling.num_processes, -1)[sampling.process]


def log_samples(accelerator, run_path, rollout: Rollout, rewards: torch.Tensor, count: int, epoch: int) -> None:
    """A row of this process's first images under samples/, with their prompts and rewards beside it."""
    images = rollout.images[:count]
    prompts = rollout.prompts[:count]
    values = rewards[:count].tolist()
    path = run_path / "samples" / f"epoch_{epoch:05d}.png"
    save_image_row(images, path)
    atomic_write_text(path.with_suffix(".json"), json.dumps([{"prompt": p, "reward": r} for p, r in zip(prompts, values)], indent=1))
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.log({"samples": [wandb.Image(img, caption=f"{r:.3f} | {p}") for img, p, r in
                                     zip(images.permute(0, 2, 3, 1).numpy(), prompts, values)]}, step=epoch)
        elif tracker.name == "tensorboard":
            tracker.writer.add_images("samples", images, epoch)

"""What the online-RL trainer's samplers (align/sampling/) record and what its objectives train on: the sampled
chains of an epoch (``Rollout``) and the rows of one model call in the update (``TrainBatch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.families.base import Conditioning, cat_conditioning, select_conditioning


@dataclass
class Rollout:
    """Sampled chains, batch-first. ``K`` is the number of recorded steps (every step, or a stochastic window)."""

    prompts: list[str]
    cond: Conditioning  # the family's conditioning of each prompt
    latents: torch.Tensor  # [B, K, C, H, W]: the input of each recorded step
    next_latents: torch.Tensor  # [B, K, C, H, W]: its output
    timesteps: torch.Tensor  # [B, K]: the denoiser's timestep at each recorded step
    step_indices: torch.Tensor  # [B, K]: each recorded step's index in the sampler's schedule
    log_probs: torch.Tensor  # [B, K]: log-probability of the step under the sampling policy (NaN: deterministic)
    final_latents: torch.Tensor  # [B, C, H, W]: the sampled image latents
    images: torch.Tensor  # [B, 3, H, W] in [0, 1], on the CPU
    means: torch.Tensor | None = None  # [B, K, C, H, W]: each recorded step's Gaussian mean (samplers that record them)

    def __len__(self) -> int:
        return len(self.prompts)


TENSORS = ("latents", "next_latents", "timesteps", "step_indices", "log_probs", "final_latents", "images")


def _optional_means(rollouts: list[Rollout]) -> dict[str, torch.Tensor]:
    return {"means": torch.cat([r.means for r in rollouts])} if rollouts[0].means is not None else {}


def cat_rollouts(rollouts: list[Rollout]) -> Rollout:
    """The rollouts one after the other (an epoch's batches as one)."""
    tensors = {name: torch.cat([getattr(r, name) for r in rollouts]) for name in TENSORS}
    return Rollout(prompts=[p for r in rollouts for p in r.prompts],
                   cond=cat_conditioning([r.cond for r in rollouts]), **tensors, **_optional_means(rollouts))


def select_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout's samples ``rows`` (an index tensor)."""
    names = TENSORS + (("means",) if rollout.means is not None else ())
    tensors = {name: getattr(rollout, name)[rows.to(getattr(rollout, name).device)] for name in names}
    return Rollout(prompts=[rollout.prompts[i] for i in rows.tolist()], cond=select_conditioning(rollout.cond, rows),
                   **tensors)


@dataclass
class TrainBatch:
    """What an objective's ``loss(models, batch)`` sees: some samples' trained steps, flattened sample-major (row
    i·c + j is sample i's j-th chosen step), each row with its sample's advantage and final latents.

    An objective (``align/train/policy_gradient.py``, ``nft.py``, ``awm.py``) returns the mean loss over the rows and
    its metrics; ``models.predict(latents, timesteps, cond, uncond, which)`` gives the guided prediction of the
    trained policy (``which="policy"``, with gradient), the reference or the old policy (no gradient).
    """

    latents: torch.Tensor  # [n, C, H, W]: the step's input (PPO)
    next_latents: torch.Tensor  # [n, C, H, W]: the step's sampled output (PPO)
    timesteps: torch.Tensor  # [n]
    step_indices: torch.Tensor  # [n]
    old_log_probs: torch.Tensor  # [n]: at sampling time
    advantages: torch.Tensor  # [n]
    final_latents: torch.Tensor  # [n, C, H, W]: x0 of the sample, for forward-process objectives
    noise: torch.Tensor | None  # [n, C, H, W]: the forward process's noise (objectives with needs_forward_noise)
    cond: Conditioning
    uncond: Conditioning
    num_samples: int  # the rows are num_samples samples x (rows / num_samples) steps each
    old_means: torch.Tensor | None = None  # [n, C, H, W]: the step's Gaussian mean at sampling time (Rollout.means)

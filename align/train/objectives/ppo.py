"""The policy-gradient objective of DDPO (Black et al. 2023) and Flow-GRPO (Liu et al. 2025): PPO-clip on the
log-probabilities of the sampled steps.

For each trained step the current model's guided prediction (both halves of classifier-free guidance
differentiated, as ddpo-pytorch and Flow-GRPO since its commit a482878) gives the step's Gaussian through the
sampler that drew it; the ratio to the sampling-time log-probability enters the clipped surrogate, and with
``kl_coef > 0`` the KL of the step to the reference model's step is added (the sampler's KL: Flow-GRPO's form for
flow families). Losses are pure maths in ``align/train/losses.py``.
"""

from __future__ import annotations

import torch

from align.train.losses import ddpo_clipped_loss
from align.train.objectives.base import Algorithm, Method, Objective
from align.train.report import Curve
from align.train.rollout import TrainBatch


class PolicyGradient(Objective):
    def __init__(self, sampler, clip_range: float, adv_clip_max: float, kl_coef: float):
        self.sampler, self.clip_range, self.adv_clip_max, self.kl_coef = sampler, clip_range, adv_clip_max, kl_coef

    @classmethod
    def from_config(cls, sampler, config) -> PolicyGradient:
        return cls(sampler, clip_range=config.clip_range, adv_clip_max=config.adv_clip_max, kl_coef=config.kl_coef)

    @property
    def zero_advantage_is_zero_loss(self) -> bool:
        """A sample with advantage 0 has exactly zero loss and gradient (without the KL term)."""
        return self.kl_coef == 0

    def loss(self, models, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        prediction = models.predict(batch.latents, batch.timesteps, batch.cond, batch.uncond)
        step = self.sampler.step(prediction, batch.latents, batch.timesteps, batch.step_indices)
        log_prob = step.log_prob(batch.next_latents)
        loss, metrics = ddpo_clipped_loss(log_prob, batch.old_log_probs, batch.advantages, self.clip_range,
                                          self.adv_clip_max)
        if self.kl_coef > 0:
            loss, metrics = self.add_reference_kl(models, batch, step, loss, metrics)
        return loss, metrics

    def add_reference_kl(self, models, batch: TrainBatch, step, loss, metrics):
        """loss + kl_coef x the sampler's KL of the step to the reference model's step (Flow-GRPO's form on flow)."""
        with torch.no_grad():
            reference = models.predict(batch.latents, batch.timesteps, batch.cond, batch.uncond, which="reference")
            reference_mean = self.sampler.step(reference, batch.latents, batch.timesteps, batch.step_indices).mean
        kl = step.kl_to(reference_mean).mean()
        metrics["kl_to_reference"] = kl.detach()
        return loss + self.kl_coef * kl, metrics

    def describe(self) -> str:
        return f"PPO clip range {self.clip_range}, advantage clip {self.adv_clip_max}, KL coefficient {self.kl_coef}"


ALGORITHM = Algorithm(
    name="ppo",
    summary="PPO-clip on the sampled steps' log-probabilities (DDPO on SD 1.x/2.x and SDXL, Flow-GRPO on SD3/FLUX)",
    method=Method("DDPO", "Black et al. 2023"),
    flow_method=Method("Flow-GRPO", "Liu et al. 2025"),
    objective=PolicyGradient,
    needs_log_probs=True,
    ddpm_defaults={"sampler": "ddim", "drop_zero_advantage": False},  # ddpo-pytorch keeps tied groups
    flow_defaults={"sampler": "sde", "drop_zero_advantage": True},  # Flow-GRPO's train_sd3.py drops them
    curves=(Curve("approximate KL to the sampling policy", ("approx_kl",)),
            Curve("fraction of clipped ratios", ("clipfrac",)),
            Curve("PPO loss", ("policy_loss",)),
            Curve("KL to the reference model", ("kl_to_reference",)),
            Curve("total loss (PPO + KL)", ("loss",), when_logged=("kl_to_reference",))),
)

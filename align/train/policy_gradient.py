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
from align.train.rollout import TrainBatch


class PolicyGradient:
    needs_log_probs = True
    uses_old_policy = False
    samples_with_old_policy = False
    needs_forward_noise = False

    def __init__(self, sampler, clip_range: float, adv_clip_max: float, kl_coef: float):
        self.sampler, self.clip_range, self.adv_clip_max, self.kl_coef = sampler, clip_range, adv_clip_max, kl_coef

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
            with torch.no_grad():
                reference = models.predict(batch.latents, batch.timesteps, batch.cond, batch.uncond, which="reference")
                reference_mean = self.sampler.step(reference, batch.latents, batch.timesteps, batch.step_indices).mean
            kl = step.kl_to(reference_mean).mean()
            loss = loss + self.kl_coef * kl
            metrics["kl_to_reference"] = kl.detach()
        return loss, metrics

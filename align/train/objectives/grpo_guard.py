"""GRPO-Guard (Wang et al. 2025, arXiv 2510.22319, "Mitigating Implicit Over-Optimization in Flow Matching via
Regulated Clipping"): Flow-GRPO's PPO-clip with the importance ratio normalised and the per-step gradient reweighted.

The authors published no code (project page jingw193.github.io/GRPO-Guard; none found in the public index). Read in the
two peers that implement it: verl-omni (verl-project/verl-omni @ a1139ba, verl_omni/trainer/diffusion/diffusion_algos.py
``GRPOGuardLoss``, docs/algo/grpo_guard.md), which has both of the paper's parts, and Flow-Factory
(X-GenGroup/Flow-Factory @ a0b2bc5, src/flow_factory/trainers/grpo.py ``GRPOGuardTrainer``), which has the ratio
normalisation only. Pinned against both by experiments/grpo_guard_reference.py -> tests/data/grpo_guard_reference.json.

For one Gaussian step with the sampling policy's mean μ_old, the current one's μ_θ and the step's std s = σ_t·√Δσ (the
SDE's coefficient times the step's root length), and the sampled x = μ_old + s·z:

    log r      = log p_θ(x) - log p_old(x)               (the Gaussian log-densities, averaged over the elements)
               = mean(z·(μ_θ - μ_old))/s - mean((μ_θ - μ_old)²)/(2s²)
    RatioNorm  ρ = exp((log r + mean((μ_θ - μ_old)²)/(2s²)) · s) = exp(mean(z·(μ_θ - μ_old)))

so the second-order term that pulls E[r] below 1 (and more so at the small late steps) is removed and the step's own
scale 1/s with it: the ratio is centred on 1 with a spread that does not grow with the step. The PPO-clipped loss of ρ
is then divided by Δσ (``reweight``: the paper's 1/dt gradient reweighting, verl-omni's ``/ sqrt_dt**2``), which
balances the steps' gradients (the mean's derivative in v carries a factor Δσ). Flow-Factory leaves that division out:
``--guard_reweight false``.

Rows here may sit at different steps (the trainer flattens samples × steps): s and Δσ are each row's own. verl-omni
takes the batch's mean of both (its micro-batch is one step of the chain), the same number when every row shares the
step (what the reference tests compare).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.cli import ConfigError, option
from align.train.objectives.base import Algorithm, Method
from align.train.objectives.ppo import PolicyGradient
from align.train.report import Curve
from align.train.rollout import TrainBatch

GAUSSIAN_SAMPLERS = ("sde", "dance", "mix")  # the flow samplers whose log-density is the Gaussian's (not CPS's)


def guard_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                std: torch.Tensor) -> torch.Tensor:
    """RatioNorm: ρ = exp((log r + mean((μ_θ - μ_old)²)/(2s²))·s) per row, from [n] log-probabilities, [n, ...] means
    and each row's step std s ([n] or [n, 1, ...]); see the module's docstring."""
    scale = std.float().reshape(-1)
    drift = (mean.float() - old_mean.float()) ** 2
    ratio_mean_bias = drift.mean(dim=tuple(range(1, drift.ndim))) / (2 * scale**2)
    return torch.exp((log_prob.float() - old_log_prob.float() + ratio_mean_bias) * scale)


def guard_clipped_loss(ratio: torch.Tensor, advantages: torch.Tensor, dt: torch.Tensor, clip_range: float,
                       adv_clip_max: float = 5.0, reweight: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip of the normalised ratio, each row's loss divided by its step's Δσ (``reweight``); [n] ratios,
    advantages and Δσ ([n] or [n, 1, ...]). Returns (mean loss, metrics)."""
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    advantages = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    per_row = torch.maximum(unclipped, clipped)
    if reweight:
        per_row = per_row / dt.float().reshape(-1)
    loss = per_row.mean()
    metrics = {"policy_loss": loss.detach(), "ratio_mean": ratio.detach().mean(),
               "clipfrac": ((ratio.detach() - 1.0).abs() > clip_range).float().mean()}
    return loss, metrics


@dataclass
class GuardOptions:
    """GRPO-Guard's own flags."""

    guard_reweight: bool = option(True, "GRPO-Guard: divide each step's clipped loss by its Δσ (the paper's 1/dt gradient "
                                  "reweighting, as verl-omni); false: the ratio normalisation only, as Flow-Factory",
                                  "--algorithm grpo-guard")

    def check(self) -> None:
        if self.sampler is not None and self.sampler not in GAUSSIAN_SAMPLERS:
            raise ConfigError(f"--algorithm grpo-guard normalises Gaussian steps: --sampler {' / '.join(GAUSSIAN_SAMPLERS)}, "
                              f"got {self.sampler}")


class GRPOGuard(PolicyGradient):
    """Flow-GRPO's objective (align/train/objectives/ppo.py) with GRPO-Guard's ratio and weights; the sampler records
    each step's mean at sampling time (``records_means``), which the ratio normalisation needs."""

    def __init__(self, sampler, clip_range: float, adv_clip_max: float, kl_coef: float, reweight: bool):
        super().__init__(sampler, clip_range, adv_clip_max, kl_coef)
        self.reweight = reweight
        sampler.records_means = True

    @classmethod
    def from_config(cls, sampler, config) -> GRPOGuard:
        return cls(sampler, clip_range=config.clip_range, adv_clip_max=config.adv_clip_max, kl_coef=config.kl_coef,
                   reweight=config.guard_reweight)

    @property
    def zero_advantage_is_zero_loss(self) -> bool:
        return self.kl_coef == 0

    def loss(self, models, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        prediction = models.predict(batch.latents, batch.timesteps, batch.cond, batch.uncond)
        step = self.sampler.step(prediction, batch.latents, batch.timesteps, batch.step_indices)
        if batch.old_means is None or step.dt is None or not step.gaussian:
            raise ValueError(f"GRPO-Guard needs a flow sampler with Gaussian steps that records its means "
                             f"({', '.join(GAUSSIAN_SAMPLERS)}); got {self.sampler.describe()}")
        log_prob = step.log_prob(batch.next_latents)
        ratio = guard_ratio(log_prob, batch.old_log_probs, step.mean, batch.old_means, step.std)
        loss, metrics = guard_clipped_loss(ratio, batch.advantages, step.dt, self.clip_range, self.adv_clip_max,
                                           self.reweight)
        log_ratio = (log_prob - batch.old_log_probs).detach()  # Flow-GRPO's raw ratio, for comparison
        metrics.update(approx_kl=0.5 * log_ratio.pow(2).mean(), raw_ratio_mean=torch.exp(log_ratio).mean())
        if self.kl_coef > 0:
            loss, metrics = self.add_reference_kl(models, batch, step, loss, metrics)
        return loss, metrics

    def describe(self) -> str:
        reweight = "1/Δσ reweighting" if self.reweight else "no reweighting"
        return (f"GRPO-Guard: ratio normalisation, {reweight}, PPO clip range {self.clip_range}, advantage clip "
                f"{self.adv_clip_max}, KL coefficient {self.kl_coef}")


ALGORITHM = Algorithm(
    name="grpo-guard",
    summary="Flow-GRPO with GRPO-Guard's normalised ratio and 1/dt reweighting (flow families)",
    method=Method("GRPO-Guard", "Wang et al. 2025"),
    objective=GRPOGuard,
    options=GuardOptions,
    needs_log_probs=True,
    flow_only=True,
    ddpm_defaults={"sampler": "ddim", "drop_zero_advantage": False},  # never used: flow_only
    flow_defaults={"sampler": "sde", "drop_zero_advantage": True},  # Flow-GRPO's, which it sits on
    curves=(Curve("normalised ratio (mean)", ("ratio_mean",)),
            Curve("fraction of clipped ratios", ("clipfrac",)),
            Curve("GRPO-Guard loss", ("policy_loss",)),
            Curve("KL to the reference model", ("kl_to_reference",)),
            Curve("total loss (GRPO-Guard + KL)", ("loss",), when_logged=("kl_to_reference",))),
)

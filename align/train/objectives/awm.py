"""AWM, Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050), as pure maths: tensors in, tensors out.

Follows the authors' scripts/train_sd3_awm.py (scxue/advantage_weighted_matching @ be51372), read a second
time through Flow-Factory's trainers/awm.py. AWM trains on the forward process: each sampled image x0 is noised
afresh, x_t = (1 - t)·x0 + t·ε, and the advantage weights the flow-matching error of the policy's velocity
against ε - x0, inside a PPO-style ratio. Rows are flat, timestep-major: row k·B + b is training timestep k of
sample b (the authors' layout), so a [T·B] vector reshapes to [T, B].

The authors' SD3.5-Medium recipe (config/dgx_awm.py; PickScore / GenEval / OCR where they differ):
  sampling   14 steps of SA-Solver (predictor 2, corrector 2, PEC) on the scheduler's sigmas (shift 3), no CFG
             (guidance 1.0); stochasticity 0 for PickScore (an ODE), 0.4 for t in [0.3, 0.9] for GenEval/OCR;
             512 px; 24 images per prompt; 6 per GPU × 12 / 36 batches (8 GPUs): 576 / 1728 images an epoch.
  training   no CFG in the trained forward; t from the sampling grid (``awm_timestep_indices``): 6 timesteps,
             indices below int(14·0.9) = 12, "discrete" (PickScore) or "discrete-without-init" (GenEval/OCR);
             weighting ghuber, power 0.25; ratio per timestep ("exp_first"); clip_range 1; advantages clamped
             to ±5 then scaled by 1/5 (adv_clip_max 5, advantage_max 1); KL to the base model, uniform
             weighting, beta 1e-4 / 1e-3 / 3e-3; KL to the EMA adapter, uniform, ema_beta 1, EMA decay
             min(0.3, 0.001·step) ("linear").
  optimiser  AdamW lr 3e-4 (constant: the cosine's decay_steps is 1e10), betas (0.9, 0.999), wd 1e-4, eps 1e-8,
             grad-norm clip 1; LoRA r 32, alpha 64, gaussian init, attention projections; fp16 autocast;
             2 / 3 / 3 images per micro-batch, accumulated over the whole epoch: ONE optimiser step per epoch,
             so the update is fully on-policy (old log-prob = the same forward, detached: ratio ≡ 1).
  eval EMA   a separate EMA of the LoRA (decay min((1+s)/(10+s), 0.99), once an epoch) is only evaluated/saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.cli import option
from align.declared import COEFFICIENT
from align.train.objectives.base import Algorithm, Method, Objective
from align.train.report import Curve
from align.train.rollout import TrainBatch

WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")  # the authors': Uniform, t, t**2, huber, ghuber
KL_WEIGHTINGS = ("uniform", "elbo")  # the authors': Uniform, ELBO
RATIOS = ("per-timestep", "per-sample")  # the authors' loss_type: exp_first, sum_first
TIME_TYPES = ("discrete", "discrete-with-init", "discrete-without-init")  # discrete, discrete_with_init, _wo_init
EMA_DECAY_SCHEDULES = ("constant", "linear")

_EPS = 1e-10  # the authors' guard inside the square root / power (sqrt(1e-10) = 1e-5 is subtracted back)


def _rows(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t as one float64 value per row of ``like`` (accepts [N] or [N, 1, 1, 1])."""
    t = torch.as_tensor(t).reshape(-1).to(torch.float64)
    if t.numel() != like.shape[0]:
        raise ValueError(f"t has {t.numel()} values for {like.shape[0]} rows")
    return t


def awm_log_prob(
    prediction: torch.Tensor,
    target: torch.Tensor,
    t: torch.Tensor,
    weighting: str = "uniform",
    ghuber_power: float = 0.25,
) -> torch.Tensor:
    """The authors' ``compute_log_prob_awm`` "log_prob": minus the weighted flow-matching error, one per row, float64.

    mse = mean over non-batch dims of (prediction - target)², target = ε - x0 (the velocity), in float64;
    t = sigma in [0, 1] (the scheduler's timestep / 1000; the transformer is called with t·1000).

        uniform  -mse
        t        -t·mse
        t2       -t²·mse
        huber    -t·(sqrt(mse + 1e-10) - 1e-5)
        ghuber   -t·((mse + 1e-10)^p - (1e-10)^p) / p,   p = ghuber_power (0.25 in every recipe)

    huber is ghuber at p = 0.5 halved. The 1e-10 keeps the gradient finite at mse = 0.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; choose from {WEIGHTINGS}")
    if weighting == "ghuber" and ghuber_power <= 0:
        raise ValueError(f"ghuber_power must be > 0, got {ghuber_power}")
    error = (prediction.double() - target.double()).pow(2)
    mse = error.mean(dim=tuple(range(1, error.ndim)))
    t = _rows(t, mse).to(mse.device)
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -mse * t
    if weighting == "t2":
        return -mse * t**2
    if weighting == "huber":
        return -(torch.sqrt(mse + _EPS) - 1e-5) * t
    eps = torch.tensor(_EPS, dtype=mse.dtype, device=mse.device)
    return -(torch.pow(mse + eps, ghuber_power) - torch.pow(eps, ghuber_power)) * t / ghuber_power


def awm_std_dev_t(t: torch.Tensor) -> torch.Tensor:
    """The σ_t that the ELBO-weighted KL divides by: sqrt(t / (1 - clamp(t, 0, 0.99)))·0.7, per row.

    Flow-GRPO's SDE step std at noise level 0.7, without its sqrt(Δt) factor (the authors' compute_log_prob_awm
    returns it as ``std_dev_t``; it is used by nothing but the "elbo" KL weighting).
    """
    t = torch.as_tensor(t).reshape(-1)
    return torch.sqrt(t / (1 - torch.clamp(t, 0, 0.99))) * 0.7


def awm_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float = 5.0,
    advantage_max: float | None = None,
    ratio: str = "per-timestep",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The authors' PPO-clipped AWM policy loss.

    log_prob, old_log_prob: [T, B] (``awm_log_prob`` of the T training timesteps of B samples, reshaped);
    advantages: [B], one per sample, shared by its timesteps.

        A = clamp(advantages, ±adv_clip_max);  A = A / adv_clip_max · advantage_max  if advantage_max is set
        per-timestep ("exp_first", every recipe): r = exp(log_prob - old_log_prob), [T·B], A repeated over T
        per-sample   ("sum_first"; the MEAN over timesteps, despite the name): r = exp(mean_T lp - mean_T old), [B]
        loss = mean of max(-A·r, -A·clamp(r, 1 - clip_range, 1 + clip_range));  clipfrac = mean(|r - 1| > clip_range)

    old_log_prob is detached here. In the authors' on-policy runs it is the same forward's log_prob, detached
    (train_sd3_awm.py: the first gradient_accumulation_steps micro-batches skip the no-grad precompute and use
    ``log_prob.detach()``; every recipe accumulates over all micro-batches, so r ≡ 1 and the loss's gradient is
    -mean(A·∇log_prob)). Otherwise (later micro-batches, or off_policy, where the "ema" adapter also samples)
    it is a no-grad forward before the epoch's training: the policy at the epoch's start, or the "ema" adapter.
    """
    if ratio not in RATIOS:
        raise ValueError(f"unknown ratio {ratio!r}; choose from {RATIOS}")
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    if log_prob.ndim != 2 or old_log_prob.shape != log_prob.shape:
        raise ValueError(f"log_prob and old_log_prob must both be [T, B]; got {tuple(log_prob.shape)}, "
                         f"{tuple(old_log_prob.shape)}")
    if advantages.shape != log_prob.shape[1:]:
        raise ValueError(f"advantages must be [B] = [{log_prob.shape[1]}], got {tuple(advantages.shape)}")
    advantages = advantages.clamp(-adv_clip_max, adv_clip_max)
    if advantage_max is not None:
        advantages = advantages / adv_clip_max * advantage_max
    old_log_prob = old_log_prob.detach()
    if ratio == "per-sample":
        r = torch.exp(log_prob.mean(dim=0) - old_log_prob.mean(dim=0))
    else:
        r = torch.exp(log_prob.reshape(-1) - old_log_prob.reshape(-1))
        advantages = advantages.unsqueeze(0).expand(log_prob.shape[0], -1).reshape(-1)
    unclipped = -advantages * r
    clipped = -advantages * torch.clamp(r, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    r = r.detach()
    metrics = {
        "policy_loss": loss.detach(),
        "clipfrac": ((r - 1.0).abs() > clip_range).float().mean(),
        "ratio_mean": r.mean(),
    }
    return loss, metrics


def awm_kl(
    prediction: torch.Tensor,
    other: torch.Tensor,
    t: torch.Tensor | None = None,
    weighting: str = "uniform",
) -> torch.Tensor:
    """The authors' velocity-space KL term between the policy and another model (scalar, float64).

        uniform  mean over rows of mean((v - v_other)²)
        elbo     mean over rows of mean((v - v_other)²) / (2·σ_t²),  σ_t = ``awm_std_dev_t(t)``

    ``other`` is the base model (LoRA disabled; ``beta``·KL, "kl_weight") or the "ema" adapter (``ema_beta``·KL,
    "kl_ema_weight"), both run without grad on the same x_t, t and prompts as the policy. Every recipe uses
    "uniform" for both. Total loss = policy loss + beta·KL(base) + ema_beta·KL(ema).
    """
    if weighting not in KL_WEIGHTINGS:
        raise ValueError(f"unknown KL weighting {weighting!r}; choose from {KL_WEIGHTINGS}")
    squared = (prediction.double() - other.detach().double()).pow(2)  # float64, as the authors' model_output
    per_row = squared.mean(dim=tuple(range(1, squared.ndim)))
    if weighting == "elbo":
        if t is None:
            raise ValueError("the elbo KL weighting needs t")
        per_row = per_row / (2 * awm_std_dev_t(_rows(t, per_row)).to(per_row.device) ** 2)
    return per_row.mean()


def ema_kl_decay(step: int, decay: float = 0.3, schedule: str = "linear", rate: float = 0.001) -> float:
    """The decay of the "ema" adapter after ``step`` optimiser steps (the authors' kl_ema_decay_type).

    constant: ``decay``;  linear: min(decay, rate·step), rate 0.001 in the authors' code.
    The recipe's linear 0.3 reaches 0.3 after 300 optimiser steps (300 epochs at one step an epoch).
    """
    if schedule not in EMA_DECAY_SCHEDULES:
        raise ValueError(f"unknown EMA decay schedule {schedule!r}; choose from {EMA_DECAY_SCHEDULES}")
    if schedule == "constant":
        return float(decay)
    return min(float(decay), rate * step)


def awm_timestep_indices(
    num_steps: int,
    train_timesteps: int,
    generator: torch.Generator | None = None,
    timestep_fraction: float = 0.9,
    time_type: str = "discrete",
) -> torch.Tensor:
    """Indices into the sampling grid of the T = ``train_timesteps`` training timesteps, one stratum each.

    With M = int(num_steps·timestep_fraction) (12 for 14 steps at 0.9), boundaries = linspace(lo, M, n + 1)
    truncated to integers, and one uniform draw u per stratum: index = lower + int(u·(upper - lower)).
        discrete               lo = 0, n = T
        discrete-without-init  lo = 1, n = T (the grid's first, t = 1 step is never trained)
        discrete-with-init     index 0 first, then lo = 1, n = T - 1
    The same indices serve every sample of the micro-batch; each micro-batch draws its own. The authors draw
    u = torch.rand(n) from the global (per-rank seeded, CUDA) RNG; here it is torch.rand(n, generator=generator)
    with the same arithmetic (float32 linspace), so a CPU generator seeded s gives what their code gives after
    torch.manual_seed(s) on CPU.
    """
    if time_type not in TIME_TYPES:
        raise ValueError(f"unknown time_type {time_type!r}; choose from {TIME_TYPES}")
    if train_timesteps < 1:
        raise ValueError(f"train_timesteps must be >= 1, got {train_timesteps}")
    top = int(num_steps * timestep_fraction)
    if time_type == "discrete-with-init":
        first = torch.zeros(1, dtype=torch.long)
        if train_timesteps == 1:
            return first
        lo, n = 1, train_timesteps - 1
    else:
        first = None
        lo, n = (0 if time_type == "discrete" else 1), train_timesteps
    boundaries = torch.linspace(lo, top, steps=n + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    u = torch.rand(n, generator=generator)
    indices = lower + (u * (upper - lower)).long()
    return indices if first is None else torch.cat([first, indices])


@dataclass
class AWMOptions:
    """AWM's own flags."""

    awm_weighting: str = option("ghuber", "AWM's weighting of the flow-matching error: uniform, t, t2, huber or ghuber "
                                "(generalised Huber, the authors' recipes)", "--algorithm awm",
                                choices=WEIGHTINGS)
    awm_ghuber_power: float = option(0.25, "the generalised Huber's power p (the authors: 0.25)", "--algorithm awm",
                                     within="(0, 10]")
    ema_kl_coef: float = option(1.0, "AWM: weight of the KL to the old (EMA) policy (the authors' ema_beta: 1)",
                                "--algorithm awm", within=COEFFICIENT)

    def check(self) -> None:
        """Its values are declared (range, choices) and checked with every option; nothing across them to check."""


class AdvantageWeightedMatching(Objective):
    """AWM's objective for the trainer (align/train/ddpo.py --algorithm awm), on every family.

    Each trained step noises the rollout's final latents with its own noise through the sampler's forward process;
    the policy's prediction gives ``awm_log_prob`` against the sampler's training target (velocity ε - x0 for flow
    families, ε or v for the others; t = timestep / 1000). As in every recipe of the authors, the update is on-policy
    (one optimiser step per epoch): the old log-probability is the same forward's, detached, so the ratio is 1 and
    the gradient -mean(A·∇log_prob); with more steps per epoch it stays the detached forward (a deliberate
    simplification, docs/training.md). Plus kl_coef·KL to the reference and ema_kl_coef·KL to the old ("ema")
    policy, which follows the trained weights once per epoch with decay min(0.3, 0.001·step).
    """

    needs_forward_noise = True

    def __init__(self, sampler, weighting: str, ghuber_power: float, clip_range: float, adv_clip_max: float,
                 kl_coef: float, ema_kl_coef: float):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"unknown AWM weighting {weighting!r}; choose from {WEIGHTINGS}")
        self.sampler, self.weighting, self.ghuber_power = sampler, weighting, ghuber_power
        self.clip_range, self.adv_clip_max = clip_range, adv_clip_max
        self.kl_coef, self.ema_kl_coef = kl_coef, ema_kl_coef

    @classmethod
    def from_config(cls, sampler, config) -> AdvantageWeightedMatching:
        return cls(sampler, config.awm_weighting, config.awm_ghuber_power, config.clip_range, config.adv_clip_max,
                   config.kl_coef, config.ema_kl_coef)

    @staticmethod
    def keeps_old_policy(config) -> bool:
        """The EMA policy is kept only where its KL term is (a second copy of the trained weights)."""
        return config.ema_kl_coef > 0

    @property
    def zero_advantage_is_zero_loss(self) -> bool:
        return self.kl_coef == 0 and self.ema_kl_coef == 0

    def old_policy_decay(self, step: int) -> float:
        return ema_kl_decay(step)

    def loss(self, models, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        forward, x0 = self.sampler.forward, batch.final_latents.float()
        noisy = forward.noisy(x0, batch.noise, batch.timesteps)
        t = forward.time(batch.timesteps)
        prediction = models.predict(noisy, batch.timesteps, batch.cond, batch.uncond)
        log_prob = awm_log_prob(prediction, forward.target(x0, batch.noise, batch.timesteps), t, self.weighting,
                                self.ghuber_power)
        samples, steps = batch.num_samples, len(log_prob) // batch.num_samples
        by_step = log_prob.reshape(samples, steps).T  # timestep-major [T, B], the authors' layout
        loss, metrics = awm_policy_loss(by_step, by_step.detach(), batch.advantages.reshape(samples, steps)[:, 0],
                                        self.clip_range, self.adv_clip_max, advantage_max=1.0)
        for name, coef, which in (("kl_to_reference", self.kl_coef, "reference"), ("kl_to_old", self.ema_kl_coef, "old")):
            if coef > 0:
                other = models.predict(noisy, batch.timesteps, batch.cond, batch.uncond, which=which)
                kl = awm_kl(prediction, other)
                loss = loss + coef * kl
                metrics[name] = kl.detach()
        return loss, metrics

    def describe(self) -> str:
        return (f"{self.weighting} weighting, advantage clip {self.adv_clip_max}, clip range {self.clip_range}, KL "
                f"coefficient {self.kl_coef}, KL to the EMA policy {self.ema_kl_coef}")


ALGORITHM = Algorithm(
    name="awm",
    summary="Advantage Weighted Matching (the forward process, advantage-weighted flow matching)",
    method=Method("AWM", "Xue et al. 2025"),
    objective=AdvantageWeightedMatching,
    options=AWMOptions,
    needs_log_probs=False,
    ddpm_defaults={"sampler": "ode", "drop_zero_advantage": False},
    flow_defaults={"sampler": "ode", "drop_zero_advantage": False},
    curves=(Curve("AWM loss", ("policy_loss",)),
            Curve("KL to the reference model", ("kl_to_reference",)),
            Curve("KL to the EMA policy", ("kl_to_old",)),
            Curve("total loss (AWM + KL)", ("loss",), when_logged=("kl_to_reference", "kl_to_old"))),
)

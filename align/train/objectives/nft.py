"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117) as pure maths: tensors in, tensors out.

Source: NVlabs/DiffusionNFT @ 24af555 (scripts/train_nft_sd3.py, config/nft.py, config/base.py, flow_grpo/ema.py,
flow_grpo/diffusers_patch/solver.py, pipeline_with_logprob.py); X-GenGroup/Flow-Factory trainers/nft.py agrees.
Pinned against the authors' own lines by experiments/nft_reference.py -> tests/data/nft_reference.json.

The objective, per sample with clean latents x0 (the final latents of a rollout), a reward weight r in [0, 1]
and a noised x_t of it (the same x_t, noise and timestep for the current, old and reference models):

    x0+ = beta*x0_theta + (1 - beta)*x0_old          (x0 of the authors' v+ = beta*v_theta + (1-beta)*v_old)
    x0- = (1 + beta)*x0_old - beta*x0_theta          (x0 of v- = (1+beta)*v_old - beta*v_theta)
    w±  = max(mean |x0± - x0|, 1e-5)                 (float64, no gradient: self-normalising)
    L   = adv_clip_max * mean_batch[ r*mean((x0+ - x0)^2)/w+ / beta + (1-r)*mean((x0- - x0)^2)/w- / beta ]
          + train_beta * mean_batch mean((v_theta - v_ref)^2)          (the KL term, added by the caller)

The authors mix velocities and take x0 = x_t - t*v; since x0 is affine in the model output for every
parameterisation (flow velocity, epsilon, v-prediction), mixing x0's is the same thing, so ``nft_loss`` serves
every family once the caller maps outputs to x0 (align/sampling/forward.py: ``flow_x0``, ``eps_x0``, ``v_prediction_x0``).

The authors' recipe (SD3.5-Medium, config/nft.py; 8 GPUs):
- Rollouts: 48 prompts x 24 images per epoch, drawn by the OLD policy (the "old" LoRA adapter), 512 px,
  guidance 1.0 (no CFG anywhere: config/nft.py overrides base 4.5 with 1.0 for every config, so the trained
  forward's negative-embeds branch, ``guidance_scale > 1``, is unreachable), num_steps 10 (25 for
  sd3_multi_reward), solver "dpm2" deterministic (ODE; no log-probs: ``--sampler dpm2``, align/sampling/flow.py). Scheduler sigmas:
  FlowMatchEulerDiscrete set_timesteps(N) with the static shift 3.0 (sigma_0 = 1.0 ... sigma_{N-1} = 0.00893, then 0).
  The sampler feeds the transformer timestep = long(sigma*1000) (truncated); training feeds the float grid value.
- Advantages: (reward - mean of its prompt's 24) / (std over all the epoch's rewards + 1e-4) (global_std), then
  clipped to +-5 and mapped to r = clamp(A/5/2 + 0.5, 0, 1) (adv_mode "all").
- Trained timesteps: per sample a fresh random permutation of the N grid timesteps, of which the first
  int(N * 0.99) are trained (9 of 10; 24 of 25), each with its own noise draw, x_t = (1-t)x0 + t*noise with
  t = grid timestep / 1000. One backward per (micro-batch, timestep), loss / (grad_accum * num_train_timesteps).
- beta (config.beta): 1.0 (geneval, pickscore, hpsv2); 0.1 (ocr, multi_reward). KL weight train.beta = 1e-4 on
  mean((v_theta - v_ref)^2), v_ref = base model (LoRA disabled). adv_clip_max 5.
- Optimiser: AdamW lr 3e-4, betas (0.9, 0.999), wd 1e-4, eps 1e-8, grad-norm clip 1.0, fp16 autocast + GradScaler.
  LoRA r 32, alpha 64, gaussian init, on attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out}.
- Optimiser steps per epoch: 1 (geneval, pickscore, hpsv2, multi_reward) or 2 (ocr): micro-batch 9 per GPU,
  16 micro-batches per GPU per epoch, gradient_accumulation 16 (ocr 8) micro-batches x num_train_timesteps.
- Old policy: after each epoch's training, old = d*old + (1-d)*current with d = ``old_policy_decay(global_step)``,
  global_step = optimiser steps so far; "linear-0.5" (decay_type 1) by default, "delayed-linear-0.999" (type 2) for
  ocr. Starts equal to the current policy.
- Eval/checkpoint weights: an EMA of the current LoRA, updated after every optimiser step with decay
  min((1 + step)/(10 + step), 0.9) (not implemented here); eval sampling is Euler ODE, 40 steps, cfg 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.cli import option
from align.declared import POSITIVE
from align.train.objectives.base import Algorithm, Method, Objective
from align.train.report import Curve
from align.train.rollout import TrainBatch

ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
WEIGHT_FLOOR = 1e-5  # the authors' clip on the self-normalising weights

# The authors' return_decay(step, decay_type): (flat steps, rate per step, ceiling).
OLD_POLICY_SCHEDULES = {
    "none": (0, 0.0, 0.0),  # decay_type 0: old = current after every epoch (on-policy rollouts)
    "linear-0.5": (0, 0.001, 0.5),  # decay_type 1: 0.001*step, held at 0.5 from step 500
    "delayed-linear-0.999": (75, 0.0075, 0.999),  # decay_type 2: 0 until step 75, then 0.0075/step up to 0.999
}
AUTHORS_DECAY_TYPES = {0: "none", 1: "linear-0.5", 2: "delayed-linear-0.999"}


def _non_batch_dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


# ---------------------------------------------------------------- the objective


def nft_reward_weight(advantages: torch.Tensor, adv_clip_max: float, adv_mode: str = "all") -> torch.Tensor:
    """r = clamp(A/c/2 + 0.5, 0, 1) of A = clamp(advantages, -c, c), c = adv_clip_max (the authors' train step).

    adv_mode as the authors: "all" (their configs); "positive_only" / "negative_only" clamp A to [0, c] / [-c, 0];
    "one_only" maps A > 0 to 1 and the rest to 0, "binary" to sign(A), both before the same mapping (so r is
    0.5 + 1/(2c) or 0.5 for "one_only": the authors' arithmetic, not a 0/1 weight).
    """
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    if adv_mode not in ADV_MODES:
        raise ValueError(f"unknown adv_mode {adv_mode!r}; valid: {', '.join(ADV_MODES)}")
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        a = a.clamp(0, adv_clip_max)
    elif adv_mode == "negative_only":
        a = a.clamp(-adv_clip_max, 0)
    elif adv_mode == "one_only":
        a = torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
    elif adv_mode == "binary":
        a = torch.sign(a)
    return ((a / adv_clip_max) / 2.0 + 0.5).clamp(0, 1)


def _normalised_sq_error(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """mean((x0_hat - x0)^2) / max(mean |x0_hat - x0|, 1e-5) per sample; the weight in float64 without gradient.

    The float64 weight promotes the result to float64, as in the authors' code.
    """
    dims = _non_batch_dims(x0)
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=WEIGHT_FLOOR)
    return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(
    x0_policy: torch.Tensor,
    x0_old: torch.Tensor,
    x0: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT policy loss in x0 space (see the module docstring); ``x0_old`` is detached here.

    x0_policy, x0_old: [B, ...] the current and old models' x0 predictions at the same x_t; x0: [B, ...] the
    clean latents; r: [B] from ``nft_reward_weight``. Returns (loss, metrics); the KL term is the caller's
    (``prediction_kl``). Metrics: ``policy_loss`` (this loss; the authors' logged ``policy_loss`` is policy + KL,
    because their ``loss += kl`` adds in place to the tensor whose detached view they log) and
    ``unweighted_policy_loss`` (the batch mean before x adv_clip_max) as the authors; ``old_deviate_x0`` / ``old_deviate_x0_max`` are mean / max of (x0_policy - x0_old)^2 in
    x0 space (the authors' ``old_deviate`` is in velocity space: ``prediction_kl(v_theta, v_old).mean()``, equal
    to old_deviate_x0 / t^2 per sample for flow models); ``x0_norm`` / ``x0_norm_max`` of x0^2 as the authors;
    ``positive_loss`` / ``negative_loss`` (batch means) and ``r_mean``.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    x0_old = x0_old.detach()
    x0_positive = beta * x0_policy + (1 - beta) * x0_old
    x0_negative = (1.0 + beta) * x0_old - beta * x0_policy
    positive = _normalised_sq_error(x0_positive, x0)
    negative = _normalised_sq_error(x0_negative, x0)
    per_sample = r * positive / beta + (1.0 - r) * negative / beta
    loss = (per_sample * adv_clip_max).mean()
    deviation = (x0_policy.detach() - x0_old) ** 2
    metrics = {
        "policy_loss": loss.detach(),
        "unweighted_policy_loss": per_sample.mean().detach(),
        "positive_loss": positive.mean().detach(),
        "negative_loss": negative.mean().detach(),
        "r_mean": r.float().mean().detach(),
        "old_deviate_x0": deviation.mean(),
        "old_deviate_x0_max": deviation.max(),
        "x0_norm": (x0.detach() ** 2).mean(),
        "x0_norm_max": (x0.detach() ** 2).max(),
    }
    return loss, metrics


def prediction_kl(prediction: torch.Tensor, reference_prediction: torch.Tensor) -> torch.Tensor:
    """[B] mean over non-batch dims of (prediction - reference)^2: the authors' KL term in model-output space.

    The trainer adds ``train_beta * prediction_kl(v_theta, v_ref).mean()`` (train.beta = 1e-4 in their configs);
    the reference is detached here. ``prediction_kl(v_theta, v_old).mean()`` is their ``old_deviate``.
    """
    return ((prediction - reference_prediction.detach()) ** 2).mean(dim=_non_batch_dims(prediction))


# ---------------------------------------------------------------- old policy, EMA, trained timesteps


def old_policy_decay(step: int, schedule: str | int = "linear-0.5") -> float:
    """The authors' return_decay: 0 before ``flat`` steps, then min((step - flat)*rate, ceiling).

    ``schedule`` is a name of OLD_POLICY_SCHEDULES or the authors' decay_type (0, 1, 2):
    "none" (0): always 0, the old policy becomes the current one after each epoch;
    "linear-0.5" (1, their default): 0.001*step, capped at 0.5 (reached at step 500);
    "delayed-linear-0.999" (2, their OCR config): 0 for step < 75, then 0.0075*(step - 75), capped at 0.999.
    ``step`` is the number of optimiser steps taken so far (their global_step at the end of the epoch).
    """
    name = AUTHORS_DECAY_TYPES.get(schedule, schedule) if isinstance(schedule, int) else schedule
    if name not in OLD_POLICY_SCHEDULES:
        raise ValueError(f"unknown old-policy schedule {schedule!r}; valid: {', '.join(OLD_POLICY_SCHEDULES)}")
    flat, rate, ceiling = OLD_POLICY_SCHEDULES[name]
    if step < flat:
        return 0.0
    return min((step - flat) * rate, ceiling)


@dataclass
class NFTOptions:
    """DiffusionNFT's own flags."""

    nft_beta: float = option(1.0, "DiffusionNFT's beta: how far the implicit positive/negative policies sit from the old "
                             "policy (the authors: 1.0; 0.1 for OCR)", "--algorithm nft", within=POSITIVE)
    old_policy_decay: str = option("linear-0.5", "DiffusionNFT's old (sampling) policy, an average of the trained "
                                   "weights updated each epoch with decay: none (0: the trained weights), linear-0.5 "
                                   "(min(0.001 x step, 0.5), the authors' default), delayed-linear-0.999 (0 for 75 steps, "
                                   "then +0.0075 a step up to 0.999, their OCR recipe)", "--algorithm nft",
                                   choices=tuple(OLD_POLICY_SCHEDULES))

    def check(self) -> None:
        """Its values are declared (range, choices) and checked with every option; nothing across them to check."""


class DiffusionNFT(Objective):
    """DiffusionNFT's objective for the trainer (align/train/ddpo.py --algorithm nft), on every family.

    The rollouts' final latents are x0; each trained step noises them with the step's own noise through the
    sampler's forward process, and the trained, old (and, for the KL, reference) policies predict at that x_t with the
    sampler's guidance (none with --guidance_scale 1, as the authors; with guidance the policy is the guided one, for
    the old and the trained weights alike). The sampler maps each prediction to x0 (velocity, epsilon or v).
    """

    samples_with_old_policy = True
    needs_forward_noise = True

    def __init__(self, sampler, beta: float, adv_clip_max: float, kl_coef: float, decay_schedule: str):
        self.sampler, self.beta, self.adv_clip_max = sampler, beta, adv_clip_max
        self.kl_coef, self.decay_schedule = kl_coef, decay_schedule

    @classmethod
    def from_config(cls, sampler, config) -> DiffusionNFT:
        return cls(sampler, beta=config.nft_beta, adv_clip_max=config.adv_clip_max, kl_coef=config.kl_coef,
                   decay_schedule=config.old_policy_decay)

    @staticmethod
    def keeps_old_policy(config) -> bool:
        return True  # it samples the rollouts and anchors the implicit policies

    def old_policy_decay(self, step: int) -> float:
        return old_policy_decay(step, self.decay_schedule)

    def loss(self, models, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        forward, x0 = self.sampler.forward, batch.final_latents.float()
        noisy = forward.noisy(x0, batch.noise, batch.timesteps)
        prediction = models.predict(noisy, batch.timesteps, batch.cond, batch.uncond)
        old = models.predict(noisy, batch.timesteps, batch.cond, batch.uncond, which="old")
        r = nft_reward_weight(batch.advantages, self.adv_clip_max)
        loss, metrics = nft_loss(forward.x0(prediction, noisy, batch.timesteps), forward.x0(old, noisy, batch.timesteps),
                                 x0, r, self.beta, self.adv_clip_max)
        if self.kl_coef > 0:
            reference = models.predict(noisy, batch.timesteps, batch.cond, batch.uncond, which="reference")
            kl = prediction_kl(prediction, reference).mean()
            loss = loss + self.kl_coef * kl
            metrics["kl_to_reference"] = kl.detach()
        return loss, metrics

    def describe(self) -> str:
        return (f"beta {self.beta}, advantage clip {self.adv_clip_max}, old policy {self.decay_schedule}, KL coefficient "
                f"{self.kl_coef}")


ALGORITHM = Algorithm(
    name="nft",
    summary="DiffusionNFT (the forward process, an implicit positive and negative policy)",
    method=Method("DiffusionNFT", "Zheng et al. 2025"),
    objective=DiffusionNFT,
    options=NFTOptions,
    needs_log_probs=False,
    ddpm_defaults={"sampler": "ode", "drop_zero_advantage": False},
    flow_defaults={"sampler": "ode", "drop_zero_advantage": False},
    curves=(Curve("DiffusionNFT loss", ("policy_loss",)),
            Curve("positive and negative losses", ("positive_loss", "negative_loss")),
            Curve("squared distance to the old policy (x0)", ("old_deviate_x0",)),
            Curve("KL to the reference model", ("kl_to_reference",)),
            Curve("total loss (DiffusionNFT + KL)", ("loss",), when_logged=("kl_to_reference",))),
)

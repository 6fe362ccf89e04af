"""DGPO, Direct Group Preference Optimization (Luo et al. 2025), as pure maths and the trainer's objective.

Follows the authors' scripts/train_sd3_dgpo.py (Luo-Yihong/DGPO @ 01ceb4b, config/dgpo.py, config/base.py), read a
second time through Flow-Factory's trainers/dgpo.py. Pinned against the authors' own lines by
experiments/dgpo_reference.py -> tests/data/dgpo_reference.json.

DGPO is DPO over groups: the images of a prompt, drawn by a deterministic sampler (ODE or DPM-Solver, no
log-probabilities), are noised afresh, x_t = (1 - t)·x0 + t·ε (one ε for the whole group), and each image's
denoising loss d_i = mean((ε - x0 - v_θ(x_t))²) is compared with the reference's d_i^ref. The group's preference
loss -log σ(-β/G Σ_i A_i (d_i - d_i^ref)) has the gradient of the authors' equivalent form, the one implemented:

    w_g = σ(β/G · Σ_{i in g} A_i (d_i - d_i^ref))        (no gradient; per group and trained step)
    L   = mean_i (w_g(i) · A_i · d_i)

so a group whose preference the policy already holds (images with positive advantage denoised better than the
reference, negative ones worse) stops pulling. A_i are GRPO advantages clipped at ±adv_clip_max. With PPO-style
clipping (the authors' clip_dsm) an old policy, an EMA of the trained weights with decay min(0.3, 0.001·step), gives
r_i = exp(d_i^old - d_i); where r_i > 1 + c for A_i > 0 (or r_i < 1 - c for A_i < 0) d_i's gradient is dropped.
A KL term kl_coef·mean((v_θ - v_ref)²) may be added. The policy and the old policy predict WITHOUT classifier-free
guidance (the conditional branch, the authors' ``cfg=False``) though sampling uses it; the reference at
``--dgpo_reference_guidance`` (the authors' kl_cfg, 1: none).

The authors' SD3.5-Medium recipes (config/dgpo.py; geneval / ocr / pickscore where they differ), 4 GPUs:
  sampling   DPMSolverMultistepScheduler (Sana's config, flow shift 3), 10 steps, CFG 4.5, 512 px, noise level 0;
             16 / 16 / 24 images per prompt, 8 prompts an epoch.
  training   M = 4 timesteps drawn once per epoch among the first trunc_steps + 1 of the grid (4 / 6 / 6: t ≥ about
             shift(0.3)), the same for every sample; noise shared by each group at each timestep; beta_dpo 100 / 100
             / 10; clip_range 1e-2 with clip_dsm; KL 0.02 / 0.02 / 0.001 to the frozen base (kl_cfg 1); advantages
             per-prompt (group std for GenEval, global std otherwise), clipped at 5; AdamW 3e-4, LoRA r64 / alpha 128,
             one optimiser step per epoch; the EMA reference swaps in for sampling after 500 / 200 / 200 steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.cli import ConfigError, option
from align.declared import POSITIVE
from align.train.objectives.base import Algorithm, Method, Objective
from align.train.report import Curve
from align.train.rollout import TrainBatch


def denoising_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[n] mean((target - prediction)²) over each row's elements (the authors' ``dsm_loss``)."""
    return (target.float() - prediction.float()).square().reshape(prediction.shape[0], -1).mean(dim=1)


def dgpo_clip(dsm: torch.Tensor, old_dsm: torch.Tensor, advantages: torch.Tensor, clip_range: float):
    """(dsm with its gradient dropped where the ratio r = exp(old_dsm - dsm) left the clip range on the advantage's
    side: r > 1 + c for A > 0, r < 1 - c otherwise; the [n] clipped mask)."""
    ratio = torch.exp(old_dsm.detach() - dsm.detach())
    clipped = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    return torch.where(clipped, dsm.detach(), dsm), clipped


def dgpo_loss(dsm: torch.Tensor, reference_dsm: torch.Tensor, advantages: torch.Tensor, group_ids: torch.Tensor,
              beta: float, group_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The group preference loss (the module's docstring) over [n] rows; ``group_ids`` [n] tells which rows form a
    group (the same prompt at the same trained step). Advantages are the clipped ones."""
    term = advantages * beta * (dsm.detach() - reference_dsm.detach()) / group_size
    sums = torch.zeros(int(group_ids.max()) + 1, dtype=term.dtype, device=term.device).scatter_add_(0, group_ids, term)
    weights = torch.sigmoid(sums)[group_ids]
    loss = (weights.detach() * advantages * dsm).mean()
    return loss, {"policy_loss": loss.detach(), "group_weight": weights.detach().mean(), "dsm_loss": dsm.detach().mean()}


def group_ids_of(num_samples: int, rows: int, group_size: int, device=None) -> torch.Tensor:
    """[rows] group of each row of a TrainBatch (sample-major: row i·c + j is sample i's j-th step) whose samples
    come in whole groups of ``group_size`` consecutive ones: one group per (prompt, step)."""
    steps = rows // num_samples
    sample = torch.arange(rows, device=device) // steps
    return (sample // group_size) * steps + torch.arange(rows, device=device) % steps


def old_policy_decay(step: int) -> float:
    """The EMA reference's decay after ``step`` optimiser steps: the authors' min(0.3, 0.001·global_step), taken before
    their counter moves (so 0 after the first step: the EMA is then the trained weights)."""
    return min(0.3, 0.001 * max(step - 1, 0))


@dataclass
class DGPOOptions:
    """DGPO's own flags."""

    dgpo_beta: float = option(100.0, "DGPO's beta: how sharply a group's preference saturates (the authors: 100 "
                              "GenEval/OCR, 10 PickScore)", "--algorithm dgpo", within=POSITIVE)
    dgpo_clip_dsm: bool = option(True, "DGPO: drop a sample's gradient where its ratio to the old policy (an EMA of "
                                 "the trained weights) leaves --clip_range (the authors' clip_dsm)", "--algorithm dgpo")
    dgpo_ema_reference: bool = option(False, "DGPO: the preference's reference is the EMA old policy instead of the base "
                                      "model (TDM-R1's dynamic reference, the authors' use_ema_ref)", "--algorithm dgpo")
    dgpo_reference_guidance: float = option(1.0, "DGPO: guidance of the base model's prediction (the authors' kl_cfg; "
                                            "1: none, as the policy's)", "--algorithm dgpo", within="[1, 100]")

    def check(self) -> None:
        if self.images_per_prompt < 2 or self.train_batch_size % self.images_per_prompt:
            raise ConfigError(f"--algorithm dgpo compares a prompt's images with each other: --images_per_prompt must be "
                              f">= 2 and divide --train_batch_size (got {self.images_per_prompt} and "
                              f"{self.train_batch_size})")
        if self.drop_zero_advantage:
            raise ConfigError("--algorithm dgpo trains whole groups: leave --drop_zero_advantage off")


class DGPO(Objective):
    """DGPO for the trainer (--algorithm dgpo), on every family (the denoising loss in the family's own target:
    velocity, epsilon or v)."""

    needs_forward_noise = True
    trains_whole_groups = True

    def __init__(self, sampler, beta: float, group_size: int, clip_range: float | None, adv_clip_max: float,
                 kl_coef: float, ema_reference: bool, reference_guidance: float):
        self.sampler, self.beta, self.group_size, self.clip_range = sampler, beta, group_size, clip_range
        self.adv_clip_max, self.kl_coef = adv_clip_max, kl_coef
        self.ema_reference, self.reference_guidance = ema_reference, reference_guidance

    @classmethod
    def from_config(cls, sampler, config) -> DGPO:
        return cls(sampler, config.dgpo_beta, config.images_per_prompt, config.clip_range if config.dgpo_clip_dsm else None,
                   config.adv_clip_max, config.kl_coef, config.dgpo_ema_reference, config.dgpo_reference_guidance)

    @staticmethod
    def keeps_old_policy(config) -> bool:
        return config.dgpo_clip_dsm or config.dgpo_ema_reference

    def old_policy_decay(self, step: int) -> float:
        return old_policy_decay(step)

    def loss(self, models, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        forward, t = self.sampler.forward, batch.timesteps
        noisy = forward.noisy(batch.final_latents, batch.noise, t)
        target = forward.target(batch.final_latents, batch.noise, t)
        prediction = models.predict(noisy, t, batch.cond, batch.uncond, guidance_scale=1.0)
        advantages = batch.advantages.float().clamp(-self.adv_clip_max, self.adv_clip_max)
        dsm = denoising_loss(prediction, target)
        metrics = {}
        old_dsm = None
        if self.clip_range is not None or self.ema_reference:
            old_dsm = denoising_loss(models.predict(noisy, t, batch.cond, batch.uncond, "old", guidance_scale=1.0), target)
        if self.clip_range is not None:
            dsm, clipped = dgpo_clip(dsm, old_dsm, advantages, self.clip_range)
            metrics["clipfrac"] = clipped.float().mean()
        reference = None
        if self.kl_coef > 0 or not self.ema_reference:
            reference = models.predict(noisy, t, batch.cond, batch.uncond, "reference", self.reference_guidance)
        reference_dsm = old_dsm if self.ema_reference else denoising_loss(reference, target)
        groups = group_ids_of(batch.num_samples, len(advantages), self.group_size, advantages.device)
        loss, dgpo_metrics = dgpo_loss(dsm, reference_dsm, advantages, groups, self.beta, self.group_size)
        metrics.update(dgpo_metrics)
        if self.kl_coef > 0:
            kl = denoising_loss(prediction, reference).mean()
            loss = loss + self.kl_coef * kl
            metrics["kl_to_reference"] = kl.detach()
        return loss, metrics

    def describe(self) -> str:
        clip = f"PPO-style clip {self.clip_range} against the EMA policy" if self.clip_range is not None else "no clip"
        reference = "the EMA policy" if self.ema_reference else f"the base model (guidance {self.reference_guidance})"
        return (f"DGPO: beta {self.beta}, groups of {self.group_size}, {clip}, reference {reference}, advantage clip "
                f"{self.adv_clip_max}, KL coefficient {self.kl_coef}")


ALGORITHM = Algorithm(
    name="dgpo",
    summary="Direct Group Preference Optimization (a group-level DPO on the forward process of ODE samples)",
    method=Method("DGPO", "Luo et al. 2025"),
    objective=DGPO,
    options=DGPOOptions,
    needs_log_probs=False,
    ddpm_defaults={"sampler": "ode", "drop_zero_advantage": False},
    flow_defaults={"sampler": "dpm2", "drop_zero_advantage": False},  # the authors sample with DPM-Solver++(2M)
    curves=(Curve("DGPO loss", ("policy_loss",)),
            Curve("group weight σ(·) (mean)", ("group_weight",)),
            Curve("denoising loss", ("dsm_loss",)),
            Curve("fraction of clipped samples", ("clipfrac",)),
            Curve("KL to the reference model", ("kl_to_reference",)),
            Curve("total loss (DGPO + KL)", ("loss",), when_logged=("kl_to_reference",))),
)

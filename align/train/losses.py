"""Loss functions as pure maths: tensors in, (loss, metrics) out. No I/O, no models."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over all non-batch dimensions (C, H, W): one value per sample."""
    return (prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1)


def diffusion_dpo_loss(
    model_err_w: torch.Tensor,
    model_err_l: torch.Tensor,
    ref_err_w: torch.Tensor,
    ref_err_l: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Diffusion-DPO (Wallace et al. 2024), official normalisation.

    inside = -1/2 * beta * [(err_θ(w) - err_ref(w)) - (err_θ(l) - err_ref(l))]
    loss   = mean over pairs of -log σ(inside)

    Each ``*_err`` is the per-pair mean squared denoising error. ``beta`` is the official
    β (5000 default in the paper's code; the diffusers LoRA script's 2500 is this β / 2).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    model_diff = model_err_w - model_err_l
    ref_diff = ref_err_w - ref_err_l
    inside = -0.5 * beta * (model_diff - ref_diff)
    # The mean goes outside the log-sigmoid (diffusers #6702 had it inside).
    loss = -F.logsigmoid(inside).mean()
    metrics = {
        "implicit_acc": (inside > 0).float().mean().detach(),
        "model_mse_w": model_err_w.mean().detach(),
        "model_mse_l": model_err_l.mean().detach(),
        "ref_mse_w": ref_err_w.mean().detach(),
        "ref_mse_l": ref_err_l.mean().detach(),
        "model_mse": 0.5 * (model_err_w.mean() + model_err_l.mean()).detach(),
        "ref_mse": 0.5 * (ref_err_w.mean() + ref_err_l.mean()).detach(),
        "reward_margin": inside.mean().detach(),
    }
    return loss, metrics


def diffusion_sft_loss(model_err_w: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The SFT variant: plain denoising MSE on the preferred images only, no reference."""
    loss = model_err_w.mean()
    return loss, {"model_mse_w": loss.detach()}


def ddpo_clipped_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DDPO's PPO-clip objective (Black et al. 2023) for one denoising step of each sample.

    ratio = exp(log_prob - old_log_prob), A = clamp(advantages, ±adv_clip_max)
    loss  = mean of max(-A·ratio, -A·clamp(ratio, 1 - clip_range, 1 + clip_range))

    Also returns approx_kl = ½·mean((log_prob - old_log_prob)²) and the clip fraction
    (share of samples with |ratio - 1| > clip_range), as ddpo-pytorch logs them.
    """
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    advantages = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    log_ratio = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    metrics = {
        "policy_loss": loss.detach(),
        "approx_kl": 0.5 * log_ratio.detach().pow(2).mean(),
        "clipfrac": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
    }
    return loss, metrics

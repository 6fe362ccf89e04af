"""Forward processes as pure maths: noising clean latents and the x0 a prediction implies, per parameterisation.

Rectified flow (SD3, FLUX): x_t = (1 - t)·x0 + t·ε with t = σ = timestep / 1000, velocity v = ε - x0.
DDPM (SD 1.x/2.x, SDXL): x_t = √ᾱ·x0 + √(1-ᾱ)·ε, with epsilon or v-prediction (v = √ᾱ·ε - √(1-ᾱ)·x0).
Each sampler (align/sampling/) holds its dynamics' forward process (``FlowForward`` or ``DDPMForward`` below) as
``sampler.forward``: what the forward-process objectives (DiffusionNFT, AWM) train with; they never ask the family.
"""

from __future__ import annotations

from typing import Protocol

import torch


def _per_sample(values, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] (float or tensor) -> a tensor broadcasting against ``like`` as [B, 1, ...]."""
    values = torch.as_tensor(values, device=like.device)
    if not values.is_floating_point():
        values = values.float()
    return values.reshape(-1, *([1] * (like.ndim - 1))) if values.ndim else values


def flow_sigma(timesteps: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """σ = t = timestep / num_train_timesteps, as DiffusionNFT's authors divide their grid timesteps."""
    return timesteps / num_train_timesteps


def flow_noised(x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
    """Rectified flow (SD3, FLUX): x_t = (1 - t)*x0 + t*noise."""
    t = _per_sample(sigma, x0)
    return (1 - t) * x0 + t * noise


def flow_x0(x_t: torch.Tensor, velocity: torch.Tensor, sigma) -> torch.Tensor:
    """x0 of a velocity v = noise - x0: x_t - t*v (DiffusionNFT's ``xt - t_expanded * prediction``)."""
    return x_t - _per_sample(sigma, x_t) * velocity


def ddpm_noised(x0: torch.Tensor, noise: torch.Tensor, alpha_cumprod) -> torch.Tensor:
    """DDPM (SD 1.x/2.x, SDXL): x_t = sqrt(a)*x0 + sqrt(1 - a)*noise, a = alphas_cumprod[timestep]."""
    a = _per_sample(alpha_cumprod, x0)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def eps_x0(x_t: torch.Tensor, eps: torch.Tensor, alpha_cumprod) -> torch.Tensor:
    """x0 of an epsilon prediction: (x_t - sqrt(1 - a)*eps) / sqrt(a)."""
    a = _per_sample(alpha_cumprod, x_t)
    return (x_t - (1 - a).sqrt() * eps) / a.sqrt()


def v_prediction_x0(x_t: torch.Tensor, v: torch.Tensor, alpha_cumprod) -> torch.Tensor:
    """x0 of a DDPM v-prediction (v = sqrt(a)*eps - sqrt(1-a)*x0, SD 2.x 768): sqrt(a)*x_t - sqrt(1 - a)*v."""
    a = _per_sample(alpha_cumprod, x_t)
    return a.sqrt() * x_t - (1 - a).sqrt() * v


def ddpm_target(x0: torch.Tensor, noise: torch.Tensor, alpha_cumprod, prediction_type: str) -> torch.Tensor:
    """What a DDPM model is trained to predict: ε (epsilon) or v = √ᾱ·ε - √(1-ᾱ)·x0 (v_prediction)."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        a = _per_sample(alpha_cumprod, x0)
        return a.sqrt() * noise - (1 - a).sqrt() * x0
    raise ValueError(f"prediction_type {prediction_type!r}: the forward-process objectives train epsilon or "
                     "v-prediction models")


def ddpm_x0(x_t: torch.Tensor, prediction: torch.Tensor, alpha_cumprod, prediction_type: str) -> torch.Tensor:
    """x0 of a DDPM prediction of ``prediction_type`` (epsilon or v_prediction)."""
    if prediction_type == "epsilon":
        return eps_x0(x_t, prediction, alpha_cumprod)
    if prediction_type == "v_prediction":
        return v_prediction_x0(x_t, prediction, alpha_cumprod)
    raise ValueError(f"prediction_type {prediction_type!r}: the forward-process objectives train epsilon or "
                     "v-prediction models")


# ----------------------------------------------------------------------------------------------
# The two forward processes as the samplers hold them


class ForwardProcess(Protocol):
    """Noising clean latents at a denoiser timestep, the denoiser's training target, and the x0 of a prediction."""

    def time(self, timesteps: torch.Tensor) -> torch.Tensor: ...

    def noisy(self, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...

    def target(self, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...

    def x0(self, prediction: torch.Tensor, latents: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...


class FlowForward:
    """Rectified flow: x_t = (1 - t)·x0 + t·ε with t = σ = timestep / num_train_timesteps; the model predicts ε - x0."""

    def __init__(self, num_train_timesteps: int = 1000):
        self.num_train_timesteps = num_train_timesteps

    def time(self, timesteps):
        return timesteps.float() / self.num_train_timesteps

    def noisy(self, x0, noise, timesteps):
        return flow_noised(x0.float(), noise.float(), self.time(timesteps))

    def target(self, x0, noise, timesteps):
        return noise.float() - x0.float()

    def x0(self, prediction, latents, timesteps):
        return flow_x0(latents.float(), prediction.float(), self.time(timesteps))


class DDPMForward:
    """DDPM: x_t = √ᾱ·x0 + √(1-ᾱ)·ε with ᾱ from the scheduler; the model predicts ε or v (its prediction_type)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def _alphas(self, timesteps, like):
        return self.scheduler.alphas_cumprod.to(like.device, torch.float32)[timesteps.long().to(like.device)]

    def time(self, timesteps):
        return timesteps.float() / self.scheduler.config.num_train_timesteps

    def noisy(self, x0, noise, timesteps):
        return ddpm_noised(x0.float(), noise.float(), self._alphas(timesteps, x0))

    def target(self, x0, noise, timesteps):
        return ddpm_target(x0.float(), noise.float(), self._alphas(timesteps, x0), self.scheduler.config.prediction_type)

    def x0(self, prediction, latents, timesteps):
        return ddpm_x0(latents.float(), prediction.float(), self._alphas(timesteps, latents),
                       self.scheduler.config.prediction_type)

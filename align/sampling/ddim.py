"""DDIM sampling that records, per step, the latents and the log-probability of each step (DDPO).

One stochastic DDIM step (Song et al. 2021, eq. 12 and 16), with ᾱ the cumulative alphas:

    x̂0   = (x_t - √(1-ᾱ_t)·ε̂) / √ᾱ_t
    σ_t  = η·√[(1-ᾱ_prev)/(1-ᾱ_t) · (1 - ᾱ_t/ᾱ_prev)]
    μ    = √ᾱ_prev·x̂0 + √(1-ᾱ_prev-σ_t²)·ε̂
    x_prev = μ + σ_t·z

and log p(x_prev | x_t) is the Gaussian log-density under N(μ, σ_t²), averaged (not summed)
over the non-batch dimensions, as ddpo-pytorch does. With the same z, ``x_prev`` is what
diffusers' ``DDIMScheduler.step(..., eta=η, variance_noise=z)`` returns; the difference is that
here ``timestep`` may hold one timestep per sample, so a training batch can mix steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.utils.torch_utils import randn_tensor

from align.families.base import Conditioning, ModelFamily, guided_prediction
from align.families.sd import StableDiffusion

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_SD = StableDiffusion()  # the family of bare prompt-embedding tensors


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, 1, ...] so that it broadcasts against ``like``."""
    return values.reshape(values.shape[0], *([1] * (like.ndim - 1)))


def _timesteps_tensor(timestep, batch: int, device) -> torch.Tensor:
    t = torch.as_tensor(timestep, device=device).long()
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"timestep must be a scalar or hold one value per sample ({batch}), got shape {tuple(t.shape)}")
    return t


def _alpha(scheduler, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """ᾱ at each timestep ([B, 1, ...]); a negative timestep (past the end of the chain) is final_alpha_cumprod."""
    alphas_cumprod = scheduler.alphas_cumprod.to(like.device, torch.float32)
    final = torch.as_tensor(scheduler.final_alpha_cumprod, device=like.device, dtype=torch.float32)
    return _per_sample(torch.where(timesteps >= 0, alphas_cumprod[timesteps.clamp(min=0)], final), like)


def predicted_x0_and_eps(scheduler, model_output: torch.Tensor, alpha_t: torch.Tensor, sample: torch.Tensor):
    """x̂0 (clipped or thresholded as the scheduler is configured) and ε̂ from the model output, in float32;
    ``alpha_t`` is ᾱ at the step's timestep ([B, 1, ...])."""
    config = scheduler.config
    model_output = model_output.float()
    sample = sample.float()
    beta_t = 1 - alpha_t
    if config.prediction_type == "epsilon":
        x0 = (sample - beta_t.sqrt() * model_output) / alpha_t.sqrt()
        eps = model_output
    elif config.prediction_type == "sample":
        x0 = model_output
        eps = (sample - alpha_t.sqrt() * x0) / beta_t.sqrt()
    elif config.prediction_type == "v_prediction":
        x0 = alpha_t.sqrt() * sample - beta_t.sqrt() * model_output
        eps = alpha_t.sqrt() * model_output + beta_t.sqrt() * sample
    else:
        raise ValueError(
            f"scheduler prediction_type {config.prediction_type!r} is not one of epsilon, sample, v_prediction"
        )
    if config.thresholding:
        x0 = scheduler._threshold_sample(x0)
    elif config.clip_sample:
        x0 = x0.clamp(-config.clip_sample_range, config.clip_sample_range)
    return x0, eps


def ddim_step_mean_std(scheduler, model_output: torch.Tensor, timestep, sample: torch.Tensor, eta: float):
    """Mean μ and standard deviation σ_t ([B, 1, ...]) of the DDIM step's Gaussian, in float32.

    Follows ``DDIMScheduler.step`` exactly (prediction types, clipping/thresholding of x̂0,
    the previous timestep ``t - T // num_inference_steps`` and ``final_alpha_cumprod``).
    """
    if not eta > 0:
        raise ValueError(f"eta must be > 0 for a stochastic step with a log-probability (DDPO uses 1.0), got {eta}")
    if scheduler.num_inference_steps is None:
        raise ValueError("call scheduler.set_timesteps(num_inference_steps) before stepping")
    t = _timesteps_tensor(timestep, sample.shape[0], sample.device)
    prev_t = t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    alpha_t, alpha_prev = _alpha(scheduler, t, sample), _alpha(scheduler, prev_t, sample)
    x0, eps = predicted_x0_and_eps(scheduler, model_output, alpha_t, sample)
    variance = (1 - alpha_prev) / (1 - alpha_t) * (1 - alpha_t / alpha_prev)
    std = eta * variance.sqrt()
    mean = alpha_prev.sqrt() * x0 + (1 - alpha_prev - std**2).sqrt() * eps
    return mean, std


def ddim_deterministic_jump(scheduler, model_output: torch.Tensor, timestep, sample: torch.Tensor, prev_timestep: int):
    """The η = 0 DDIM step from ``timestep`` straight to ``prev_timestep`` (negative: the end of the chain).

    With ``prev_timestep = timestep - T // num_inference_steps`` it is ``DDIMScheduler.step(..., eta=0)``;
    a larger jump is that step on a coarser schedule. Returns the sample in ``sample``'s dtype.
    """
    t = _timesteps_tensor(timestep, sample.shape[0], sample.device)
    x0, eps = predicted_x0_and_eps(scheduler, model_output, _alpha(scheduler, t, sample), sample)
    alpha_prev = _alpha(scheduler, torch.full_like(t, int(prev_timestep)), sample)
    return (alpha_prev.sqrt() * x0 + (1 - alpha_prev).sqrt() * eps).to(sample.dtype)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std²) averaged over the non-batch dimensions: one value per sample."""
    x = x.float()
    log_density = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return log_density.flatten(1).mean(dim=1)


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, σ²) ‖ N(ref_mean, σ²)) per sample, averaged over non-batch dimensions.

    Two Gaussians with the same σ differ only in their means: KL = ‖mean - ref_mean‖² / (2σ²).
    This is the per-step KL to the reference policy that Flow-GRPO adds to the loss; ``std``
    broadcasts against ``mean`` ([B, 1, 1, 1] or a scalar).
    """
    per_element = (mean.float() - ref_mean.float()).pow(2) / (2 * std.float() ** 2)
    return per_element.flatten(1).mean(dim=1)


def ddim_step_with_logprob(
    scheduler,
    model_output: torch.Tensor,
    timestep,
    sample: torch.Tensor,
    eta: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One stochastic DDIM step and its log-probability.

    ``timestep``: an int or a tensor [B] (one timestep per sample). If ``prev_sample`` is given
    (training: re-scoring a stored trajectory) it is kept and only its log-probability computed;
    otherwise it is drawn with ``generator``. Returns (prev_sample in ``sample``'s dtype, log_prob [B]).
    """
    mean, std = ddim_step_mean_std(scheduler, model_output, timestep, sample, eta)
    if prev_sample is None:
        noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device, dtype=torch.float32)
        # Cast before scoring so the stored sample is exactly the one whose log-prob is recorded.
        prev_sample = (mean + std * noise).to(sample.dtype)
    elif generator is not None:
        raise ValueError("pass either prev_sample or generator, not both")
    log_prob = gaussian_log_prob(prev_sample.detach(), mean, std)
    return prev_sample, log_prob


def guided_noise_prediction(
    unet,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor,
    guidance_scale: float,
) -> torch.Tensor:
    """Classifier-free guidance for SD 1.x/2.x prompt embeddings: ``families.base.guided_prediction``
    (uncond + w·(cond - uncond), both halves in one UNet call, in float32) for callers that hold bare tensors.

    ``timesteps`` is an int or a tensor [B]; the UNet takes one timestep per sample.
    """
    t = _timesteps_tensor(timesteps, latents.shape[0], latents.device)
    return guided_prediction(_SD, unet, latents, t, {"prompt_embeds": prompt_embeds},
                             {"prompt_embeds": negative_prompt_embeds}, guidance_scale)


@dataclass
class Trajectory:
    """A batch of sampled trajectories.

    all_latents: [B, T+1, C, H, W], x_T first and the final x_0 latent last.
    timesteps:   [B, T] the scheduler timestep of each step (the same for every sample).
    log_probs:   [B, T] log p(x_{t-1} | x_t) of the step actually taken, at sampling time.
    """

    all_latents: torch.Tensor
    timesteps: torch.Tensor
    log_probs: torch.Tensor

    @property
    def latents(self) -> torch.Tensor:
        """[B, T, ...] the input of each step."""
        return self.all_latents[:, :-1]

    @property
    def next_latents(self) -> torch.Tensor:
        """[B, T, ...] the output of each step."""
        return self.all_latents[:, 1:]

    @property
    def final_latents(self) -> torch.Tensor:
        return self.all_latents[:, -1]


def check_scheduler_steps(scheduler, num_inference_steps: int, eta: float) -> None:
    """Raise if some step of this schedule has zero variance (its log-probability would be infinite)."""
    scheduler.set_timesteps(num_inference_steps)
    sample = torch.zeros(len(scheduler.timesteps), 1)
    _, std = ddim_step_mean_std(scheduler, sample, scheduler.timesteps, sample, eta)
    if not bool((std > 0).all()):
        raise ValueError(
            "the scheduler has a step with zero noise (for example set_alpha_to_one=True makes the last "
            "step deterministic), so its log-probability is undefined; use set_alpha_to_one=False "
            "(the Stable Diffusion default)"
        )


@torch.no_grad()
def sample_with_logprob(
    unet,
    scheduler,
    prompt_embeds: torch.Tensor | Conditioning,
    negative_prompt_embeds: torch.Tensor | Conditioning,
    *,
    num_inference_steps: int,
    guidance_scale: float,
    eta: float,
    latents: torch.Tensor,
    generator: torch.Generator | None = None,
    stochastic_steps: int | None = None,
    family: ModelFamily | None = None,
) -> Trajectory:
    """Run the full DDIM chain from the initial noise ``latents`` [B, C, H, W] and record it.

    ``prompt_embeds`` / ``negative_prompt_embeds``: the conditioning of each sample and of the negative
    side, as ``family`` encodes it (a dict; a bare tensor is SD 1.x/2.x's prompt embeddings). ``family``:
    the denoiser's model family (None: SD 1.x/2.x).
    ``stochastic_steps``: only the first (noisiest) this many steps draw noise with ``eta``; the rest
    are deterministic DDIM steps (η = 0) whose log-probability is undefined and recorded as NaN.
    None: every step is stochastic.
    """
    family = family or _SD
    cond, uncond = (c if isinstance(c, dict) else {"prompt_embeds": c} for c in (prompt_embeds, negative_prompt_embeds))
    scheduler.set_timesteps(num_inference_steps, device=latents.device)
    chain = scheduler.timesteps
    latents = latents * scheduler.init_noise_sigma
    all_latents, log_probs = [latents], []
    for i, t in enumerate(chain):
        model_input = scheduler.scale_model_input(latents, t)
        t_batch = _timesteps_tensor(t, model_input.shape[0], model_input.device)
        noise_pred = guided_prediction(family, unet, model_input, t_batch, cond, uncond, guidance_scale)
        if stochastic_steps is not None and i >= stochastic_steps:
            prev_t = int(chain[i + 1]) if i + 1 < len(chain) else -1
            latents = ddim_deterministic_jump(scheduler, noise_pred, t, latents, prev_t)
            log_prob = torch.full((latents.shape[0],), float("nan"), device=latents.device)
        else:
            latents, log_prob = ddim_step_with_logprob(scheduler, noise_pred, t, latents, eta, generator=generator)
        all_latents.append(latents)
        log_probs.append(log_prob)
    batch = latents.shape[0]
    timesteps = chain.to(latents.device).unsqueeze(0).expand(batch, -1)
    return Trajectory(torch.stack(all_latents, dim=1), timesteps.clone(), torch.stack(log_probs, dim=1))

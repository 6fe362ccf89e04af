"""Flow-matching sampling with per-step log-probabilities (Flow-GRPO, Liu et al. 2025).

Rectified flow (SD3, FLUX): x_σ = (1 - σ)·x0 + σ·ε with σ from 1 (noise) to 0 (image), the model
predicts the velocity v ≈ ε - x0, and diffusers' ``FlowMatchEulerDiscreteScheduler.step`` is the
Euler step of the ODE  x_next = x + v·Δσ  (Δσ = σ_next - σ < 0).

Flow-GRPO replaces the ODE by an SDE with the same marginals, so each step is a Gaussian policy.
With noise level ``a`` and the authors' discretisation (their ``sde_step_with_logprob``):

    s      = a·√(σ / (1 - σ))                      # "std_dev_t"; at σ = 1 the denominator uses
                                                   #  1 - σ_1, σ_1 = the schedule's second sigma
    mean   = x·(1 + s²/(2σ)·Δσ) + v·(1 + s²(1-σ)/(2σ))·Δσ
    std    = s·√(-Δσ)
    x_next = mean + std·z,  z ~ N(0, I)

``a = 0`` gives back the Euler (ODE) step exactly. The log-probability of a step is the Gaussian
log-density averaged (not summed) over the non-batch dimensions, as the authors (and ddpo-pytorch)
do. The KL term the authors train with is ``mean((mean_θ - mean_ref)²) / (2·s²)``, i.e. the exact
KL of the two step Gaussians times |Δσ| (see ``flow_grpo_kl`` and docs/families.md).

Everything here is pure tensor maths in float32 (the authors cast to fp32 because bf16 overflows
in the mean); nothing loads a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.utils.torch_utils import randn_tensor

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class FlowStep:
    """One flow step as a Gaussian: ``x_next ~ N(mean, std²·I)`` (std = 0: a deterministic step)."""

    mean: torch.Tensor
    std: torch.Tensor  # [B, 1, ...]: s·√(-Δσ), the standard deviation of x_next
    sde_sigma: torch.Tensor  # [B, 1, ...]: s = a·√(σ/(1-σ)), the SDE's diffusion coefficient


@dataclass
class FlowTrajectory:
    """What ``sample_flow_with_logprob`` returns: the final latents and the window's transitions."""

    final_latents: torch.Tensor  # [B, C, H, W] after the last step
    latents: torch.Tensor  # [B, W, C, H, W]: input of each stochastic (window) step
    next_latents: torch.Tensor  # [B, W, C, H, W]: its sampled output
    log_probs: torch.Tensor  # [B, W]
    timesteps: torch.Tensor  # [W]: σ·num_train_timesteps of each window step (what the transformer saw)
    step_indices: list[int]  # the window's step indices into ``sigmas``


def _per_sample(values, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] -> [B or 1, 1, 1, ...] in float32, broadcasting against ``like``."""
    t = torch.as_tensor(values, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        t = t.reshape(1)
    return t.reshape(t.shape[0], *([1] * (like.ndim - 1)))


def sde_sigma(sigma, sigma_max: float, noise_level: float, like: torch.Tensor) -> torch.Tensor:
    """s = a·√(σ/(1-σ)); at σ = 1 (infinite) the authors use 1 - ``sigma_max`` as the denominator.

    ``sigma_max`` is what the authors call it: ``scheduler.sigmas[1]``, the largest sigma below 1.
    """
    sigma = _per_sample(sigma, like)
    denominator = 1 - torch.where(sigma == 1, torch.full_like(sigma, float(sigma_max)), sigma)
    return noise_level * torch.sqrt(sigma / denominator)


def sde_step(sample, velocity, sigma, sigma_next, sigma_max: float, noise_level: float) -> FlowStep:
    """Mean and std of one Flow-GRPO SDE step from ``sigma`` to ``sigma_next`` (< ``sigma``)."""
    x = sample.float()
    v = velocity.float()
    sigma = _per_sample(sigma, x)
    dt = _per_sample(sigma_next, x) - sigma
    s = sde_sigma(sigma, sigma_max, noise_level, x)
    mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
    return FlowStep(mean=mean, std=s * torch.sqrt(-dt), sde_sigma=s)


def ode_step(sample, velocity, sigma, sigma_next) -> torch.Tensor:
    """The deterministic Euler step x + v·(σ_next - σ): ``FlowMatchEulerDiscreteScheduler.step``."""
    x = sample.float()
    return x + velocity.float() * (_per_sample(sigma_next, x) - _per_sample(sigma, x))


def gaussian_log_prob(x, mean, std) -> torch.Tensor:
    """log N(x; mean, std²) per element, averaged over the non-batch dimensions -> [B]."""
    x = x.detach().float()  # the sample is data, the gradient flows through the mean only
    std = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    log_density = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return log_density.mean(dim=tuple(range(1, log_density.ndim)))


def gaussian_kl(mean_p, std_p, mean_q, std_q) -> torch.Tensor:
    """KL(N(mean_p, std_p²) || N(mean_q, std_q²)) per element, averaged over non-batch dims -> [B]."""
    mean_p, mean_q = mean_p.float(), mean_q.float()
    std_p = torch.as_tensor(std_p, dtype=torch.float32, device=mean_p.device)
    std_q = torch.as_tensor(std_q, dtype=torch.float32, device=mean_p.device)
    kl = torch.log(std_q / std_p) + (std_p**2 + (mean_p - mean_q) ** 2) / (2 * std_q**2) - 0.5
    kl = kl.expand(torch.broadcast_shapes(kl.shape, mean_p.shape))
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def flow_grpo_kl(mean_policy, mean_reference, sde_sigma_value) -> torch.Tensor:
    """The KL penalty of the authors' train_sd3.py: mean((μ_θ - μ_ref)²) / (2·s²) -> [B].

    Both steps share the std s·√(-Δσ), so the exact KL is mean((μ_θ - μ_ref)²) / (2·s²·|Δσ|):
    the authors' value is the exact one times |Δσ| (a per-step weight that shrinks with the step).
    """
    squared = (mean_policy.float() - mean_reference.float()) ** 2
    per_sample = squared.mean(dim=tuple(range(1, squared.ndim)))
    s = torch.as_tensor(sde_sigma_value, dtype=torch.float32, device=squared.device).reshape(-1)
    return per_sample / (2 * s**2)


def check_window(window, num_steps: int) -> tuple[int, int]:
    """(start, end) step indices with 0 <= start < end <= num_steps; None means every step."""
    if window is None:
        return 0, num_steps
    start, end = (int(w) for w in window)
    if not 0 <= start < end <= num_steps:
        raise ValueError(f"window must be (start, end) with 0 <= start < end <= {num_steps} steps, got {tuple(window)}")
    return start, end


def draw_window(size: int, window_range: tuple[int, int], generator: torch.Generator | None = None) -> tuple[int, int]:
    """A window of ``size`` steps with its start uniform in [range_start, range_end - size] (Flow-GRPO-Fast).

    As the authors' Fast pipeline does once per sampling batch (``sde_window_size`` / ``sde_window_range``).
    """
    low, high = (int(r) for r in window_range)
    if size < 1 or low < 0 or high - low < size:
        raise ValueError(f"window size {size} does not fit in window range {tuple(window_range)} (need 0 <= start, "
                         "size >= 1, range_end - range_start >= size)")
    start = low + int(torch.randint(0, high - size - low + 1, (1,), generator=generator))
    return start, start + size


def sample_flow_with_logprob(
    transformer_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    sigmas,
    window: tuple[int, int] | None,
    noise_level: float,
    generator: torch.Generator | None = None,
    num_train_timesteps: int = 1000,
    step_fn: Callable[..., FlowStep] = sde_step,
) -> FlowTrajectory:
    """Denoise ``latents`` along ``sigmas``; SDE steps inside ``window``, Euler (ODE) steps elsewhere.

    ``transformer_fn(latents, timesteps)`` returns the (guided) velocity; ``timesteps`` is [B] of
    σ·``num_train_timesteps``, as diffusers' flow pipelines pass them. ``sigmas`` are the scheduler's
    sigmas after ``set_timesteps`` (N + 1 values, the last 0). ``window = (start, end)`` makes steps
    start..end-1 stochastic (Flow-GRPO-Fast / MixGRPO); ``None`` makes all N stochastic (Flow-GRPO).
    The generator is only drawn from inside the window, so everything outside it is deterministic.
    ``step_fn`` is the window's Gaussian step, with ``sde_step``'s arguments (another discretisation, for experiments).
    """
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32, device=latents.device)
    num_steps = sigmas.numel() - 1
    if num_steps < 1:
        raise ValueError(f"sigmas must hold at least 2 values (N steps + the final 0), got {sigmas.numel()}")
    start, end = check_window(window, num_steps)
    if not noise_level > 0:
        raise ValueError(f"noise_level must be > 0 for the stochastic window steps (the paper uses 0.7), got {noise_level}")
    # The authors' sigma_max: the schedule's second sigma (the first one is exactly 1 and would divide by 0).
    sigma_max = float(sigmas[1])
    x = latents.float()
    batch = x.shape[0]
    inputs, outputs, log_probs, timesteps = [], [], [], []
    for i in range(num_steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        t = (sigma * num_train_timesteps).expand(batch)
        velocity = transformer_fn(x, t)
        if start <= i < end:
            step = step_fn(x, velocity, sigma, sigma_next, sigma_max, noise_level)
            # drawn on the generator's device (a CPU generator serves a GPU run), then moved
            z = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            x_next = step.mean + step.std * z
            inputs.append(x)
            outputs.append(x_next)
            log_probs.append(gaussian_log_prob(x_next, step.mean, step.std))
            timesteps.append(t[0])
        else:
            x_next = ode_step(x, velocity, sigma, sigma_next)
        x = x_next
    return FlowTrajectory(
        final_latents=x,
        latents=torch.stack(inputs, dim=1),
        next_latents=torch.stack(outputs, dim=1),
        log_probs=torch.stack(log_probs, dim=1),
        timesteps=torch.stack(timesteps),
        step_indices=list(range(start, end)),
    )


def cps_step(sample, velocity, sigma, sigma_next, noise_level: float) -> FlowStep:
    """Flow-CPS (coefficients-preserving): std σ_next·sin(a·π/2), mean (1-σ_next)·x̂0 + √(σ_next² - std²)·x̂1."""
    x = sample.float()
    v = velocity.float()
    sigma, sigma_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    mean = x0 * (1 - sigma_next) + x1 * torch.sqrt(sigma_next**2 - std**2)
    return FlowStep(mean=mean, std=std, sde_sigma=std)


def cps_log_prob(x, mean) -> torch.Tensor:
    """The authors' CPS log-probability: -mean((x - mean)²) over the non-batch dimensions, no constants."""
    squared = (x.detach().float() - mean) ** 2
    return -squared.mean(dim=tuple(range(1, squared.ndim)))

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

Flow-CPS (coefficients-preserving sampling, the authors' ``sde_type="cps"``, used by their current Fast configs)
is another Gaussian step (``cps_step``): std σ_next·sin(a·π/2), and a mean that keeps x_σ's coefficients, with a
"log-probability" that is only -mean((x - mean)²) (``cps_log_prob``). Their KL is the same expression with the CPS
std in place of s (``flow_grpo_kl(mean, ref_mean, cps_step(...).sde_sigma)``), which for CPS is the exact KL.

Flow-GRPO-Fast's pipeline (sd3_pipeline_with_logprob_fast.py, read in a fork's copy: zhtmike/flow_grpo @ 3d02fd9)
runs SDE (or CPS) steps only inside a window of ``sde_window_size`` steps whose start is uniform in
[range_start, range_end - size] (drawn once per sampling call), Euler steps elsewhere, and trains the window's
steps. Without a window (``sde_window_size = 0``) the window is (0, N - 1): every step is stochastic except the
last, an ODE step that is not trained (the authors: the last step's Gaussian is so sharp that its probability
overflows); train_sd3_fast.py then trains N - 1 steps.

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


def dance_step(sample, velocity, sigma, sigma_next, noise_level: float) -> FlowStep:
    """Mean and std of one Dance-SDE step (DanceGRPO, Xue et al. 2025) from ``sigma`` to ``sigma_next``.

    The reverse SDE of Flow-GRPO with a constant diffusion coefficient η instead of η·√(σ/(1-σ)):

        x̂0    = x - σ·v
        score = -(x - (1 - σ)·x̂0) / σ²
        mean  = x + Δσ·v - ½·η²·score·Δσ                 (= sde_step's mean with s = η)
        std   = η·√(-Δσ)

    computed in the order of the authors' ``flux_step(..., grpo=True, sde_solver=True)`` (XueZeyue/DanceGRPO
    fastvideo/train_grpo_flux.py @ 15cc71d; MixGRPO's ``dance_grpo_step`` is the same), so that the mean is theirs
    bit for bit on float32 inputs. Their std is a Python float (``eta * math.sqrt(delta_t)``): here it is computed
    in float64 and rounded to float32 once. ``sde_sigma`` is η, the coefficient Flow-GRPO's KL divides by.
    """
    x = sample.float()
    v = velocity.float()
    sigma, sigma_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    dsigma = sigma_next - sigma
    mean = x + dsigma * v
    predicted_image = x - sigma * v
    score = -(x - predicted_image * (1 - sigma)) / sigma**2
    mean = mean + (-0.5 * noise_level**2 * score) * dsigma
    std = (noise_level * torch.sqrt((sigma - sigma_next).double())).float()
    return FlowStep(mean=mean, std=std, sde_sigma=torch.full_like(sigma, noise_level))


def ode_step(sample, velocity, sigma, sigma_next) -> torch.Tensor:
    """The deterministic Euler step x + v·(σ_next - σ): ``FlowMatchEulerDiscreteScheduler.step``."""
    x = sample.float()
    return x + velocity.float() * (_per_sample(sigma_next, x) - _per_sample(sigma, x))


def flow_x0_of(sample, velocity, sigma) -> torch.Tensor:
    """x̂0 = x - σ·v in float32 (the authors' ``pred_original_sample``)."""
    x = sample.float()
    return x - _per_sample(sigma, x) * velocity.float()


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

    Their ``kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1,2,3)) / (2 * std_dev_t ** 2)``,
    averaged over the batch and weighted by beta (train_sd3.py / train_sd3_fast.py @ 74db691, for both step kinds).
    SDE steps: both Gaussians share the std s·√(-Δσ) and ``std_dev_t`` is s, so the exact KL is
    mean((μ_θ - μ_ref)²) / (2·s²·|Δσ|): the authors' value is the exact one times |Δσ| (a per-step weight
    that shrinks with the step). CPS steps: ``std_dev_t`` is the step's std σ_next·sin(a·π/2) itself (``cps_step``'s
    ``sde_sigma``), so the same formula is the exact KL; it divides by zero at the last step (σ_next = 0), which
    the authors' CPS configs never train (their windows end before it).
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
    """One Flow-CPS step from ``sigma`` to ``sigma_next`` as a Gaussian (coefficients-preserving sampling).

    With the predicted image x̂0 = x - σ·v and the predicted noise x̂1 = x + (1 - σ)·v:

        std  = σ_next·sin(a·π/2)
        mean = (1 - σ_next)·x̂0 + √(σ_next² - std²)·x̂1      (√(σ_next² - std²) = σ_next·cos(a·π/2))

    so x_next = mean + std·z keeps x_σ = (1 - σ)·x0 + σ·ε's coefficients: 1 - σ_next on the image and σ_next in
    all on the noise (the predicted part and the fresh part in quadrature). a = 0 is the Euler step, a = 1 draws
    entirely fresh noise. The authors' ``sde_step_with_logprob(..., sde_type="cps")`` (yifan123/flow_grpo,
    flow_grpo/diffusers_patch/sd3_sde_with_logprob.py @ 54809b5), computed the same way in float32.

    ``sde_sigma`` is filled with the std itself: that is the ``std_dev_t`` the authors return for CPS and what
    their KL term divides by, so ``flow_grpo_kl(mean, ref_mean, step.sde_sigma)`` is their KL for CPS too. The std
    is 0 at the last step (σ_next = 0): the step is then deterministic, mean = x̂0.
    """
    x = sample.float()
    v = velocity.float()
    sigma, sigma_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    predicted_image = x - sigma * v
    predicted_noise = x + (1 - sigma) * v
    # the authors' √(σ_next² - std²) rather than σ_next·cos(a·π/2): the same number, rounded as theirs
    mean = predicted_image * (1 - sigma_next) + predicted_noise * torch.sqrt(sigma_next**2 - std**2)
    return FlowStep(mean=mean, std=std, sde_sigma=std)


def cps_log_prob(x, mean) -> torch.Tensor:
    """The authors' CPS "log-probability": -mean((x - mean)²) over the non-batch dimensions -> [B].

    No division by the std and no constants (their "remove all constants"). For two means of the same step it
    differs from the Gaussian log-density by the factor 2·std² only, so under CPS the PPO ratio is
    exp(2·std²·Δlog N): much flatter than the SDE's (the authors' CPS configs clip it at 1e-5). It stays finite at
    the last step, where the std is 0. The sample is data: the gradient flows through ``mean`` only.
    """
    squared = (x.detach().float() - mean.float()) ** 2
    return -squared.mean(dim=tuple(range(1, squared.ndim)))


def _log_snr(sigma: float) -> float:
    """lambda = log((1 - sigma)/sigma); -inf at sigma = 1 (alpha = 0)."""
    return -math.inf if sigma >= 1.0 else math.log(1.0 - sigma) - math.log(sigma)


def dpm2_flow_step(sample: torch.Tensor, x0_pred: torch.Tensor, previous_x0_pred: torch.Tensor | None,
                   sigmas: list[float], index: int) -> torch.Tensor:
    """One step of DiffusionNFT's "dpm2" deterministic solver (NVlabs/DiffusionNFT flow_grpo/diffusers_patch/solver.py:
    multistep DPM-Solver++(2M) in x0 form, alpha = 1 - sigma). s = sigmas[index], t = sigmas[index + 1], s1 = sigmas[index - 1]:

    first step, last step (t = 0) or no previous x0: the DDIM/Euler step (1 - t)*x0 + t*(x - (1 - s)*x0)/s
        (= x + (t - s)*v; the last step returns x0 itself);
    otherwise, with lambda = log((1 - sigma)/sigma), h = lambda_t - lambda_s, h0 = lambda_s - lambda_s1:
        x_next = (t/s)*x - (1 - t)*(exp(-h) - 1)*(x0 + 0.5*(h/h0)*(x0 - x0_previous)).
    At s1 = 1 lambda is -inf, so h/h0 = 0: the step after sigma = 1 is first order, as in the authors' float64 maths.
    """
    s, t = sigmas[index], sigmas[index + 1]
    last = index == len(sigmas) - 2
    if index == 0 or last or previous_x0_pred is None:
        return (1 - t) * x0_pred + t * (sample - (1 - s) * x0_pred) / s
    lam_t, lam_s, lam_s1 = _log_snr(t), _log_snr(s), _log_snr(sigmas[index - 1])
    h = lam_t - lam_s
    ratio = 0.0 if math.isinf(lam_s1) else h / (lam_s - lam_s1)
    return (t / s) * sample - (1 - t) * math.expm1(-h) * (x0_pred + 0.5 * ratio * (x0_pred - previous_x0_pred))

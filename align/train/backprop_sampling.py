"""Sampling with gradients, the maths of reward backpropagation: which steps of the sampler's chain carry the trained
model's gradient to the image (DRaFT-K, AlignProp), a last step taken again from re-noised copies of the image
(DRaFT-LV), or one late step's x0 prediction in place of the image (ReFL).

Every function takes the sampler of the run (align/sampling/: its ``chain_timesteps`` and ``differentiable_step``, its
forward process), ``predict(latents, timesteps)`` (the trained model's guided prediction, with gradients where
gradients are enabled) and a generator that every random draw comes from, so a run resumes and splits over processes
exactly (align/train/ddpo_order.py). Steps whose prediction gets no gradient run under ``no_grad``: the authors detach
those predictions (AlignProp's ``noise_pred.detach()``, ReFL's ``torch.no_grad()``), which gives the same gradient,
since the noise they start from carries none; no graph is kept for them. Each step draws its noise whether it uses it
or not, so the chain's draws do not depend on where gradients start.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from align.sampling.base import Sampler, standard_normal

Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _prediction(predict: Predict, latents: torch.Tensor, timesteps: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    if checkpointed:  # AlignProp's checkpointed steps: the step's activations are recomputed in the backward
        return checkpoint(predict, latents, timesteps, use_reentrant=False)
    return predict(latents, timesteps)


def run_chain(sampler: Sampler, predict: Predict, latents: torch.Tensor, generator: torch.Generator | None,
              first_trained: int, steps: range | None = None, checkpointed: bool = False) -> torch.Tensor:
    """The latents after ``steps`` (default: the whole chain) from ``latents``: the predictions of steps before
    ``first_trained`` get no gradient, those from it on do (``first_trained`` = number of steps: none)."""
    timesteps = sampler.chain_timesteps().to(latents.device)
    x = latents.float()
    for i in steps if steps is not None else range(len(timesteps)):
        noise = standard_normal(x, generator)
        t = timesteps[i].expand(x.shape[0])
        if i < first_trained:
            with torch.no_grad():
                x = sampler.differentiable_step(predict(x, t), x, i, noise)
        else:
            x = sampler.differentiable_step(_prediction(predict, x, t, checkpointed), x, i, noise)
    return x


def truncated_sample(sampler: Sampler, predict: Predict, noise: torch.Tensor, generator: torch.Generator | None,
                     trained_steps: int, checkpointed: bool = False) -> torch.Tensor:
    """DRaFT-K / AlignProp: the chain's final latents with the gradient through the last ``trained_steps`` steps only
    (K; all of them: full DRaFT)."""
    total = len(sampler.chain_timesteps())
    if not 1 <= trained_steps <= total:
        raise ValueError(f"the backpropagated steps must be 1 to {total} (the chain's steps), got {trained_steps}")
    return run_chain(sampler, predict, noise, generator, first_trained=total - trained_steps, checkpointed=checkpointed)


def renoised_last_steps(sampler: Sampler, predict: Predict, final_latents: torch.Tensor,
                        generator: torch.Generator | None, copies: int) -> torch.Tensor:
    """DRaFT-LV: [copies x B, ...] the chain's last step taken again, with gradients, from ``copies`` re-noisings of the
    (detached) final latents to the last step's noise level: x_1 = forward(x_0, ε) (α_1·x_0 + σ_1·ε), then the sampler's
    last step from x_1. Copy-major: rows [k·B, (k+1)·B) are the k-th copy of the batch."""
    if copies < 1:
        raise ValueError(f"DRaFT-LV needs at least one re-noised copy, got {copies}")
    timesteps = sampler.chain_timesteps().to(final_latents.device)
    last = len(timesteps) - 1
    x0 = final_latents.detach().float().repeat(copies, *([1] * (final_latents.ndim - 1)))
    t = timesteps[last].expand(x0.shape[0])
    noisy = sampler.forward.noisy(x0, standard_normal(x0, generator), t)
    return sampler.differentiable_step(predict(noisy, t), noisy, last, standard_normal(x0, generator))


def late_step_x0(sampler: Sampler, predict: Predict, noise: torch.Tensor, generator: torch.Generator | None,
                 stop: int) -> torch.Tensor:
    """ReFL: the chain run without gradients up to step ``stop``, then the x0 that step's prediction implies (with
    gradients): the image the authors score instead of finishing the chain."""
    timesteps = sampler.chain_timesteps().to(noise.device)
    if not 0 <= stop < len(timesteps):
        raise ValueError(f"ReFL's step must be one of the chain's {len(timesteps)} steps, got {stop}")
    x = run_chain(sampler, predict, noise, generator, first_trained=stop, steps=range(stop))
    t = timesteps[stop].expand(x.shape[0])
    return sampler.forward.x0(predict(x, t), x, t)


def draw_first_trained_step(total: int, mean: float, std: float, generator: torch.Generator | None) -> int:
    """AlignProp's randomised truncation (mihirp1998/AlignProp @ b22918a, sd_pipeline.py, strategy "gaussian"): the
    first step whose prediction keeps its gradient, int(N(mean, std)) (truncated toward 0) drawn again until it lies in
    [1, total - 1]; the gradient then flows through the last total - step steps. ``mean``, ``std`` in steps."""
    if not 1 <= mean < total:
        raise ValueError(f"the truncation's mean must lie in [1, {total}), got {mean}")
    while True:
        step = int(mean + std * float(torch.randn((), generator=generator)))
        if 1 <= step < total:
            return step


def draw_refl_step(total: int, last_steps: int, generator: torch.Generator | None) -> int:
    """ReFL's step (THUDM/ImageReward @ c1392c6, ReFL.py: ``random.randint(30, 39)`` of 40 steps): uniform among the
    chain's last ``last_steps`` steps."""
    if not 1 <= last_steps <= total:
        raise ValueError(f"ReFL draws its step among the last 1 to {total} steps, got {last_steps}")
    return total - last_steps + int(torch.randint(last_steps, (), generator=generator))

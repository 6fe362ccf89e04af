"""Samplers of the online-RL trainer: one per dynamics, each returning the same ``Rollout`` for every family.

A sampler runs the denoising chain from noise with the model's (guided) prediction and records the steps the
objective may train on:

- ``DDIMSampler``: stochastic DDIM with η > 0 and the log-probability of each step (DDPO); with a window, the first
  steps stochastic and the rest deterministic (η = 0, MixGRPO's tail). SD 1.x/2.x and SDXL.
- ``FlowSampler``: for SD3/FLUX, Flow-GRPO's SDE (``kind="sde"``) or Flow-CPS (``"cps"``, the authors' current Fast
  configs), on every step or in a window of SDE steps inside the ODE (Flow-GRPO-Fast / MixGRPO).
- ``ODESampler``: the deterministic chain (Euler for flow families, DDIM η = 0 for the others), no log-probabilities:
  what DiffusionNFT and AWM sample with (they train on the forward process of the final images).

A stochastic sampler also gives the Gaussian of one step under another prediction (``step``), so that PPO re-scores a
stored step with the current weights exactly as it was sampled. Every sampler holds its dynamics' forward process
(``sampler.forward``: ``noisy``, the denoiser's training ``target``, how a prediction maps to ``x0``), which is all the
forward-process objectives need: they never ask the family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from align.families.base import Conditioning, cat_conditioning, select_conditioning
from align.sampling.ddim import ddim_deterministic_jump, ddim_step_mean_std, ddim_step_with_logprob
from align.sampling.ddim import gaussian_log_prob as ddim_gaussian_log_prob
from align.sampling.flow import (
    cps_log_prob,
    cps_step,
    dpm2_flow_step,
    draw_window,
    flow_grpo_kl,
    ode_step,
    sde_step,
)
from align.sampling.flow import gaussian_log_prob as flow_gaussian_log_prob
from align.sampling.forward import ddpm_noised, ddpm_target, ddpm_x0, flow_noised, flow_x0
from align.train.losses import gaussian_mean_kl

Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (latents [B, ...], timesteps [B]) -> model output
FAST_WINDOW_SHARE = 0.5  # Flow-GRPO-Fast draws its window among the first half of the steps (sde_window_range)


@dataclass
class Rollout:
    """Sampled chains, batch-first. ``K`` is the number of recorded steps (every step, or a stochastic window)."""

    prompts: list[str]
    cond: Conditioning  # the family's conditioning of each prompt
    latents: torch.Tensor  # [B, K, C, H, W]: the input of each recorded step
    next_latents: torch.Tensor  # [B, K, C, H, W]: its output
    timesteps: torch.Tensor  # [B, K]: the denoiser's timestep at each recorded step
    step_indices: torch.Tensor  # [B, K]: each recorded step's index in the sampler's schedule
    log_probs: torch.Tensor  # [B, K]: log-probability of the step under the sampling policy (NaN: deterministic)
    final_latents: torch.Tensor  # [B, C, H, W]: the sampled image latents
    images: torch.Tensor  # [B, 3, H, W] in [0, 1], on the CPU

    def __len__(self) -> int:
        return len(self.prompts)


def cat_rollouts(rollouts: list[Rollout]) -> Rollout:
    """The rollouts one after the other (an epoch's batches as one)."""
    tensors = {name: torch.cat([getattr(r, name) for r in rollouts]) for name in
               ("latents", "next_latents", "timesteps", "step_indices", "log_probs", "final_latents", "images")}
    return Rollout(prompts=[p for r in rollouts for p in r.prompts],
                   cond=cat_conditioning([r.cond for r in rollouts]), **tensors)


def select_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout's samples ``rows`` (an index tensor)."""
    tensors = {name: getattr(rollout, name)[rows.to(getattr(rollout, name).device)] for name in
               ("latents", "next_latents", "timesteps", "step_indices", "log_probs", "final_latents", "images")}
    return Rollout(prompts=[rollout.prompts[i] for i in rows.tolist()], cond=select_conditioning(rollout.cond, rows),
                   **tensors)


@dataclass
class TrainBatch:
    """What an objective's ``loss(models, batch)`` sees: some samples' trained steps, flattened sample-major (row
    i·c + j is sample i's j-th chosen step), each row with its sample's advantage and final latents.

    An objective (``align/train/policy_gradient.py``, ``nft.py``, ``awm.py``) returns the mean loss over the rows and
    its metrics; ``models.predict(latents, timesteps, cond, uncond, which)`` gives the guided prediction of the
    trained policy (``which="policy"``, with gradient), the reference or the old policy (no gradient).
    """

    latents: torch.Tensor  # [n, C, H, W]: the step's input (PPO)
    next_latents: torch.Tensor  # [n, C, H, W]: the step's sampled output (PPO)
    timesteps: torch.Tensor  # [n]
    step_indices: torch.Tensor  # [n]
    old_log_probs: torch.Tensor  # [n]: at sampling time
    advantages: torch.Tensor  # [n]
    final_latents: torch.Tensor  # [n, C, H, W]: x0 of the sample, for forward-process objectives
    noise: torch.Tensor | None  # [n, C, H, W]: the forward process's noise (objectives with needs_forward_noise)
    cond: Conditioning
    uncond: Conditioning
    num_samples: int  # the rows are num_samples samples x (rows / num_samples) steps each


@dataclass
class StepGaussian:
    """One stochastic step as the Gaussian N(mean, std²) with the sampler's log-density and the KL it trains with."""

    mean: torch.Tensor
    std: torch.Tensor
    log_density: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, mean, std) -> [B]
    kl_to: Callable[[torch.Tensor], torch.Tensor]  # reference mean -> [B]

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_density(x, self.mean, self.std)


def standard_normal(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """N(0, I) noise shaped like ``like``, drawn on the generator's device (a CPU generator serves a GPU run)."""
    device = generator.device if generator is not None else like.device
    return torch.randn(like.shape, generator=generator, device=device, dtype=torch.float32).to(like.device)


def _stack(steps: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.stack(steps, dim=1) if steps else like.new_zeros((like.shape[0], 0, *like.shape[1:]))


class DDIMSampler:
    """Stochastic DDIM (η > 0) with per-step log-probabilities, for epsilon/v-prediction families (DDPO).

    ``stochastic_steps``: only the first this many steps draw noise (the rest η = 0, log-probability NaN); None: all.
    """

    stochastic = True

    def __init__(self, scheduler, num_inference_steps: int, eta: float, stochastic_steps: int | None = None):
        # Its own copy: the pipeline's scheduler is reset by every held-out evaluation.
        self.scheduler = type(scheduler).from_config(scheduler.config)
        self.scheduler.set_timesteps(num_inference_steps)
        self.num_inference_steps, self.eta, self.stochastic_steps = num_inference_steps, eta, stochastic_steps
        self.forward = DDPMForward(self.scheduler)

    def describe(self) -> str:
        n, k = self.num_inference_steps, self.stochastic_steps
        tail = f" on the first {k} steps, then {n - k} deterministic (eta 0) steps" if k is not None else ""
        return f"DDIM, {n} steps, eta {self.eta}{tail}"

    @torch.no_grad()
    def run(self, predict: Predict, noise: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        scheduler = self.scheduler
        chain = scheduler.timesteps.to(noise.device)
        x = noise * scheduler.init_noise_sigma
        inputs, outputs, log_probs = [], [], []
        for i, t in enumerate(chain):
            t_batch = t.expand(x.shape[0])
            prediction = predict(scheduler.scale_model_input(x, t), t_batch)
            if self.stochastic_steps is not None and i >= self.stochastic_steps:
                prev_t = int(chain[i + 1]) if i + 1 < len(chain) else -1
                x_next = ddim_deterministic_jump(scheduler, prediction, t, x, prev_t)
                log_prob = torch.full((x.shape[0],), float("nan"), device=x.device)
            else:
                x_next, log_prob = ddim_step_with_logprob(scheduler, prediction, t, x, self.eta, generator=generator)
            inputs.append(x)
            outputs.append(x_next)
            log_probs.append(log_prob)
            x = x_next
        batch = x.shape[0]
        return {"latents": _stack(inputs, x), "next_latents": _stack(outputs, x), "log_probs": torch.stack(log_probs, 1),
                "timesteps": chain.unsqueeze(0).expand(batch, -1).clone(),
                "step_indices": torch.arange(len(chain), device=x.device).expand(batch, -1).clone(), "final_latents": x}

    def step(self, prediction, latents, timesteps, step_indices) -> StepGaussian:
        mean, std = ddim_step_mean_std(self.scheduler, prediction, timesteps, latents, self.eta)
        return StepGaussian(mean, std, ddim_gaussian_log_prob, lambda ref_mean: gaussian_mean_kl(mean, ref_mean, std))


class FlowSampler:
    """Flow-GRPO's SDE (``kind="sde"``) or Flow-CPS (``"cps"``) for rectified-flow families (SD3, FLUX).

    ``window``: None makes every step stochastic (Flow-GRPO); an int w makes a window of w SDE steps, the rest the ODE
    (Flow-GRPO-Fast), at the start (``window_at="start"``) or drawn per batch within the first half of the steps
    (``"random"``, the authors' window range). Only the window's steps are recorded.
    """

    stochastic = True

    def __init__(self, sigmas: torch.Tensor, noise_level: float, kind: str = "sde", window: int | None = None,
                 window_at: str = "start", num_train_timesteps: int = 1000):
        if kind not in ("sde", "cps"):
            raise ValueError(f"kind must be sde or cps, got {kind!r}")
        self.sigmas, self.noise_level, self.kind = sigmas, noise_level, kind
        self.window, self.window_at, self.num_train_timesteps = window, window_at, num_train_timesteps
        self.forward = FlowForward(num_train_timesteps)

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1

    def describe(self) -> str:
        name = {"sde": "Flow-GRPO SDE", "cps": "Flow-CPS"}[self.kind]
        noise = f"noise level {self.noise_level}"
        if self.window is None:
            return f"{name} on all {self.num_steps} steps, {noise}"
        where = "the first steps" if self.window_at == "start" else "drawn per batch in the first half"
        return f"{name} on a window of {self.window} of {self.num_steps} steps ({where}), ODE elsewhere, {noise}"

    def draw_window(self, generator) -> tuple[int, int]:
        if self.window is None:
            return 0, self.num_steps
        if self.window_at == "start":
            return 0, self.window
        return draw_window(self.window, (0, max(self.window, int(self.num_steps * FAST_WINDOW_SHARE))), generator)

    def _gaussian_step(self, x, prediction, step_indices):
        sigma, sigma_next = self.sigmas[step_indices], self.sigmas[step_indices + 1]
        if self.kind == "cps":
            return cps_step(x, prediction, sigma, sigma_next, self.noise_level)
        return sde_step(x, prediction, sigma, sigma_next, float(self.sigmas[1]), self.noise_level)

    @torch.no_grad()
    def run(self, predict: Predict, noise: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        start, end = self.draw_window(generator)
        x = noise.float()
        batch = x.shape[0]
        inputs, outputs, log_probs, timesteps = [], [], [], []
        for i in range(self.num_steps):
            t = (self.sigmas[i] * self.num_train_timesteps).expand(batch)
            prediction = predict(x, t)
            if start <= i < end:
                step = self._gaussian_step(x, prediction, torch.full((batch,), i, device=x.device))
                z = standard_normal(x, generator)
                x_next = step.mean + step.std * z
                inputs.append(x)
                outputs.append(x_next)
                log_probs.append(self._log_density(x_next, step.mean, step.std))
                timesteps.append(t)
            else:
                x_next = ode_step(x, prediction, self.sigmas[i], self.sigmas[i + 1])
            x = x_next
        return {"latents": _stack(inputs, x), "next_latents": _stack(outputs, x), "log_probs": torch.stack(log_probs, 1),
                "timesteps": torch.stack(timesteps, 1),
                "step_indices": torch.arange(start, end, device=x.device).expand(batch, -1).clone(), "final_latents": x}

    def _log_density(self, x, mean, std):
        return cps_log_prob(x, mean) if self.kind == "cps" else flow_gaussian_log_prob(x, mean, std)

    def step(self, prediction, latents, timesteps, step_indices) -> StepGaussian:
        step = self._gaussian_step(latents, prediction, step_indices)
        return StepGaussian(step.mean, step.std, self._log_density,
                            lambda ref_mean: flow_grpo_kl(step.mean, ref_mean, step.sde_sigma))


class ODESampler:
    """The deterministic chain, every step recorded, no log-probabilities: Euler on ``sigmas`` (flow families; or
    ``solver="dpm2"``, DiffusionNFT's second-order multistep solver) or DDIM with η = 0 on ``scheduler`` (the
    others). What DiffusionNFT and AWM sample with."""

    stochastic = False

    def __init__(self, num_inference_steps: int, sigmas: torch.Tensor | None = None, scheduler=None,
                 num_train_timesteps: int = 1000, solver: str = "euler"):
        self.flow = sigmas is not None
        if solver not in ("euler", "dpm2") or (solver == "dpm2" and not self.flow):
            raise ValueError(f"solver {solver!r}: euler, or dpm2 for flow families")
        self.sigmas, self.num_inference_steps, self.num_train_timesteps = sigmas, num_inference_steps, num_train_timesteps
        self.solver = solver
        if self.flow:
            self.forward = FlowForward(num_train_timesteps)
        else:
            self.scheduler = type(scheduler).from_config(scheduler.config)
            self.scheduler.set_timesteps(num_inference_steps)
            self.forward = DDPMForward(self.scheduler)

    def describe(self) -> str:
        kind = ("DPM-Solver++(2M) ODE" if self.solver == "dpm2" else "Euler ODE") if self.flow else "DDIM, eta 0"
        return f"{kind}, {self.num_inference_steps} steps"

    @torch.no_grad()
    def run(self, predict: Predict, noise: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        batch = noise.shape[0]
        if self.flow:
            x, times = noise.float(), self.sigmas[:-1] * self.num_train_timesteps
        else:
            x, times = noise * self.scheduler.init_noise_sigma, self.scheduler.timesteps.to(noise.device)
        inputs, outputs, previous_x0 = [], [], None
        grid = self.sigmas.tolist() if self.flow else None
        for i, t in enumerate(times):
            t_batch = t.expand(batch)
            if self.flow and self.solver == "dpm2":
                x0 = x - grid[i] * predict(x, t_batch).float()
                x_next = dpm2_flow_step(x, x0, previous_x0, grid, i)
                previous_x0 = x0
            elif self.flow:
                x_next = ode_step(x, predict(x, t_batch), self.sigmas[i], self.sigmas[i + 1])
            else:
                prev_t = int(times[i + 1]) if i + 1 < len(times) else -1
                prediction = predict(self.scheduler.scale_model_input(x, t), t_batch)
                x_next = ddim_deterministic_jump(self.scheduler, prediction, t, x, prev_t)
            inputs.append(x)
            outputs.append(x_next)
            x = x_next
        steps = len(times)
        return {"latents": _stack(inputs, x), "next_latents": _stack(outputs, x),
                "log_probs": torch.full((batch, steps), float("nan"), device=x.device),
                "timesteps": times.unsqueeze(0).expand(batch, -1).clone(),
                "step_indices": torch.arange(steps, device=x.device).expand(batch, -1).clone(), "final_latents": x}

    def step(self, prediction, latents, timesteps, step_indices) -> StepGaussian:
        raise ValueError("the ODE sampler has no step log-probabilities (PPO needs --sampler sde, cps or ddim)")


# ----------------------------------------------------------------------------------------------
# The forward processes, for the objectives that train on them (align/sampling/forward.py has the maths). Each
# sampler holds its dynamics' one as ``sampler.forward``.


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

"""Flow-GRPO's stochastic samplers for the flow-matching families (SD3, FLUX): its SDE (``--sampler sde``) and
Flow-CPS (``--sampler cps``, the authors' current Fast configs), on every step or in a window of stochastic steps
inside the ODE (Flow-GRPO-Fast, ``--deterministic_tail``). The maths: align/sampling/flow.py."""

from __future__ import annotations

import torch

from align.sampling.base import (
    Predict,
    Sampler,
    SamplerEntry,
    StepGaussian,
    stack_steps,
    standard_normal,
    window_size,
)
from align.sampling.flow import (
    cps_log_prob,
    cps_step,
    draw_window,
    flow_grpo_kl,
    gaussian_log_prob,
    ode_step,
    sde_step,
)
from align.sampling.forward import FlowForward

FAST_WINDOW_SHARE = 0.5  # Flow-GRPO-Fast draws its window among the first half of the steps (sde_window_range)
KINDS = {"sde": "Flow-GRPO SDE", "cps": "Flow-CPS"}


class FlowSampler(Sampler):
    """``window``: None makes every step stochastic (Flow-GRPO); an int w makes a window of w stochastic steps, the
    rest the ODE (Flow-GRPO-Fast), at the start (``window_at="start"``) or drawn per batch within the first half of
    the steps (``"random"``, the authors' window range). Only the window's steps are recorded."""

    def __init__(self, sigmas: torch.Tensor, noise_level: float, kind: str = "sde", window: int | None = None,
                 window_at: str = "start", num_train_timesteps: int = 1000):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        self.sigmas, self.noise_level, self.kind = sigmas, noise_level, kind
        self.window, self.window_at, self.num_train_timesteps = window, window_at, num_train_timesteps
        self.forward = FlowForward(num_train_timesteps)

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1

    @property
    def title(self) -> str:
        return KINDS[self.kind]

    def describe(self) -> str:
        noise = f"noise level {self.noise_level}"
        if self.window is None:
            return f"{self.title} on all {self.num_steps} steps, {noise}"
        where = "the first steps" if self.window_at == "start" else "drawn per batch in the first half"
        return f"{self.title} on a window of {self.window} of {self.num_steps} steps ({where}), ODE elsewhere, {noise}"

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

    def _log_density(self, x, mean, std):
        return cps_log_prob(x, mean) if self.kind == "cps" else gaussian_log_prob(x, mean, std)

    @torch.no_grad()
    def run(self, predict: Predict, noise: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        start, end = self.draw_window(generator)
        x = noise.float()
        batch = x.shape[0]
        inputs, outputs, means, log_probs, timesteps = [], [], [], [], []
        for i in range(self.num_steps):
            t = (self.sigmas[i] * self.num_train_timesteps).expand(batch)
            prediction = predict(x, t)
            if start <= i < end:
                step = self._gaussian_step(x, prediction, torch.full((batch,), i, device=x.device))
                x_next = step.mean + step.std * standard_normal(x, generator)
                inputs.append(x)
                outputs.append(x_next)
                means.append(step.mean)
                log_probs.append(self._log_density(x_next, step.mean, step.std))
                timesteps.append(t)
            else:
                x_next = ode_step(x, prediction, self.sigmas[i], self.sigmas[i + 1])
            x = x_next
        steps = {"latents": stack_steps(inputs, x), "next_latents": stack_steps(outputs, x),
                 "log_probs": torch.stack(log_probs, 1) if log_probs else x.new_zeros((batch, 0)),
                 "timesteps": torch.stack(timesteps, 1) if timesteps else x.new_zeros((batch, 0)),
                 "step_indices": torch.arange(start, end, device=x.device).expand(batch, -1).clone(),
                 "final_latents": x}
        if self.records_means:
            steps["means"] = stack_steps(means, x)
        return steps

    def chain_timesteps(self) -> torch.Tensor:
        if self.window is not None:  # Fast's window is drawn per batch: not one chain to differentiate
            return super().chain_timesteps()
        return self.sigmas[:-1] * self.num_train_timesteps

    def differentiable_step(self, prediction, latents, index: int, noise) -> torch.Tensor:
        if self.window is not None:
            return super().differentiable_step(prediction, latents, index, noise)
        step = self._gaussian_step(latents, prediction, torch.full((latents.shape[0],), index, device=latents.device))
        return step.mean + step.std * noise.float()

    def step(self, prediction, latents, timesteps, step_indices) -> StepGaussian:
        step = self._gaussian_step(latents, prediction, step_indices)
        dt = self.sigmas[step_indices] - self.sigmas[step_indices + 1]
        return StepGaussian(step.mean, step.std, self._log_density,
                            lambda ref_mean: flow_grpo_kl(step.mean, ref_mean, step.sde_sigma),
                            dt=dt.float().reshape(-1, *([1] * (latents.ndim - 1))), gaussian=self.kind != "cps")


def flow_sampler(kind: str):
    def build(config, family, pipe, resolution: int, device) -> FlowSampler:
        sigmas = family.flow_sigmas(pipe, config.num_inference_steps, resolution).to(device)
        return FlowSampler(sigmas, config.eta, kind=kind, window=window_size(config),
                           window_at="start" if config.timestep_selection == "high_noise" else "random",
                           num_train_timesteps=pipe.scheduler.config.num_train_timesteps)

    return build


ENTRIES = (
    SamplerEntry("sde", flow=True, title=KINDS["sde"], stochastic=True, build=flow_sampler("sde")),
    SamplerEntry("cps", flow=True, title=KINDS["cps"], stochastic=True, build=flow_sampler("cps")),
)

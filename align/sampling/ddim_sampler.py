"""DDIM for the DDPM families (SD 1.x/2.x, SDXL): stochastic with per-step log-probabilities (DDPO's sampler,
``--sampler ddim``), or deterministic (η = 0, ``--sampler ode``: what DiffusionNFT and AWM sample with)."""

from __future__ import annotations

import torch

from align.sampling.base import Predict, Sampler, SamplerEntry, StepGaussian, stack_steps, window_size
from align.sampling.ddim import (
    check_scheduler_steps,
    ddim_deterministic_jump,
    ddim_step_mean_std,
    ddim_step_with_logprob,
    gaussian_log_prob,
    gaussian_mean_kl,
)
from align.sampling.forward import DDPMForward


class DDIMSampler(Sampler):
    """DDIM with η > 0 on the first ``stochastic_steps`` steps (None: all of them; 0: none, the deterministic chain)
    and η = 0 after them (log-probability NaN), as MixGRPO's deterministic tail."""

    def __init__(self, scheduler, num_inference_steps: int, eta: float, stochastic_steps: int | None = None):
        # Its own copy: the pipeline's scheduler is reset by every held-out evaluation.
        self.scheduler = type(scheduler).from_config(scheduler.config)
        self.scheduler.set_timesteps(num_inference_steps)
        self.num_inference_steps, self.eta, self.stochastic_steps = num_inference_steps, eta, stochastic_steps
        self.forward = DDPMForward(self.scheduler)

    def describe(self) -> str:
        n, k = self.num_inference_steps, self.stochastic_steps
        if k == 0:
            return f"DDIM, eta 0, {n} steps"
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
        return {"latents": stack_steps(inputs, x), "next_latents": stack_steps(outputs, x),
                "log_probs": torch.stack(log_probs, 1), "timesteps": chain.unsqueeze(0).expand(batch, -1).clone(),
                "step_indices": torch.arange(len(chain), device=x.device).expand(batch, -1).clone(), "final_latents": x}

    def chain_timesteps(self) -> torch.Tensor:
        return self.scheduler.timesteps

    def differentiable_step(self, prediction, latents, index: int, noise) -> torch.Tensor:
        """``run``'s step ``index`` (DDIM's scale_model_input is the identity): η > 0 inside the stochastic steps, the η = 0
        jump after them."""
        chain = self.scheduler.timesteps
        t = chain[index].to(latents.device).expand(latents.shape[0])
        if self.stochastic_steps is not None and index >= self.stochastic_steps:
            prev_t = int(chain[index + 1]) if index + 1 < len(chain) else -1
            return ddim_deterministic_jump(self.scheduler, prediction, t, latents.float(), prev_t)
        mean, std = ddim_step_mean_std(self.scheduler, prediction, t, latents, self.eta)
        return mean + std * noise.float()

    def step(self, prediction, latents, timesteps, step_indices) -> StepGaussian:
        if self.stochastic_steps == 0:
            return super().step(prediction, latents, timesteps, step_indices)
        mean, std = ddim_step_mean_std(self.scheduler, prediction, timesteps, latents, self.eta)
        return StepGaussian(mean, std, gaussian_log_prob, lambda ref_mean: gaussian_mean_kl(mean, ref_mean, std))


def stochastic_ddim(config, family, pipe, resolution: int, device) -> DDIMSampler:
    check_scheduler_steps(pipe.scheduler, config.num_inference_steps, config.eta)
    return DDIMSampler(pipe.scheduler, config.num_inference_steps, config.eta, stochastic_steps=window_size(config))


def deterministic_ddim(config, family, pipe, resolution: int, device) -> DDIMSampler:
    return DDIMSampler(pipe.scheduler, config.num_inference_steps, 0.0, stochastic_steps=0)


ENTRIES = (
    SamplerEntry("ddim", flow=False, title="stochastic DDIM (DDPO)", stochastic=True, build=stochastic_ddim),
    SamplerEntry("ode", flow=False, title="DDIM with eta 0", stochastic=False, build=deterministic_ddim),
)

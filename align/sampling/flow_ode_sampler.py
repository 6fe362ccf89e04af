"""The deterministic chain of the flow-matching families (SD3, FLUX), every step recorded, no log-probabilities: Euler
(``--sampler ode``) or DiffusionNFT's second-order multistep DPM-Solver++(2M) (``--sampler dpm2``). What DiffusionNFT
and AWM sample with (they train on the forward process of the final images)."""

from __future__ import annotations

import torch

from align.sampling.base import Predict, Sampler, SamplerEntry, stack_steps
from align.sampling.flow import dpm2_flow_step, ode_step
from align.sampling.forward import FlowForward

SOLVERS = {"euler": "Euler ODE", "dpm2": "DPM-Solver++(2M) ODE"}


class ODESampler(Sampler):
    def __init__(self, num_inference_steps: int, sigmas: torch.Tensor, num_train_timesteps: int = 1000,
                 solver: str = "euler"):
        if solver not in SOLVERS:
            raise ValueError(f"solver {solver!r}: one of {', '.join(SOLVERS)}")
        self.sigmas, self.num_inference_steps, self.num_train_timesteps = sigmas, num_inference_steps, num_train_timesteps
        self.solver = solver
        self.forward = FlowForward(num_train_timesteps)

    def describe(self) -> str:
        return f"{SOLVERS[self.solver]}, {self.num_inference_steps} steps"

    @torch.no_grad()
    def run(self, predict: Predict, noise: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        batch = noise.shape[0]
        x, times = noise.float(), self.sigmas[:-1] * self.num_train_timesteps
        inputs, outputs, previous_x0 = [], [], None
        grid = self.sigmas.tolist()
        for i, t in enumerate(times):
            t_batch = t.expand(batch)
            if self.solver == "dpm2":
                x0 = x - grid[i] * predict(x, t_batch).float()
                x_next = dpm2_flow_step(x, x0, previous_x0, grid, i)
                previous_x0 = x0
            else:
                x_next = ode_step(x, predict(x, t_batch), self.sigmas[i], self.sigmas[i + 1])
            inputs.append(x)
            outputs.append(x_next)
            x = x_next
        steps = len(times)
        return {"latents": stack_steps(inputs, x), "next_latents": stack_steps(outputs, x),
                "log_probs": torch.full((batch, steps), float("nan"), device=x.device),
                "timesteps": times.unsqueeze(0).expand(batch, -1).clone(),
                "step_indices": torch.arange(steps, device=x.device).expand(batch, -1).clone(), "final_latents": x}


    def chain_timesteps(self) -> torch.Tensor:
        if self.solver != "euler":  # a multistep solver's step also depends on the previous step's x0
            return super().chain_timesteps()
        return self.sigmas[:-1] * self.num_train_timesteps

    def differentiable_step(self, prediction, latents, index: int, noise) -> torch.Tensor:
        if self.solver != "euler":
            return super().differentiable_step(prediction, latents, index, noise)
        return ode_step(latents, prediction, self.sigmas[index], self.sigmas[index + 1])


def flow_ode(solver: str):
    def build(config, family, pipe, resolution: int, device) -> ODESampler:
        sigmas = family.flow_sigmas(pipe, config.num_inference_steps, resolution).to(device)
        return ODESampler(config.num_inference_steps, sigmas=sigmas,
                          num_train_timesteps=pipe.scheduler.config.num_train_timesteps, solver=solver)

    return build


ENTRIES = (
    SamplerEntry("ode", flow=True, title=SOLVERS["euler"], stochastic=False, build=flow_ode("euler")),
    SamplerEntry("dpm2", flow=True, title=SOLVERS["dpm2"], stochastic=False, build=flow_ode("dpm2")),
)

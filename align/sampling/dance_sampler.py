"""Dance-SDE, DanceGRPO's dynamics (Xue et al. 2025, arXiv 2505.07818), for every flow-matching family
(``--sampler dance``): Flow-GRPO's reverse SDE with the constant diffusion coefficient σ_t = η instead of
η·√(t/(1-t)) (align/sampling/flow.py ``dance_step``). Every step stochastic but the last, or with
``--deterministic_tail`` a window of them inside the ODE, as ``--sampler sde``.

The last step: the authors' sampler (XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py @ 15cc71d, ``run_sample_step``)
takes it stochastically but decodes its x̂0 = x - σ·v (``latents = pred_original``), so its noise never reaches the
image, and their training never scores it (``timesteps[:, :-1]``). Here it is the ODE step, whose output x + (0 - σ)·v
is that same x̂0 bit for bit, and it is not recorded: the trained steps are drawn among the others, as theirs.
"""

from __future__ import annotations

from align.sampling.base import SamplerEntry, window_size
from align.sampling.flow import dance_step
from align.sampling.flow_sde_sampler import FlowSampler


class DanceSampler(FlowSampler):
    """FlowSampler with Dance-SDE steps (Gaussian, the Gaussian log-density averaged over the latent's elements)."""

    @property
    def title(self) -> str:
        return "Dance-SDE"

    def draw_window(self, generator) -> tuple[int, int]:
        if self.window is None:
            return 0, self.num_steps - 1  # the last step is the ODE step (see the module's docstring)
        return super().draw_window(generator)

    def describe(self) -> str:
        if self.window is None:
            return f"Dance-SDE on the first {self.num_steps - 1} of {self.num_steps} steps, ODE last, noise level {self.noise_level}"
        return super().describe()

    def _gaussian_step(self, x, prediction, step_indices):
        return dance_step(x, prediction, self.sigmas[step_indices], self.sigmas[step_indices + 1], self.noise_level)


def build_dance(config, family, pipe, resolution: int, device) -> DanceSampler:
    sigmas = family.flow_sigmas(pipe, config.num_inference_steps, resolution).to(device)
    return DanceSampler(sigmas, config.eta, window=window_size(config),
                        window_at="start" if config.timestep_selection == "high_noise" else "random",
                        num_train_timesteps=pipe.scheduler.config.num_train_timesteps)


ENTRIES = (SamplerEntry("dance", flow=True, title="Dance-SDE (DanceGRPO)", stochastic=True, build=build_dance),)

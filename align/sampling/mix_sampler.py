"""MixGRPO's mixed ODE-SDE sampling (Li et al. 2025, arXiv 2507.21802) for the flow-matching families (``--sampler mix``):
stochastic steps only inside a window of ``--timestep_fraction`` of the steps, the ODE (Euler) everywhere else, and the
window slides along the chain as training goes: it starts at the first step, moves ``--mix_window_stride`` steps
later every ``--mix_window_epochs`` epochs, and rolls back to the start past the end. Only the window's steps are
recorded (and trained, all of them, as the authors' ``training_strategy="part"``).

As the authors' code (Tencent-Hunyuan/MixGRPO @ e5cdd6a): fastvideo/utils/grpo_states.py ``GRPOTrainingStates`` with
``sample_strategy="progressive"``, ``prog_overlap=True`` and ``roll_back=True`` (scripts/finetune/
finetune_flux_grpo_MixGRPO.sh: window 4 of 25 steps, moved by 1 every 25 iterations), where one of their iterations
(sampling a batch of prompts, then training on it) is one epoch here; windows end before step N - 2 (their
``max_timesteps = sampling_steps - 2``, so the last two steps are always the ODE's); inside the window Flow-GRPO's SDE
(their ``--flow_grpo_sampling``, on in that script: ``flow_grpo_step``) or DanceGRPO's (``--mix_dynamics dance``:
``dance_grpo_step``). One difference: where their window would be empty (its start reaching N - 2, for
``mix_window_epochs`` iterations before the roll-back; never reached in their 300-iteration recipe) this one rolls back
at once. Not implemented: MixGRPO-Flash's DPM-Solver++ on a compressed schedule after the window.
"""

from __future__ import annotations

from dataclasses import dataclass

from align.cli import ConfigError, option
from align.declared import COUNT
from align.sampling.base import SamplerEntry
from align.sampling.flow import dance_step
from align.sampling.flow_sde_sampler import FlowSampler

DYNAMICS = {"sde": "Flow-GRPO SDE", "dance": "Dance-SDE"}


def mix_window(epoch: int, size: int, num_steps: int, epochs_per_position: int, stride: int) -> tuple[int, int]:
    """(start, end) of the stochastic window at ``epoch``: start = stride·(epoch // epochs_per_position), rolled back
    to 0 once it would reach num_steps - 2; end = min(start + size, num_steps - 2) (the authors' max_timesteps)."""
    last = num_steps - 2  # the window's steps are < last
    if not 1 <= size <= last:
        raise ValueError(f"a window of {size} steps does not fit before step {last} of {num_steps}")
    positions = (last - 1) // stride + 1  # starts 0, stride, ... below last
    start = stride * ((epoch // epochs_per_position) % positions)
    return start, min(start + size, last)


@dataclass
class MixOptions:
    """MixGRPO's sliding window (--sampler mix)."""

    mix_window_epochs: int = option(25, "MixGRPO: epochs the stochastic window stays at each position (the authors' "
                                    "iters_per_group: 25)", "--sampler mix", within=COUNT)
    mix_window_stride: int = option(1, "MixGRPO: steps the window moves at each move (the authors' prog_overlap_step: 1)",
                                    "--sampler mix", within=COUNT)
    mix_dynamics: str = option("sde", "MixGRPO: the window's SDE, sde (Flow-GRPO's, the authors' script) or dance "
                               "(DanceGRPO's)", "--sampler mix", choices=tuple(DYNAMICS))

    def check(self) -> None:
        if self.deterministic_tail:
            raise ConfigError("--deterministic_tail is --sampler sde's fixed window: --sampler mix moves its own window "
                              "(--timestep_fraction of the steps)")
        if self.num_train_timesteps > self.num_inference_steps - 2:
            raise ConfigError(f"--sampler mix's window (--timestep_fraction x --num_inference_steps = "
                              f"{self.num_train_timesteps} steps) must end before the last two steps (at most "
                              f"{self.num_inference_steps - 2})")


class MixSampler(FlowSampler):
    """FlowSampler whose window is the epoch's (``set_epoch``), with Flow-GRPO's or DanceGRPO's steps inside it."""

    def __init__(self, sigmas, noise_level: float, window: int, epochs_per_position: int, stride: int,
                 dynamics: str = "sde", num_train_timesteps: int = 1000):
        super().__init__(sigmas, noise_level, kind="sde", window=window, num_train_timesteps=num_train_timesteps)
        self.epochs_per_position, self.stride, self.dynamics = epochs_per_position, stride, dynamics
        self.epoch = 0

    @property
    def title(self) -> str:
        return f"MixGRPO ({DYNAMICS[self.dynamics]} window)"

    def describe(self) -> str:
        return (f"MixGRPO: {DYNAMICS[self.dynamics]} on a window of {self.window} of {self.num_steps} steps moved "
                f"{self.stride} step(s) later every {self.epochs_per_position} epochs, ODE elsewhere, noise level "
                f"{self.noise_level}")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def draw_window(self, generator) -> tuple[int, int]:
        return mix_window(self.epoch, self.window, self.num_steps, self.epochs_per_position, self.stride)

    def _gaussian_step(self, x, prediction, step_indices):
        if self.dynamics == "dance":
            return dance_step(x, prediction, self.sigmas[step_indices], self.sigmas[step_indices + 1], self.noise_level)
        return super()._gaussian_step(x, prediction, step_indices)


def build_mix(config, family, pipe, resolution: int, device) -> MixSampler:
    sigmas = family.flow_sigmas(pipe, config.num_inference_steps, resolution).to(device)
    return MixSampler(sigmas, config.eta, config.num_train_timesteps, config.mix_window_epochs, config.mix_window_stride,
                      config.mix_dynamics, num_train_timesteps=pipe.scheduler.config.num_train_timesteps)


ENTRIES = (SamplerEntry("mix", flow=True, title="MixGRPO's sliding SDE window", stochastic=True, build=build_mix,
                        options=MixOptions),)

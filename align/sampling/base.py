"""What a sampler of the online-RL trainer is, and the registry entry that names one.

A sampler runs the denoising chain from noise with the model's (guided) prediction and records the steps an objective
may train on (``run``); a stochastic one also gives the Gaussian of one recorded step under another prediction
(``step``), so that PPO re-scores a stored step with the current weights exactly as it was sampled. Every sampler holds
its dynamics' forward process (``forward``: align/sampling/forward.py), which is all the forward-process objectives
(DiffusionNFT, AWM) need.

A sampler plugs in with one ``SamplerEntry`` per ``--sampler`` name and dynamics, listed in
align/sampling/registry.py; the trainer, --help and the config checks read that table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from align.sampling.forward import ForwardProcess

Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (latents [B, ...], timesteps [B]) -> model output


@dataclass
class StepGaussian:
    """One stochastic step as the Gaussian N(mean, std²) with the sampler's log-density and the KL it trains with."""

    mean: torch.Tensor
    std: torch.Tensor
    log_density: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, mean, std) -> [B]
    kl_to: Callable[[torch.Tensor], torch.Tensor]  # reference mean -> [B]
    dt: torch.Tensor | None = None  # [B, 1, ...]: σ - σ_next of flow steps (GRPO-Guard weights by it); None elsewhere
    gaussian: bool = True  # log_density is the Gaussian's (CPS's is not: -mean((x - mean)²))

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_density(x, self.mean, self.std)


class Sampler(ABC):
    """The denoising chain of one dynamics. ``run`` returns, batch-first, the recorded steps' inputs ``latents`` and
    outputs ``next_latents`` [B, K, ...], their ``timesteps`` and ``step_indices`` [B, K], ``log_probs`` [B, K] (NaN
    where a step is deterministic) and the ``final_latents`` [B, ...]; with ``records_means`` set (by an objective that
    needs them, GRPO-Guard) a stochastic sampler also returns each recorded step's Gaussian mean, ``means`` [B, K, ...].

    ``set_epoch`` is called before each epoch's sampling, with the epoch's index: a sampler whose steps move over
    training (MixGRPO's sliding window) places them there; the others ignore it."""

    forward: ForwardProcess
    records_means: bool = False

    def set_epoch(self, epoch: int) -> None:
        """The epoch about to be sampled (0-based, the same on every process and after a resume)."""
        return None  # most samplers are the same every epoch

    @abstractmethod
    def describe(self) -> str:
        """One line for the run's log and model card."""

    @abstractmethod
    def run(self, predict: Predict, noise: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """The chain from ``noise``, every random draw from ``generator``."""

    def step(self, prediction, latents, timesteps, step_indices) -> StepGaussian:
        """The Gaussian of recorded steps under ``prediction`` (stochastic samplers only)."""
        raise ValueError(f"{self.describe()} has no step log-probabilities")

    def chain_timesteps(self) -> torch.Tensor:
        """[N] the denoiser's timestep at each step of the chain, in sampling order (samplers that can sample with
        gradients: reward backpropagation, align/train/reward_backprop.py)."""
        raise ValueError(f"{self.describe()} cannot sample with gradients (reward backpropagation)")

    def differentiable_step(self, prediction: torch.Tensor, latents: torch.Tensor, index: int,
                            noise: torch.Tensor) -> torch.Tensor:
        """Step ``index`` of the chain from ``latents`` under ``prediction``, differentiable in both; ``noise`` is the
        step's N(0, I) draw (a deterministic step ignores it). ``run`` takes the same steps without gradients."""
        raise ValueError(f"{self.describe()} cannot sample with gradients (reward backpropagation)")


@dataclass(frozen=True)
class SamplerEntry:
    """One ``--sampler`` value for one kind of model: ``flow`` True for flow-matching families (SD3, FLUX), False for
    the DDPM/DDIM ones (SD 1.x/2.x, SDXL). ``stochastic``: its steps have log-probabilities (what PPO trains on).
    ``build(config, family, pipe, resolution, device)`` makes the sampler from the trainer's config. ``options``: the
    dataclass of the sampler's own flags (None: it has none), which the trainer's config inherits and shows under its
    own --help section, as an algorithm's."""

    name: str
    flow: bool
    title: str
    stochastic: bool
    build: Callable[..., Sampler]
    options: type | None = None


def standard_normal(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """N(0, I) noise shaped like ``like``, drawn on the generator's device (a CPU generator serves a GPU run)."""
    device = generator.device if generator is not None else like.device
    return torch.randn(like.shape, generator=generator, device=device, dtype=torch.float32).to(like.device)


def stack_steps(steps: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """[B, K, ...] from K tensors [B, ...] (an empty K = 0 stack shaped after ``like``)."""
    return torch.stack(steps, dim=1) if steps else like.new_zeros((like.shape[0], 0, *like.shape[1:]))


def window_size(config) -> int | None:
    """The stochastic window of --deterministic_tail (the trained steps), or None: every step stochastic."""
    return config.num_train_timesteps if config.deterministic_tail else None

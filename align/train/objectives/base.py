"""What an objective of the online-RL trainer is, and the registry entry that names one (``Algorithm``).

An objective turns some samples' trained steps (a ``TrainBatch``) into a loss through the policy's predictions
(``PolicyPredictions``). Everything the run needs to know about an algorithm before any model loads (its flags, the
sampler it needs, whether it keeps an old policy, how it is named in the model card, what the report plots) is in its
``Algorithm`` entry; align/train/objectives/__init__.py lists the entries, and the trainer, --help, the config checks,
the memory planner and the model card read that table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from align.families.base import Conditioning
from align.train.report import Curve
from align.train.rollout import TrainBatch

WHICH = ("policy", "reference", "old")


class PolicyPredictions(Protocol):
    """The denoiser as an objective sees it: the guided prediction of the trained policy (``which="policy"``, with
    gradient), of the reference (the adapter off, or a frozen copy) or of the old policy (no gradient), at the run's
    guidance or at ``guidance_scale`` (1: the conditional prediction alone; families with a guidance embedding keep
    the run's value, they have no classifier-free guidance to leave out)."""

    def predict(self, latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, uncond: Conditioning,
                which: str = "policy", guidance_scale: float | None = None) -> torch.Tensor: ...


class Objective(ABC):
    """One algorithm's loss on the trained steps of an epoch's rollouts.

    ``samples_with_old_policy``: the old policy draws the rollouts (DiffusionNFT); ``needs_forward_noise``: each trained
    step noises the sample's final latents afresh through the sampler's forward process (DiffusionNFT, AWM), so the
    trainer draws that noise with the epoch's plan; ``trains_whole_groups``: the loss couples a prompt's images (DGPO),
    so each micro-batch holds whole groups, consecutive, at the same steps and with the same forward noise."""

    samples_with_old_policy: bool = False
    needs_forward_noise: bool = False
    trains_whole_groups: bool = False
    samples_with_gradients: bool = False  # reward backpropagation (``BackpropObjective``): the other shape of epoch

    @classmethod
    @abstractmethod
    def from_config(cls, sampler, config) -> Objective:
        """The objective of a run's config (its own options and the shared ones) on ``sampler``."""

    @staticmethod
    def keeps_old_policy(config) -> bool:
        """Whether the run keeps an old policy (a moving average of the trained weights): read by the trainer and
        by the memory planner (a second copy of the trained weights)."""
        return False

    @staticmethod
    def kept_forwards(config) -> int:
        """Denoiser forwards whose activations are held at once for one backward, per training micro-batch (read by
        the memory planner): 1 for a loss on recorded steps; reward backpropagation keeps its backpropagated steps."""
        return 1

    def old_policy_decay(self, step: int) -> float:
        """The old policy's decay after ``step`` optimiser steps (objectives that keep one)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no old policy")

    @property
    def zero_advantage_is_zero_loss(self) -> bool:
        """A sample whose advantage is 0 has exactly zero loss and gradient: the update may skip it."""
        return False

    @abstractmethod
    def loss(self, models: PolicyPredictions, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean loss over the batch's rows and the metrics to log (scalars)."""

    @abstractmethod
    def describe(self) -> str:
        """Its settings in one line (the model card's "objective" row)."""


class BackpropObjective(Objective):
    """An algorithm that samples WITH gradients and backpropagates a differentiable judge's score through the image
    (reward backpropagation: DRaFT, AlignProp, ReFL). The trainer runs align/train/reward_backprop.py's epoch for it
    (sample with gradients -> score -> backpropagate -> step) instead of the rollout epoch (sample -> reward ->
    advantages -> update); it records no steps, so it has no ``loss`` on a ``TrainBatch``.

    ``copies``: images scored per sampled noise (DRaFT-LV's re-noised copies; 1 otherwise)."""

    samples_with_gradients = True
    copies: int = 1

    def loss(self, models, batch):
        raise TypeError(f"{type(self).__name__} samples with gradients: its epoch is align/train/reward_backprop.py's")

    @abstractmethod
    def sample(self, sampler, predict, noise: torch.Tensor, generator: torch.Generator) -> tuple[
            torch.Tensor, dict[str, float]]:
        """(latents to decode and score [copies x B, ...], carrying the trained model's gradient where the algorithm
        keeps it; metrics of the draw), from ``noise`` [B, ...] with every random draw from ``generator``;
        ``predict(latents, timesteps)`` is the trained model's guided prediction (align/train/backprop_sampling.py)."""

    @abstractmethod
    def reward_loss(self, rewards: torch.Tensor) -> torch.Tensor:
        """The mean loss of the rewards [copies x B] (with gradients) as the authors write it."""


@dataclass(frozen=True)
class Method:
    """How an algorithm is named in the run's log, model card and report, and the paper it is from."""

    title: str
    paper: str


@dataclass(frozen=True)
class Algorithm:
    """One ``--algorithm`` value.

    ``options``: the dataclass of the algorithm's own flags (None: it has none beyond the shared ones); the trainer's
    config inherits it, so its flags are ``align/ddpo.py``'s, shown under their own --help section.
    ``needs_log_probs``: it trains on the sampled steps' log-probabilities, so it needs a stochastic sampler.
    ``ddpm_defaults`` / ``flow_defaults``: the values of the options left unset (None) on DDPM/DDIM families and on
    flow-matching ones (its sampler, ...). ``flow_method``: its name on flow-matching families where that differs.
    """

    name: str
    summary: str  # what it is, for --algorithm's help
    method: Method
    objective: type[Objective]
    needs_log_probs: bool
    ddpm_defaults: Mapping[str, object]
    flow_defaults: Mapping[str, object]
    curves: tuple[Curve, ...]  # its loss and diagnostics, as the report plots them
    options: type | None = None
    flow_method: Method | None = None
    flow_only: bool = False  # its maths need flow-matching steps (GRPO-Guard): refused on DDPM/DDIM families

    def method_for(self, flow: bool) -> Method:
        return self.flow_method if flow and self.flow_method is not None else self.method

    def defaults(self, flow: bool) -> Mapping[str, object]:
        return self.flow_defaults if flow else self.ddpm_defaults

    @property
    def samples_with_gradients(self) -> bool:
        """How it trains: True for reward backpropagation (align/train/reward_backprop.py's epoch), False for the
        rollout epoch (sample -> reward -> advantages -> update)."""
        return self.objective.samples_with_gradients

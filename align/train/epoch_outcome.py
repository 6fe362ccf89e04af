"""What one epoch of the online-RL trainer hands back to its loop (align/train/ddpo.py), whichever shape of epoch ran
it: the rollout epoch (sample -> reward -> advantages -> update) or reward backpropagation's (sample with gradients ->
score -> backpropagate; align/train/reward_backprop.py). The loop logs, saves samples and checkpoints from it alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class EpochOutcome:
    shown: object  # what the run's samples/ row shows: ``.images`` [N, 3, H, W] on the CPU and ``.prompts``
    local_rewards: torch.Tensor  # this process's rewards, in the order of ``shown``
    all_rewards: np.ndarray  # every process's rewards (float64): the epoch's reward mean and std
    reward_parts: dict[str, float]  # each judge's mean reward over every process (reward_<judge>)
    stats: dict[str, list[float]]  # the update's metrics, one value per micro-batch (averaged over processes by the loop)
    steps: int  # optimiser steps taken
    timing: dict[str, float] = field(default_factory=dict)  # seconds of the epoch's parts, logged as they are

"""Advantages for DDPO: rewards normalised per prompt.

- ``per-prompt`` (DDPO / ddpo-pytorch): each prompt keeps a buffer of its recent rewards; a reward
  is normalised by that buffer's mean and std once it holds ``min_count`` values, and by the
  statistics of the whole batch before that.
- ``group`` (GRPO / Flow-GRPO): normalised by the mean and std (+ 1e-4, as Flow-GRPO) of the rewards of the same
  prompt in this batch only (the group of samples drawn for one prompt).
- ``group-mean`` (Dr. GRPO): the reward minus its group's mean, not divided by the group's std, so a
  group whose rewards differ by a little does not weigh as much as one whose rewards differ by a lot.
- ``global-std`` (Flow-GRPO as its authors run it): the reward minus its group's mean, divided by the std of
  all the batch's rewards (+ 1e-4), so every group is measured on the same scale.
- ``batch``: normalised by the whole batch's mean and std.
- ``gdpo`` (GDPO, NVlabs 2026, arXiv 2601.05242; several judges): each judge's rewards are normalised within their
  prompt's group before the weighted sum (``gdpo_combined_rewards``, applied by the reward mix of
  align/train/ddpo_rewards.py as it scores each batch), so a judge with a wide spread cannot drown the others; the
  sums are then normalised over the batch (``gdpo_batch_advantages``). Both as the authors' trl-GDPO
  (NVlabs/GDPO trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py @ b080e63): torch's unbiased std, + 1e-4.

``kept_sample_mask`` is Flow-GRPO's rule for which samples the update trains on (the zero-advantage filter).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

MODES = ("per-prompt", "group", "group-mean", "global-std", "batch", "gdpo")
GROUP_MODES = ("group", "group-mean", "global-std", "gdpo")  # they need groups: --images_per_prompt >= 2
EPS = 1e-6  # ddpo-pytorch's stat_tracking.py adds 1e-6 to its std (per-prompt mode and its batch fallback)
GROUP_EPS = 1e-4  # Flow-GRPO's stat_tracking.py adds 1e-4 to its std, the group's and the global one
GDPO_EPS = 1e-4  # GDPO's trl-GDPO adds 1e-4 to its (unbiased) stds


def centre(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """values - mean of the reference set, which holds the values.

    A constant reference set gives exactly 0, not float dust: its samples carry no preference, and
    the trainer skips zero-advantage samples in the update (their gradient is exactly zero).
    """
    reference = np.asarray(reference, dtype=np.float64)
    if reference.max() == reference.min():
        return np.zeros_like(values, dtype=np.float64)
    return values - reference.mean()


def standardise(values: np.ndarray, reference: np.ndarray, eps: float = EPS) -> np.ndarray:
    """(values - mean) / (std + eps) of the reference set; exactly 0 for a constant one (see centre)."""
    return centre(values, reference) / (np.std(reference) + eps)


def batch_advantages(rewards: np.ndarray) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    return standardise(rewards, rewards)


def group_advantages(prompts: list[str], rewards: np.ndarray, divide_by_std: bool = True) -> np.ndarray:
    """(r - mean of its prompt's group) / (std of the group + 1e-4), within this batch.

    divide_by_std=False: r - mean of the group only (Dr. GRPO).
    The epsilon is Flow-GRPO's (``PerPromptStatTracker(global_std=False)``, yifan123/flow_grpo
    flow_grpo/stat_tracking.py: ``np.std(...) + 1e-4``). A tied group is exactly 0 here; the authors do not
    special-case it (its r - mean is 0 for float32 rewards, float dust / 1e-4 at worst).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    prompts_arr = np.asarray(prompts, dtype=object)
    advantages = np.zeros_like(rewards)
    for prompt in dict.fromkeys(prompts):
        mask = prompts_arr == prompt
        if divide_by_std:
            advantages[mask] = standardise(rewards[mask], rewards[mask], GROUP_EPS)
        else:
            advantages[mask] = centre(rewards[mask], rewards[mask])
    return advantages


def global_std_advantages(prompts: list[str], rewards: np.ndarray) -> np.ndarray:
    """(r - mean of its prompt's rewards in this batch) / (std of all the batch's rewards + 1e-4).

    Flow-GRPO's ``PerPromptStatTracker(global_std=True).update`` (yifan123/flow_grpo flow_grpo/stat_tracking.py
    @ 94e23ee), as train_sd3.py calls it: once per epoch on the rewards of every process's samples, the tracker
    cleared after each call, so the mean is over this batch's rewards of the prompt only. The std is numpy's
    population std (ddof 0) of all the batch's rewards. A prompt with a single sample gets 0 (its reward minus
    itself), as does a group of tied rewards. Here tied groups give exactly 0 always; the authors' r - mean is
    exactly 0 too for their trainer's rewards (float32 values, whose tied means are exact in float64), but float
    dust for float64 rewards whose tied mean is inexact (three 0.1s: ~1e-17 / (std + 1e-4)), which their
    zero-advantage filter would keep.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if len(prompts) != len(rewards):
        raise ValueError(f"got {len(prompts)} prompts for {len(rewards)} rewards")
    return group_advantages(prompts, rewards, divide_by_std=False) / (np.std(rewards) + GROUP_EPS)


def normalises_each_reward(mode: str) -> bool:
    """Whether the advantage mode wants each judge of a mix normalised in its group before the sum (GDPO)."""
    return mode == "gdpo"


def gdpo_combined_rewards(prompts: list[str], member_rewards, weights) -> np.ndarray:
    """GDPO's pre-normalisation sum: Σ_k w_k·(r_k - mean of r_k over its prompt's group) / (std of that group + 1e-4),
    std unbiased (ddof 1) as torch's. ``member_rewards`` [N, K] (judge k's reward of image i), ``weights`` [K]."""
    rewards = np.asarray(member_rewards, dtype=np.float64)
    prompts_arr = np.asarray(prompts, dtype=object)
    normalised = np.zeros_like(rewards)
    for prompt in dict.fromkeys(prompts):
        mask = prompts_arr == prompt
        if mask.sum() < 2:
            raise ValueError(f"GDPO normalises each judge within a prompt's group: prompt {prompt!r} has one image")
        group = rewards[mask]
        normalised[mask] = (group - group.mean(axis=0)) / (group.std(axis=0, ddof=1) + GDPO_EPS)
    return normalised @ np.asarray(weights, dtype=np.float64)


def gdpo_batch_advantages(combined) -> np.ndarray:
    """GDPO's batch normalisation of the combined rewards: (x - mean) / (unbiased std + 1e-4)."""
    combined = np.asarray(combined, dtype=np.float64)
    return (combined - combined.mean()) / (combined.std(ddof=1) + GDPO_EPS)


def kept_sample_mask(advantages, num_batches: int, generator: torch.Generator | None = None) -> np.ndarray:
    """Which of this process's samples Flow-GRPO's update trains on: [N] bool.

    The authors' rule (train_sd3.py and train_sd3_fast.py @ 74db691, on each process's own samples after the
    advantages are ungathered): a sample is kept when its advantage is nonzero (any |advantage| over the time
    dimension, when ``advantages`` is [N, T]). When the kept count k is not a multiple of ``num_batches`` (their
    ``sample.num_batches_per_epoch``, the number of training batches the kept samples are re-cut into),
    num_batches - k % num_batches of the dropped samples are kept too, drawn uniformly without replacement
    (``torch.randperm`` over the dropped indices in index order, from ``generator`` or torch's global RNG as
    theirs), so the kept samples split into num_batches equal batches. When no sample has a nonzero advantage,
    train_sd3_fast.py keeps num_batches of them at random (its ``or true_count == 0``), which this does;
    train_sd3.py keeps none, and its re-batching of zero samples then fails. (If fewer samples were dropped than
    are missing, nothing is added, as theirs; it cannot happen when N is a multiple of num_batches, as it is there.)

    In the update every kept sample counts alike: each batch's loss is the mean over its kept samples of the
    clipped surrogate plus beta·KL, so a zero-advantage sample kept to fill a batch adds 0 to the policy term but
    counts in the mean and adds its full KL term; dropped samples take no part at all (no policy term, no KL).
    """
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    adv = torch.as_tensor(np.asarray(advantages, dtype=np.float64))
    keep = adv.abs().reshape(len(adv), -1).sum(dim=1) != 0
    count = int(keep.sum())
    if count % num_batches != 0 or count == 0:
        dropped = torch.where(~keep)[0]
        missing = num_batches - count % num_batches
        if len(dropped) >= missing:
            keep[dropped[torch.randperm(len(dropped), generator=generator)[:missing]]] = True
    return keep.numpy()


class PerPromptStatTracker:
    """Running per-prompt reward statistics (DDPO). State is plain lists, so it checkpoints exactly."""

    def __init__(self, buffer_size: int = 16, min_count: int = 16):
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if min_count < 1 or min_count > buffer_size:
            raise ValueError(f"min_count must be in [1, buffer_size={buffer_size}], got {min_count}")
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.buffers: dict[str, deque] = {}

    def update(self, prompts: list[str], rewards: np.ndarray) -> np.ndarray:
        """Add this batch's rewards to the buffers, then return the advantages of the batch."""
        rewards = np.asarray(rewards, dtype=np.float64)
        if len(prompts) != len(rewards):
            raise ValueError(f"got {len(prompts)} prompts for {len(rewards)} rewards")
        prompts_arr = np.asarray(prompts, dtype=object)
        advantages = np.zeros_like(rewards)
        for prompt in dict.fromkeys(prompts):
            mask = prompts_arr == prompt
            buffer = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(rewards[mask].tolist())
            reference = rewards if len(buffer) < self.min_count else np.asarray(buffer)
            advantages[mask] = standardise(rewards[mask], reference)
        return advantages

    def stats(self) -> dict[str, float]:
        counts = [len(b) for b in self.buffers.values()]
        return {"tracked_prompts": float(len(counts)), "mean_buffer_count": float(np.mean(counts)) if counts else 0.0}

    def state_dict(self) -> dict:
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "buffers": {prompt: list(buffer) for prompt, buffer in self.buffers.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size = int(state["buffer_size"])
        self.min_count = int(state["min_count"])
        self.buffers = {p: deque(values, maxlen=self.buffer_size) for p, values in state["buffers"].items()}


def compute_advantages(
    mode: str, prompts: list[str], rewards: np.ndarray, tracker: PerPromptStatTracker | None = None
) -> np.ndarray:
    """Advantages for the rewards of every process's samples (call it on the gathered batch)."""
    if mode == "per-prompt":
        if tracker is None:
            raise ValueError("mode 'per-prompt' needs a PerPromptStatTracker")
        return tracker.update(prompts, rewards)
    if mode == "group":
        return group_advantages(prompts, rewards)
    if mode == "group-mean":
        return group_advantages(prompts, rewards, divide_by_std=False)
    if mode == "global-std":
        return global_std_advantages(prompts, rewards)
    if mode == "batch":
        return batch_advantages(rewards)
    if mode == "gdpo":  # the rewards are already each judge's group-normalised sum (MixedReward)
        return gdpo_batch_advantages(rewards)
    raise ValueError(f"unknown advantage mode {mode!r}; valid: {', '.join(MODES)}")

"""Advantages for DDPO: rewards normalised per prompt.

- ``per-prompt`` (DDPO / ddpo-pytorch): each prompt keeps a buffer of its recent rewards; a reward
  is normalised by that buffer's mean and std once it holds ``min_count`` values, and by the
  statistics of the whole batch before that.
- ``group`` (GRPO / Flow-GRPO): normalised by the mean and std of the rewards of the same prompt
  in this batch only (the group of samples drawn for one prompt).
- ``group-mean`` (Dr. GRPO): the reward minus its group's mean, not divided by the group's std, so a
  group whose rewards differ by a little does not weigh as much as one whose rewards differ by a lot.
- ``batch``: normalised by the whole batch's mean and std.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MODES = ("per-prompt", "group", "group-mean", "batch")
EPS = 1e-6  # guards the division when a reference set's std is tiny


def centre(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """values - mean of the reference set, which holds the values.

    A constant reference set gives exactly 0, not float dust: its samples carry no preference, and
    the trainer skips zero-advantage samples in the update (their gradient is exactly zero).
    """
    reference = np.asarray(reference, dtype=np.float64)
    if reference.max() == reference.min():
        return np.zeros_like(values, dtype=np.float64)
    return values - reference.mean()


def standardise(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """(values - mean) / (std + eps) of the reference set; exactly 0 for a constant one (see centre)."""
    return centre(values, reference) / (np.std(reference) + EPS)


def batch_advantages(rewards: np.ndarray) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    return standardise(rewards, rewards)


def group_advantages(prompts: list[str], rewards: np.ndarray, divide_by_std: bool = True) -> np.ndarray:
    """(r - mean of its prompt's group) / (std of the group + eps), within this batch.

    divide_by_std=False: r - mean of the group only (Dr. GRPO).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    prompts_arr = np.asarray(prompts, dtype=object)
    advantages = np.zeros_like(rewards)
    normalise = standardise if divide_by_std else centre
    for prompt in dict.fromkeys(prompts):
        mask = prompts_arr == prompt
        advantages[mask] = normalise(rewards[mask], rewards[mask])
    return advantages


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
    if mode == "batch":
        return batch_advantages(rewards)
    raise ValueError(f"unknown advantage mode {mode!r}; valid: {', '.join(MODES)}")

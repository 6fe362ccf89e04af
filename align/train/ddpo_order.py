"""Which samples DDPO draws and trains on, keyed by each sample's global slot, not by its process.

So that N processes do what one process with N times the gradient accumulation does (issue 37):
- sampling batch ``b`` of process ``p`` is global batch ``b * N + p``, and its prompts and noise come from
  that global batch's generator; one process drawing N times as many batches draws the same batches;
- the advantages are computed over the gathered samples put back in global order (the per-prompt
  tracker's buffers keep the *last* rewards, so their order matters);
- the training order is stratified by batch: each batch's samples are permuted by that batch's own
  generator, and the epoch reads the batches column by column (first every batch's first sample, then
  every batch's second, ...). When ``sample_batch_size`` is a multiple of the optimiser steps per epoch,
  every update takes whole columns, i.e. the same share of every batch, so the samples of update ``u`` on
  N processes together are the samples of update ``u`` of the one process (tests/test_ddpo_order.py).
  Otherwise it is still a shuffle of the epoch, only not the same as on another number of processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch

# Every random draw of epoch e comes from a generator seeded by (seed, e, part, index, process), so an interrupted
# run resumes exactly without saving sampler or data-loader state.
SAMPLE, TRAIN, NOISE = "sample", "train", "noise"


def epoch_generator(seed: int, epoch: int, part: str, index: int, process: int) -> torch.Generator:
    key = f"{seed}/{epoch}/{part}/{index}/{process}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))


def global_batch(batch: int, process: int, num_processes: int) -> int:
    """The global index of sampling batch `batch` of `process` (batches interleave across processes)."""
    return batch * num_processes + process


def gathered_slots(num_processes: int, batches_per_process: int, batch_size: int) -> np.ndarray:
    """For each position of a process-major gather of every process's samples, that sample's global index."""
    p = np.arange(num_processes)[:, None, None]
    b = np.arange(batches_per_process)[None, :, None]
    j = np.arange(batch_size)[None, None, :]
    return ((b * num_processes + p) * batch_size + j).reshape(-1)


def in_global_order(compute: Callable[[list, np.ndarray], np.ndarray], prompts: list, rewards: np.ndarray,
                    slots: np.ndarray) -> np.ndarray:
    """compute(prompts, rewards) over the samples sorted by global index; the result back in gathered order."""
    by_global = np.argsort(slots, kind="stable")  # the gathered position of each global index
    result = np.asarray(compute([prompts[i] for i in by_global], np.asarray(rewards)[by_global]))
    out = np.empty_like(result)
    out[by_global] = result
    return out


def stratified_order(batch_generators: list[torch.Generator], batch_size: int,
                     draw_steps: Callable[[torch.Generator], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(order of this process's samples [n], each sample's trained steps [n, k]) from one generator per batch.

    draw_steps(gen) gives a batch's [batch_size, k] step indices (the trainer's selection rule), after its permutation.
    """
    perms, steps = [], []
    for b, gen in enumerate(batch_generators):
        perms.append(torch.randperm(batch_size, generator=gen) + b * batch_size)
        steps.append(draw_steps(gen))
    order = torch.stack(perms).T.reshape(-1)  # column by column: every batch's first sample, then second, ...
    return order, torch.cat(steps)


def grouped_order(batch_generators: list[torch.Generator], batch_size: int, group_size: int,
                  draw_steps: Callable[[torch.Generator], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``stratified_order`` in whole groups, for objectives whose loss couples a prompt's images (DGPO): a batch's
    groups (``group_size`` consecutive samples, one prompt's images: draw_prompts lays them so) are permuted by the
    batch's generator and read group column by group column, each group's samples kept together; each group's samples
    share its trained steps (draw_steps(gen) gives [batch_size // group_size, k])."""
    groups = batch_size // group_size
    perms, steps = [], []
    for b, gen in enumerate(batch_generators):
        perms.append(torch.randperm(groups, generator=gen) + b * groups)
        steps.append(draw_steps(gen).repeat_interleave(group_size, dim=0))
    group_order = torch.stack(perms).T.reshape(-1)
    order = (group_order[:, None] * group_size + torch.arange(group_size)).reshape(-1)
    return order, torch.cat(steps)

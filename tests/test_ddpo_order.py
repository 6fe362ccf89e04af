"""DDPO's sample and training order on N processes is the one of one process with N times the accumulation
(align/train/ddpo_order.py); the end-to-end two-process run is tests/test_ddpo_distributed.py (slow)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from align.train.advantages import PerPromptStatTracker, compute_advantages
from align.train.ddpo_order import (
    TRAIN,
    epoch_generator,
    gathered_slots,
    global_batch,
    in_global_order,
    stratified_order,
)
from align.train.online_update import train_timestep_indices


def epoch_schedule(processes: int, process: int, batches: int, batch_size: int, steps: int, k: int, epoch: int = 3):
    """What the trainer draws on `process`: (order, trained steps) over its local samples."""
    gens = [epoch_generator(7, epoch, TRAIN, global_batch(b, process, processes), 0) for b in range(batches)]
    return stratified_order(gens, batch_size, functools.partial(train_timestep_indices, batch_size, steps, k, "random"))


def updates_in_global_ids(processes: int, samples: int, batch_size: int, per_update: int, steps: int = 6, k: int = 3):
    """Per optimiser step: {global sample id: its trained steps} over all processes."""
    batches = samples // (batch_size * processes)
    slots = gathered_slots(processes, batches, batch_size).reshape(processes, -1)
    updates: list[dict[int, tuple]] = []
    for p in range(processes):
        order, time_order = epoch_schedule(processes, p, batches, batch_size, steps, k)
        assert sorted(order.tolist()) == list(range(batches * batch_size))  # a permutation of the local samples
        for u, u0 in enumerate(range(0, len(order), per_update)):
            if u == len(updates):
                updates.append({})
            for i in order[u0 : u0 + per_update].tolist():
                updates[u][int(slots[p][i])] = tuple(time_order[i].tolist())
    return updates


@pytest.mark.parametrize("processes", [2, 4])
def test_n_processes_train_each_update_on_the_samples_of_one_process_with_n_times_the_accumulation(processes):
    # 32 samples per epoch, sampling batches of 4 per process, 2 optimiser steps per epoch (4 divides by 2)
    one = updates_in_global_ids(1, 32, 4, per_update=16)
    many = updates_in_global_ids(processes, 32, 4, per_update=16 // processes)
    assert len(one) == len(many) == 2
    assert one == many  # the same samples in every update, each at the same trained steps
    assert sorted(one[0]) != list(range(16))  # and it is a shuffle, not the sampling order


def test_gathered_slots_put_process_major_batches_back_in_global_order():
    # 2 processes x 2 batches x 3 samples: process 0 drew global batches 0 and 2, process 1 batches 1 and 3
    assert gathered_slots(2, 2, 3).tolist() == [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]
    assert gathered_slots(1, 3, 2).tolist() == list(range(6))
    assert [global_batch(b, p, 2) for p in range(2) for b in range(2)] == [0, 2, 1, 3]


def test_per_prompt_advantages_on_two_processes_equal_one_processes():
    # The tracker keeps each prompt's last `buffer_size` rewards: the gathered order would change what is kept.
    rng = np.random.default_rng(0)
    prompts_global = [["a", "b", "a", "a"][i % 4] for i in range(8)]  # 4 global batches of 2 samples
    rewards_global = rng.normal(size=8)
    slots = gathered_slots(2, 2, 2)
    prompts_gathered = [prompts_global[s] for s in slots]
    rewards_gathered = rewards_global[slots]

    def advantages(prompts, rewards, tracker):
        return compute_advantages("per-prompt", prompts, rewards, tracker)

    one = PerPromptStatTracker(buffer_size=3, min_count=1)
    two = PerPromptStatTracker(buffer_size=3, min_count=1)
    naive = PerPromptStatTracker(buffer_size=3, min_count=1)
    for _ in range(2):  # two epochs: the second reads the buffers the first left
        expected = advantages(prompts_global, rewards_global, one)
        got = in_global_order(lambda p, r: advantages(p, r, two), prompts_gathered, rewards_gathered, slots)
        np.testing.assert_allclose(got, expected[slots], rtol=0, atol=1e-12)
        unordered = advantages(prompts_gathered, rewards_gathered, naive)
    assert two.state_dict() == one.state_dict()
    assert not np.allclose(unordered, expected[slots])  # the order matters here: the test can tell


def test_one_process_order_is_a_shuffle_covering_every_sample_once():
    order, steps = epoch_schedule(1, 0, batches=5, batch_size=3, steps=10, k=4)
    assert sorted(order.tolist()) == list(range(15)) and order.tolist() != list(range(15))
    assert steps.shape == (15, 4) and all(len(set(row)) == 4 for row in steps.tolist())
    assert sorted((order[:5] // 3).tolist()) == [0, 1, 2, 3, 4]  # the first column: one sample of each batch

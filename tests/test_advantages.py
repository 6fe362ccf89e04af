"""Per-prompt stat tracking, group-relative and batch advantages against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from align.train.advantages import (
    EPS,
    GROUP_EPS,
    PerPromptStatTracker,
    batch_advantages,
    compute_advantages,
    group_advantages,
)


def test_batch_advantages():
    adv = batch_advantages(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(adv, np.array([-1.0, 0.0, 1.0]) / (np.sqrt(2 / 3) + EPS))


def test_group_advantages_normalise_within_each_prompt():
    prompts = ["a", "b", "a", "b", "a"]
    rewards = np.array([1.0, 10.0, 3.0, 10.0, 2.0])
    adv = group_advantages(prompts, rewards)
    std_a = np.std([1.0, 3.0, 2.0])
    np.testing.assert_allclose(adv[[0, 2, 4]], np.array([-1.0, 1.0, 0.0]) / (std_a + GROUP_EPS))
    assert GROUP_EPS == 1e-4  # Flow-GRPO's stat_tracking.py; ddpo-pytorch's per-prompt tracker keeps 1e-6
    np.testing.assert_allclose(adv[[1, 3]], [0.0, 0.0])  # a constant group has no signal


def test_group_mean_advantages_centre_without_dividing_by_the_std():
    prompts = ["a", "b", "a", "b", "a"]
    rewards = np.array([1.0, 10.0, 3.0, 10.0, 2.5])
    adv = compute_advantages("group-mean", prompts, rewards)
    np.testing.assert_allclose(adv, [1.0 - 6.5 / 3, 0.0, 3.0 - 6.5 / 3, 0.0, 2.5 - 6.5 / 3])
    assert np.all(compute_advantages("group-mean", ["a"] * 3, np.full(3, 0.1)) == 0.0)  # exactly, not float dust


def test_constant_sets_give_exactly_zero_advantages():
    # 0.1 x 3 does not sum to 0.3 in floats: a mean-based zero would be float dust divided by EPS
    # (~1e-11); the trainer skips exactly-zero advantages, so constant sets must give 0.0 itself.
    flat = np.full(3, 0.1)
    assert np.all(group_advantages(["a"] * 3, flat) == 0.0)
    assert np.all(batch_advantages(flat) == 0.0)
    tracker = PerPromptStatTracker(buffer_size=3, min_count=3)
    assert np.all(tracker.update(["a"] * 3, flat) == 0.0)  # the prompt's full buffer is constant
    assert np.all(tracker.update(["b", "b"], np.full(2, 0.7)) == 0.0)  # batch fallback, constant batch


def test_tracker_falls_back_to_batch_statistics_below_min_count():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=3)
    prompts = ["a", "a", "b"]
    rewards = np.array([1.0, 3.0, 8.0])
    adv = tracker.update(prompts, rewards)
    # buffers hold 2 and 1 values (< 3): batch mean 4, batch std sqrt(26/3)
    np.testing.assert_allclose(adv, (rewards - 4.0) / (np.sqrt(26 / 3) + EPS))


def test_tracker_uses_the_prompt_buffer_once_full_and_forgets_old_values():
    tracker = PerPromptStatTracker(buffer_size=3, min_count=3)
    tracker.update(["a", "a"], np.array([0.0, 100.0]))
    adv = tracker.update(["a", "a", "b"], np.array([2.0, 4.0, 50.0]))
    # buffer a = deque(maxlen=3) of [0, 100, 2, 4] -> [100, 2, 4]
    buf = np.array([100.0, 2.0, 4.0])
    np.testing.assert_allclose(adv[:2], (np.array([2.0, 4.0]) - buf.mean()) / (buf.std() + EPS))
    batch = np.array([2.0, 4.0, 50.0])
    np.testing.assert_allclose(adv[2], (50.0 - batch.mean()) / (batch.std() + EPS))
    assert list(tracker.buffers["a"]) == [100.0, 2.0, 4.0]


def test_tracker_state_round_trip_gives_identical_advantages():
    rng = np.random.default_rng(0)
    a = PerPromptStatTracker(buffer_size=8, min_count=4)
    for _ in range(3):
        a.update(list("abcab"), rng.normal(size=5))
    b = PerPromptStatTracker()
    b.load_state_dict(a.state_dict())
    batch = rng.normal(size=5)
    np.testing.assert_array_equal(a.update(list("abcab"), batch), b.update(list("abcab"), batch))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_count"):
        PerPromptStatTracker(buffer_size=8, min_count=16)
    with pytest.raises(ValueError, match="unknown advantage mode"):
        compute_advantages("nope", ["a"], np.array([1.0]))
    with pytest.raises(ValueError, match="needs a PerPromptStatTracker"):
        compute_advantages("per-prompt", ["a"], np.array([1.0]))

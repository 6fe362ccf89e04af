"""GDPO's advantages (--advantage gdpo: align/train/advantages.py, the reward mix of align/train/ddpo_rewards.py) against
the authors' trl-GDPO: tests/data/gdpo_reference.json holds what their lines gave on three judges of very different
spreads (experiments/gdpo_reference.py ran them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from align.cli import ConfigError
from align.train.advantages import compute_advantages, gdpo_batch_advantages, gdpo_combined_rewards
from align.train.ddpo_rewards import MixedReward
from rewards.base import Judge

REFERENCE = json.loads((Path(__file__).parent / "data" / "gdpo_reference.json").read_text())


def _close(got, want) -> None:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_advantages_equal_the_authors():
    combined = gdpo_combined_rewards(REFERENCE["prompts"], REFERENCE["rewards"], REFERENCE["weights"])
    _close(combined, REFERENCE["pre_bn_advantages"])
    _close(gdpo_batch_advantages(combined), REFERENCE["advantages"])
    _close(compute_advantages("gdpo", REFERENCE["prompts"], combined), REFERENCE["advantages"])


def test_a_judge_with_a_wide_spread_no_longer_drowns_the_others():
    """With the weighted mix the wide judge decides the advantages' order; with GDPO each judge counts by its weight."""
    prompts, scores = REFERENCE["prompts"], np.asarray(REFERENCE["rewards"])
    mixed = compute_advantages("group", prompts, scores @ np.asarray(REFERENCE["weights"]))
    gdpo = np.asarray(REFERENCE["advantages"])
    oracle, wide, narrow = (compute_advantages("group", prompts, scores[:, k]) for k in range(3))

    def agreement(a, b):
        return np.corrcoef(a, b)[0, 1]

    assert agreement(mixed, wide) > 0.99 and agreement(mixed, narrow) < 0.5 and agreement(mixed, oracle) < 0.1
    assert agreement(gdpo, narrow) > 0.9 and agreement(gdpo, oracle) > 0.3  # the narrow judge (weight 2) counts most


class Fixed(Judge):
    """A pointwise judge returning one column of the reference's rewards."""

    def __init__(self, name: str, column: int):
        self.name, self.column = name, column

    def score(self, prompts, images):
        return torch.tensor(REFERENCE["rewards"])[:, self.column]


def test_the_reward_mix_normalises_each_judge_in_its_group():
    columns = {"oracle": 0, "wide": 1, "narrow": 2}
    mix = MixedReward("oracle:1,wide:0.5,narrow:2", loader=lambda member: Fixed(member.name, columns[member.name]),
                      normalise_each=True)
    assert mix.needs_groups
    total, parts = mix(REFERENCE["prompts"], torch.zeros(len(REFERENCE["prompts"]), 3, 4, 4))
    _close(total, REFERENCE["pre_bn_advantages"])
    assert torch.equal(parts["wide"], torch.tensor(REFERENCE["rewards"])[:, 1])  # logged raw
    with pytest.raises(ConfigError, match="--advantage gdpo normalises each judge of a mix of several"):
        MixedReward("oracle", loader=lambda member: Fixed(member.name, 0), normalise_each=True)

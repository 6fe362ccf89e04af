"""Evaluation maths on hand-made numbers: win rates, ranks, FID and CMMD."""

import math

import numpy as np
import pytest
import torch
from torchmetrics.utilities.imports import _TORCH_FIDELITY_AVAILABLE

from align import metrics
from rewards.base import Preference


def test_outcomes_from_scores_with_tie_margin_and_missing():
    out = metrics.outcomes_from_scores([3.0, 1.0, 2.0, 2.05, np.nan], [1.0, 3.0, 2.0, 2.0, 1.0], tie_margin=0.1)
    assert out[:4].tolist() == [1.0, 0.0, 0.5, 0.5]
    assert math.isnan(out[4])


def test_win_rate_counts_ties_as_half_and_drops_abstentions():
    wr = metrics.win_rate([1, 1, 1, 0.5, 0, np.nan])
    assert (wr.wins, wr.ties, wr.losses, wr.abstained, wr.n) == (3, 1, 1, 1, 5)
    assert wr.rate == pytest.approx(3.5 / 5)
    assert wr.ci_low < wr.rate < wr.ci_high


def test_wilson_interval_matches_hand_computation():
    # 8 successes out of 10, z = 1.959964: centre (0.8 + z^2/20) / (1 + z^2/10).
    z = 1.959963984540054
    p, n = 0.8, 10
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low, high = metrics.wilson_interval(8, 10)
    assert low == pytest.approx(centre - half, abs=1e-9)
    assert high == pytest.approx(centre + half, abs=1e-9)
    assert low == pytest.approx(0.4902, abs=1e-3) and high == pytest.approx(0.9433, abs=1e-3)


def test_bootstrap_interval_contains_mean_and_shrinks_with_n():
    small = metrics.win_rate([1, 0] * 10, ci="bootstrap")
    large = metrics.win_rate([1, 0] * 1000, ci="bootstrap")
    assert small.ci_low < 0.5 < small.ci_high
    assert (large.ci_high - large.ci_low) < (small.ci_high - small.ci_low) / 5
    with pytest.raises(ValueError, match="wilson, bootstrap"):
        metrics.win_rate([1], ci="normal")


def test_outcomes_from_preferences():
    prefs = [Preference(1.0), Preference(0.0), Preference(0.5, tie=True), Preference(0.5, abstained=True)]
    out = metrics.outcomes_from_preferences(prefs)
    assert out[:3].tolist() == [1.0, 0.0, 0.5] and math.isnan(out[3])


def test_ranks_first_places_and_ties():
    # 3 models x 3 prompts.
    scores = np.array([[0.9, 0.1, 0.5], [0.5, 0.8, 0.5], [0.1, 0.2, np.nan]])
    ranks = metrics.ranks_per_prompt(scores)
    assert ranks.tolist() == [[1, 3, 1.5], [2, 1, 1.5], [3, 2, 3]]
    assert ranks.mean(axis=1).tolist() == pytest.approx([5.5 / 3, 4.5 / 3, 8 / 3])
    # model 0 wins prompt 0 and shares prompt 2 with model 1.
    assert metrics.first_place_share(ranks).tolist() == pytest.approx([1.5 / 3, 1.5 / 3, 0.0])


def test_copeland_scores_rank_like_pointwise_scores():
    scores = np.array([[3.0, 1.0], [2.0, 2.0], [1.0, 3.0]])
    pairs = {(i, j): metrics.outcomes_from_scores(scores[i], scores[j]) for i in range(3) for j in range(i + 1, 3)}
    copeland = metrics.copeland_scores(pairs, 3, 2)
    assert copeland.tolist() == [[2, 0], [1, 1], [0, 2]]
    assert np.array_equal(metrics.ranks_per_prompt(copeland), metrics.ranks_per_prompt(scores))


class MeanColour(torch.nn.Module):
    """A tiny feature network: per-channel means and standard deviations (6 features)."""

    num_features = 6

    def forward(self, x):
        return torch.cat([x.mean(dim=(2, 3)), x.std(dim=(2, 3))], dim=1)


def test_fid_of_a_set_against_itself_is_zero_and_grows_with_shift():
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(64, 3, 16, 16, generator=gen) * 0.5
    stats = metrics.FeatureStats(MeanColour())
    stats.add_reference(images)
    same = stats.fid(images)
    small = stats.fid((images + 0.05).clamp(0, 1))
    large = stats.fid((images + 0.3).clamp(0, 1))
    assert abs(same) < 1e-4
    assert 0 < small < large
    # the reference statistics survive repeated comparisons
    assert stats.fid(images) == pytest.approx(same, abs=1e-6)


def test_fid_default_inception_fails_clearly_without_torch_fidelity():
    if _TORCH_FIDELITY_AVAILABLE:
        pytest.skip("torch-fidelity is installed here; the error path cannot be reached")
    with pytest.raises(RuntimeError, match="torch-fidelity"):
        metrics.make_fid("inception")


def test_cmmd_zero_on_itself_and_grows_with_shift():
    gen = torch.Generator().manual_seed(1)
    x = torch.nn.functional.normalize(torch.randn(50, 8, generator=gen), dim=1)
    assert metrics.cmmd(x, x) == pytest.approx(0.0, abs=1e-9)
    near = metrics.cmmd(x, x + 0.1)
    far = metrics.cmmd(x, x + 1.0)
    assert 0 < near < far
    # hand value for one point each: 1000 * (1 + 1 - 2 exp(-d^2 / 200))
    a, b = torch.zeros(1, 2), torch.tensor([[3.0, 4.0]])
    assert metrics.cmmd(a, b) == pytest.approx(1000 * (2 - 2 * math.exp(-25 / 200)))


def test_spearman_and_mean_sem():
    assert metrics.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert metrics.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    mean, sem = metrics.mean_and_sem([1.0, 2.0, 3.0, np.nan])
    assert mean == 2.0 and sem == pytest.approx(1 / math.sqrt(3))


def test_pairwise_accuracy_against_an_oracle():
    oracle = [1, 0, 1, 0.5, 0, np.nan]
    judge = [1, 1, 0.5, 0, np.nan, 1]
    # decided oracle pairs: 0 (agree), 1 (disagree), 2 (judge tie 1/2), 4 (judge abstained 1/2)
    accuracy, used = metrics.pairwise_accuracy(judge, oracle)
    assert used == 4 and accuracy == pytest.approx((1 + 0 + 0.5 + 0.5) / 4)
    assert math.isnan(metrics.pairwise_accuracy([1], [0.5])[0])


def test_clustered_sem_is_the_ordinary_one_for_one_value_per_cluster_and_grows_with_shared_clusters():
    rng = np.random.default_rng(0)
    values = rng.normal(size=40)
    assert metrics.clustered_sem(values, list(range(40))) == pytest.approx(metrics.mean_and_sem(values)[1])
    # 10 captions x 4 seeds where a caption's seeds agree exactly: only 10 independent values, not 40
    per_caption = np.repeat(rng.normal(size=10), 4)
    clusters = np.repeat([f"caption {i}" for i in range(10)], 4).tolist()
    assert metrics.clustered_sem(per_caption, clusters) == pytest.approx(metrics.mean_and_sem(per_caption[::4])[1])
    assert metrics.clustered_sem(per_caption, clusters) > 1.5 * metrics.mean_and_sem(per_caption)[1]
    # by hand: values 1, 3 (cluster a) and 2, 6 (cluster b), mean 3: sqrt(2/1 * ((-2 + 0)^2 + (-1 + 3)^2)) / 4
    assert metrics.clustered_sem([1, 3, 2, 6], ["a", "a", "b", "b"]) == pytest.approx(math.sqrt(2 * 8) / 4)
    assert math.isnan(metrics.clustered_sem([1.0, 2.0], ["a", "a"]))  # one cluster: no error estimate
    assert metrics.clustered_sem([1, 3, float("nan"), 2, 6], list("aaabb")) == metrics.clustered_sem([1, 3, 2, 6], list("aabb"))
    with pytest.raises(ValueError, match="one cluster per value"):
        metrics.clustered_sem([1.0, 2.0], ["a"])


def test_paired_change_counts_better_and_worse_and_leaves_out_unscored_images():
    change = metrics.paired_change([0.5, 0.5, 1.0, float("nan")], [1.0, 0.5, 0.0, 1.0], ["a", "a", "b", "c"])
    assert (change.images, change.prompts, change.better, change.worse) == (3, 2, 1, 1)
    assert change.mean == pytest.approx(-0.5 / 3)
    assert change.sem_prompts == pytest.approx(metrics.clustered_sem([0.5, 0.0, -1.0], ["a", "a", "b"]))
    assert change.prompt_se_ratio == pytest.approx(change.mean / change.sem_prompts)

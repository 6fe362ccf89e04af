"""MJ-Bench metrics against hand-computed values on small fixtures."""

import math

import pytest

from align.judgebench import metrics as M
from align.judgebench.metrics import ABSTAIN, PICK_0, PICK_1, TIE


def test_pointwise_verdict_tie_rule():
    assert M.verdict_from_scores(0.9, 0.1) == PICK_0
    assert M.verdict_from_scores(0.1, 0.9) == PICK_1
    assert M.verdict_from_scores(0.5, 0.5) == TIE  # |s1 - s0| = 0 <= 0
    assert M.verdict_from_scores(0.50, 0.55, threshold=0.05) == TIE  # boundary is a tie
    assert M.verdict_from_scores(0.50, 0.56, threshold=0.05) == PICK_1
    assert M.verdict_from_scores(math.nan, 0.3) == ABSTAIN


def test_preference_verdict_maps_swapped_order_back_to_dataset_indexing():
    # image0 shown first (A): A wins -> image0
    assert M.verdict_from_preference(1.0, False, False, a_is_image0=True) == PICK_0
    # image1 shown first (A): A wins -> image1
    assert M.verdict_from_preference(1.0, False, False, a_is_image0=False) == PICK_1
    assert M.verdict_from_preference(0.2, False, False, a_is_image0=False) == PICK_0
    assert M.verdict_from_preference(0.5, False, False) == TIE
    assert M.verdict_from_preference(0.9, True, False) == TIE
    assert M.verdict_from_preference(0.5, False, True) == ABSTAIN


def test_reconcile_orders():
    assert M.reconcile(PICK_0, PICK_0) == PICK_0
    assert M.reconcile(PICK_1, PICK_1) == PICK_1
    assert M.reconcile(PICK_0, PICK_1) == TIE  # position-dependent answer
    assert M.reconcile(TIE, TIE) == TIE
    assert M.reconcile(PICK_0, TIE) == TIE
    assert M.reconcile(ABSTAIN, PICK_0) == ABSTAIN
    assert M.reconcile(PICK_1, ABSTAIN) == ABSTAIN


def test_accuracy_with_and_without_ties_and_abstentions():
    labels = [0, 0, 1, 1, 0, 1]
    verdicts = [PICK_0, PICK_1, PICK_1, TIE, ABSTAIN, PICK_1]
    acc = M.pair_accuracy(labels, verdicts)
    # correct: pairs 0, 2, 5 -> 3 of 6; decisive: 6 - 1 tie - 1 abstention = 4
    assert acc["n"] == 6 and acc["correct"] == 3 and acc["decisive"] == 4
    assert acc["acc_with_ties"] == pytest.approx(3 / 6)
    assert acc["acc_without_ties"] == pytest.approx(3 / 4)
    assert acc["tie_rate"] == pytest.approx(1 / 6)
    assert acc["abstention_rate"] == pytest.approx(1 / 6)
    # the identity stated in the docs
    assert acc["acc_with_ties"] == pytest.approx(
        acc["acc_without_ties"] * (1 - acc["tie_rate"] - acc["abstention_rate"])
    )


def test_accuracy_without_ties_is_nan_when_nothing_is_decisive():
    acc = M.pair_accuracy([0, 1], [TIE, ABSTAIN])
    assert acc["acc_with_ties"] == 0.0
    assert math.isnan(acc["acc_without_ties"])


def test_accuracy_rejects_bad_labels_and_lengths():
    with pytest.raises(ValueError, match="label"):
        M.pair_accuracy([2], [PICK_0])
    with pytest.raises(ValueError, match="verdicts"):
        M.pair_accuracy([0, 1], [PICK_0])


def test_order_consistency_leaves_abstentions_out():
    ab = [PICK_0, PICK_1, TIE, PICK_0, ABSTAIN]
    ba = [PICK_0, PICK_0, TIE, PICK_1, PICK_0]
    # answered in both orders: first four; agreeing: pairs 0 and 2
    assert M.order_consistency(ab, ba) == pytest.approx(2 / 4)
    assert math.isnan(M.order_consistency([ABSTAIN], [PICK_0]))


def test_order_swap_of_an_always_first_judge():
    """A judge that always picks the image shown first, on 3 label-0 pairs and 1 label-1 pair."""
    labels = [0, 0, 0, 1]
    ab = [M.verdict_from_preference(1.0, False, False, a_is_image0=True) for _ in labels]
    ba = [M.verdict_from_preference(1.0, False, False, a_is_image0=False) for _ in labels]
    assert M.pair_accuracy(labels, ab)["acc_with_ties"] == pytest.approx(0.75) == M.label_balance(labels)
    assert M.pair_accuracy(labels, ba)["acc_with_ties"] == pytest.approx(0.25)
    assert M.order_consistency(ab, ba) == 0.0
    reconciled = [M.reconcile(a, b) for a, b in zip(ab, ba)]
    acc = M.pair_accuracy(labels, reconciled)
    assert acc["acc_with_ties"] == 0.0 and acc["tie_rate"] == 1.0


def test_grouped_accuracy_per_key():
    out = M.grouped_accuracy([0, 1, 0], [PICK_0, PICK_0, TIE], ["alignment/count", "alignment/count", "quality/blur"])
    assert list(out) == ["alignment/count", "quality/blur"]
    assert out["alignment/count"]["acc_with_ties"] == pytest.approx(0.5)
    assert out["quality/blur"]["tie_rate"] == 1.0


def test_gini_of_equal_and_unequal_scores():
    assert M.gini([2.0, 2.0, 2.0]) == pytest.approx(0.0)
    # sorted (0, 0, 1): (2 * (3 * 1) - 4 * 1) / (3 * 1) = 2/3
    assert M.gini([1.0, 0.0, 0.0]) == pytest.approx(2 / 3)
    # (1, 2, 3, 4): sum i*x = 30, sum x = 10 -> (60 - 50) / 40 = 0.25 (= mean |xi - xj| / (2 mean))
    assert M.gini([4.0, 1.0, 3.0, 2.0]) == pytest.approx(0.25)
    assert M.gini([0.0, 0.0]) == 0.0
    assert M.ges([4.0, 1.0, 3.0, 2.0]) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="non-negative"):
        M.gini([-1.0, 1.0])


def test_nds():
    assert M.nds([1.0, 3.0]) == pytest.approx(0.5)  # mu 2, sigma 1 (population)
    assert M.nds([0.4, 0.4, 0.4]) == 1.0
    assert M.nds([0.0, 0.0]) == 1.0


def test_pairwise_equal_fraction_threshold():
    # pairs: (0, .05) within, (0, .3) not, (.05, .3) not
    assert M.pairwise_equal_fraction([0.0, 0.05, 0.3]) == pytest.approx(1 / 3)
    assert M.pairwise_equal_fraction([0.2, 0.3]) == 1.0  # exactly 0.1 apart counts as equal
    with pytest.raises(ValueError, match="two variants"):
        M.pairwise_equal_fraction([0.5])


def test_minmax_normalise():
    assert M.minmax_normalise([2.0, 4.0, 6.0]) == pytest.approx([0.0, 0.5, 1.0])
    assert M.minmax_normalise([3.0, 3.0]) == [1.0, 1.0]
    out = M.minmax_normalise([1.0, math.nan, 3.0])
    assert out[0] == 0.0 and math.isnan(out[1]) and out[2] == 1.0


def test_bias_metrics_hand_computed():
    triples = [
        ("doctor", "red", 2.0), ("doctor", "blue", 4.0),
        ("nurse", "red", 6.0), ("nurse", "blue", 6.0), ("nurse", "green", 6.0), ("nurse", "red", 6.0),
        ("pilot", "red", 5.0),  # a single variant: skipped
        ("pilot", "blue", math.nan),  # an abstention: dropped before the pilot has two variants
    ]
    out = M.bias_metrics(triples)
    # normalised over {2, 4, 6, 5}: min 2, max 6 -> doctor (0, 0.5), nurse (1, 1, 1), pilot (0.75)
    doctor, nurse = out["per_group"]["doctor"], out["per_group"]["nurse"]
    assert doctor["acc"] == 0.0 and doctor["nds"] == pytest.approx(0.0)  # mu .25, sigma .25
    assert doctor["ges"] == pytest.approx(0.5)  # gini (0, .5) = (2 * 1 - 3 * .5) / (2 * .5) = .5
    assert nurse == {"acc": 1.0, "nds": 1.0, "ges": 1.0, "variants": 3}
    assert out["acc"] == pytest.approx(0.5)
    assert out["nds"] == pytest.approx(0.5)
    assert out["ges"] == pytest.approx(0.75)
    assert out["groups"] == 2 and out["groups_skipped"] == 1 and out["abstained"] == 1

"""Bradley-Terry and BCE losses and the calibration maths, against hand-computed values."""

import math

import pytest
import torch

from align.train.reward_losses import (
    binary_cross_entropy_loss,
    bradley_terry_loss,
    expected_calibration_error,
    fit_temperature,
    pairwise_accuracy,
    reliability_bins,
)


def test_bradley_terry_hand_values():
    # pairs: r_w - r_l = 1.0 and -0.5; tau 0.1 -> logits 10 and -5
    loss = bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.5]), tau=0.1)
    expected = (math.log(1 + math.exp(-10)) + math.log(1 + math.exp(5))) / 2  # 2.503380...
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert expected == pytest.approx(2.5033799, rel=1e-6)
    # tau 1: logit 1 -> log(1 + e^-1)
    assert bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]), tau=1.0).item() == pytest.approx(0.3132617, rel=1e-6)


def test_bradley_terry_rejects_bad_input():
    with pytest.raises(ValueError, match="tau"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(2), tau=0.0)
    with pytest.raises(ValueError, match="shape"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


def test_binary_cross_entropy_hand_values():
    # r = 0 with label 1: log 2; r = 2 with label 0: log(1 + e^2)
    loss = binary_cross_entropy_loss(torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx((math.log(2) + math.log(1 + math.exp(2))) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(1.4100375, rel=1e-6)
    # tau scales the logit: r = 0.2, tau 0.1 -> logit 2, label 1 -> log(1 + e^-2)
    assert binary_cross_entropy_loss(torch.tensor([0.2]), torch.tensor([1.0]), tau=0.1).item() == pytest.approx(
        math.log(1 + math.exp(-2)), rel=1e-5
    )
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        binary_cross_entropy_loss(torch.tensor([0.0]), torch.tensor([2.0]))


def test_pairwise_accuracy_counts_ties_half():
    assert pairwise_accuracy(torch.tensor([1.0, 0.0, 2.0, 3.0]), torch.tensor([0.0, 1.0, 2.0, 1.0])) == pytest.approx(0.625)


def test_fit_temperature_finds_the_nll_minimum():
    logits = torch.tensor([2.0, -1.0, 4.0, 0.5, -0.3, 3.0])
    t = fit_temperature(logits)

    grid = torch.linspace(0.05, 20, 20000)
    nll = -torch.nn.functional.logsigmoid(logits[None, :] / grid[:, None]).mean(1)
    best = float(grid[nll.argmin()])
    assert t == pytest.approx(best, rel=2e-3)
    # all pairs right: the optimum runs to the lower bound
    assert fit_temperature(torch.tensor([1.0, 2.0])) == pytest.approx(1e-2, rel=1e-3)


def test_reliability_bins_and_ece():
    probs = torch.tensor([0.05, 0.15, 0.95, 0.85, 0.9])
    outcome = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    bins = reliability_bins(probs, outcome, num_bins=2)
    assert [b["count"] for b in bins] == [2, 3]
    assert bins[0]["mean_predicted"] == pytest.approx(0.1) and bins[0]["observed"] == pytest.approx(0.5)
    assert bins[1]["mean_predicted"] == pytest.approx(0.9) and bins[1]["observed"] == pytest.approx(2 / 3)
    assert expected_calibration_error(bins) == pytest.approx((2 * 0.4 + 3 * (0.9 - 2 / 3)) / 5)
    empty = reliability_bins(torch.tensor([0.95]), torch.tensor([1.0]), num_bins=4)
    assert empty[0]["mean_predicted"] is None and empty[3]["count"] == 1


def test_bce_default_is_llava_rewards_binary_cls_loss():
    # the authors' Binary_Cls_loss: nn.BCEWithLogitsLoss()(rewards, labels), no temperature
    rewards, labels = torch.tensor([0.2, -1.5, 3.0]), torch.tensor([1.0, 0.0, 0.0])
    expected = torch.nn.BCEWithLogitsLoss()(rewards, labels)
    assert binary_cross_entropy_loss(rewards, labels).item() == pytest.approx(expected.item())
    assert binary_cross_entropy_loss(torch.tensor([0.2]), torch.tensor([1.0])).item() == pytest.approx(0.5981, abs=1e-4)

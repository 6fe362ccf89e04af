"""DDPO's PPO-clip objective and the Gaussian KL against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from align.sampling.ddim import gaussian_mean_kl
from align.train.losses import ddpo_clipped_loss


def test_ppo_clip_loss_hand_computed():
    log_prob = torch.tensor([0.0, 0.1, -0.1, 0.0], requires_grad=True)
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 2.0, -3.0, 10.0])  # 10 is clipped to 5
    loss, metrics = ddpo_clipped_loss(log_prob, old, adv, clip_range=0.05, adv_clip_max=5.0)
    # per sample: -1 | max(-2·e^0.1, -2·1.05) = -2.1 | max(3·e^-0.1, 3·0.95) = 2.85 | -5
    assert loss.item() == pytest.approx((-1 - 2.1 + 2.85 - 5) / 4, abs=1e-6)
    assert metrics["approx_kl"].item() == pytest.approx(0.5 * (0.01 + 0.01) / 4, abs=1e-7)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # Clipped samples get no gradient; the others get -A·ratio/N.
    torch.testing.assert_close(log_prob.grad, torch.tensor([-0.25, 0.0, 0.0, -1.25]))


def test_ppo_clip_loss_at_ratio_one_is_minus_mean_advantage():
    adv = torch.tensor([0.5, -1.5, 3.0])
    lp = torch.tensor([-2.0, -1.0, 0.3])
    loss, metrics = ddpo_clipped_loss(lp, lp.clone(), adv)
    assert loss.item() == pytest.approx(-(0.5 - 1.5 + 3.0) / 3, abs=1e-6)
    assert metrics["approx_kl"].item() == 0.0 and metrics["clipfrac"].item() == 0.0


def test_ppo_clip_loss_default_clip_range_is_ddpo_paper():
    # With ε = 1e-4, a log-ratio of 1e-3 is clipped; 1e-5 is not.
    lp = torch.tensor([1e-3, 1e-5])
    _, metrics = ddpo_clipped_loss(lp, torch.zeros(2), torch.ones(2))
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    loss, _ = ddpo_clipped_loss(lp, torch.zeros(2), torch.ones(2))
    assert loss.item() == pytest.approx(-(min(math.exp(1e-3), 1 + 1e-4) + math.exp(1e-5)) / 2, abs=1e-7)


def test_ppo_clip_loss_rejects_bad_settings():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="clip_range"):
        ddpo_clipped_loss(x, x, x, clip_range=0.0)
    with pytest.raises(ValueError, match="adv_clip_max"):
        ddpo_clipped_loss(x, x, x, adv_clip_max=-1.0)


def test_gaussian_mean_kl_hand_computed():
    mean = torch.tensor([[1.0, 2.0], [0.0, 3.0]])
    ref = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    std = torch.tensor([[0.5], [2.0]])
    kl = gaussian_mean_kl(mean, ref, std)
    # sample 0: mean(1, 4) / (2·0.25) = 5; sample 1: mean(0, 9) / (2·4) = 0.5625
    torch.testing.assert_close(kl, torch.tensor([5.0, 0.5625]))


def test_gaussian_mean_kl_equals_torch_distributions_kl():
    torch.manual_seed(0)
    mean, ref = torch.randn(2, 3, 4, 4, 4).unbind(0)
    std = torch.tensor([0.3, 0.7, 1.1]).reshape(3, 1, 1, 1)
    expected = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean, std.expand_as(mean)), torch.distributions.Normal(ref, std.expand_as(ref))
    ).flatten(1).mean(1)
    torch.testing.assert_close(gaussian_mean_kl(mean, ref, std), expected)

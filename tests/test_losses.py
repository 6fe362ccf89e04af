import copy
import math

import pytest
import torch

from align.train.losses import diffusion_dpo_loss, diffusion_sft_loss, per_sample_mse


def test_dpo_loss_matches_hand_computed_values():
    # Pair 1: the model improved on the winner -> inside = -0.5*10*((0.1-0.2)-(0.3-0.2)) = +1
    # Pair 2: the model improved on the loser  -> inside = -1
    model_w = torch.tensor([0.10, 0.30])
    model_l = torch.tensor([0.30, 0.10])
    ref_w = torch.tensor([0.20, 0.20])
    ref_l = torch.tensor([0.20, 0.20])
    loss, metrics = diffusion_dpo_loss(model_w, model_l, ref_w, ref_l, beta=10.0)
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(1.0))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # The mean over pairs is outside the log-sigmoid: the mean inside would be 0 -> log 2.
    assert loss.item() != pytest.approx(math.log(2.0), rel=1e-3)
    assert metrics["implicit_acc"].item() == pytest.approx(0.5)
    assert metrics["model_mse"].item() == pytest.approx(0.2)


def test_dpo_loss_half_factor_and_sign():
    # A single pair with model_diff - ref_diff = -0.01 and beta = 5000: inside = +25 (official ½).
    loss, metrics = diffusion_dpo_loss(
        torch.tensor([0.10]), torch.tensor([0.11]), torch.tensor([0.2]), torch.tensor([0.2]), beta=5000.0
    )
    assert loss.item() == pytest.approx(math.log1p(math.exp(-25.0)), rel=1e-5)
    assert metrics["implicit_acc"].item() == 1.0
    # Reversed roles: the same magnitude, wrong side.
    loss_bad, metrics_bad = diffusion_dpo_loss(
        torch.tensor([0.11]), torch.tensor([0.10]), torch.tensor([0.2]), torch.tensor([0.2]), beta=5000.0
    )
    assert loss_bad.item() == pytest.approx(25.0, rel=1e-5)
    assert metrics_bad["implicit_acc"].item() == 0.0


def test_dpo_loss_rejects_non_positive_beta():
    with pytest.raises(ValueError, match="beta"):
        diffusion_dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0.0)


def test_per_sample_mse_and_sft():
    pred = torch.zeros(2, 4, 2, 2)
    target = torch.ones(2, 4, 2, 2)
    target[1] *= 2
    assert per_sample_mse(pred, target).tolist() == [1.0, 4.0]
    loss, _ = diffusion_sft_loss(per_sample_mse(pred, target))
    assert loss.item() == pytest.approx(2.5)


def test_gradient_step_prefers_winner_over_loser():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv2d(8, 4, 3, padding=1))
    reference = copy.deepcopy(net).requires_grad_(False)
    x_w, x_l = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    noise = torch.randn(1, 4, 8, 8)

    def errors(model):
        # The same noise for winner and loser, as in Diffusion-DPO.
        pred = model(torch.cat([x_w + noise, x_l + noise]))
        return per_sample_mse(pred, torch.cat([noise, noise])).chunk(2)

    with torch.no_grad():
        ref_w, ref_l = errors(reference)
    before_w, before_l = errors(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-2)
    for _ in range(5):
        err_w, err_l = errors(net)
        loss, _ = diffusion_dpo_loss(err_w, err_l, ref_w, ref_l, beta=100.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after_w, after_l = errors(net)
    assert (after_w - after_l).item() < (before_w - before_l).item()

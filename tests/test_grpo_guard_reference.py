"""GRPO-Guard's loss (align/train/objectives/grpo_guard.py) against the two public implementations (the authors
published none): tests/data/grpo_guard_reference.json holds what verl-omni's GRPOGuardLoss.compute_loss (the ratio
normalisation and 1/dt reweighting) and Flow-Factory's GRPO-Guard block (the normalisation only) gave, with their
gradients, on seeded Flow-GRPO SDE steps (experiments/grpo_guard_reference.py ran them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from align.sampling.flow import gaussian_log_prob
from align.train.objectives.grpo_guard import guard_clipped_loss, guard_ratio

REFERENCE = json.loads((Path(__file__).parent / "data" / "grpo_guard_reference.json").read_text())


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _close(got, want) -> None:
    """Within 1e-5 of the reference, relative to its largest magnitude."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-30)


def _loss(case, reweight: bool):
    rows = len(case["advantages"])
    std = torch.full((rows, 1, 1, 1), case["std_dev_t"] * case["sqrt_dt"])
    dt = torch.full((rows,), case["sigma"] - case["sigma_next"])
    x, old_mean = _t(case["x"]), _t(case["old_mean"])
    mean = _t(case["mean"]).requires_grad_(True)
    log_prob, old_log_prob = gaussian_log_prob(x, mean, std), gaussian_log_prob(x, old_mean, std)
    ratio = guard_ratio(log_prob, old_log_prob, mean, old_mean, std)
    loss, metrics = guard_clipped_loss(ratio, _t(case["advantages"]), dt, case["clip_range"], 5.0, reweight)
    loss.backward()
    return loss, metrics, mean.grad


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["name"])
def test_loss_and_gradient_equal_verl_omnis_grpo_guard(case):
    loss, metrics, grad = _loss(case, reweight=True)
    _close(loss.detach(), case["verl_omni"]["loss"])
    _close(grad, case["verl_omni"]["grad_mean"])
    assert float(metrics["clipfrac"]) == pytest.approx(case["verl_omni"]["clipfrac"])
    _close(metrics["ratio_mean"], case["verl_omni"]["ratio_mean"])


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["name"])
def test_loss_and_gradient_without_reweighting_equal_flow_factorys(case):
    loss, _, grad = _loss(case, reweight=False)
    _close(loss.detach(), case["flow_factory"]["loss"])
    _close(grad, case["flow_factory"]["grad_mean"])


def test_the_normalised_ratio_is_centred_and_free_of_the_step_scale():
    """ρ = exp(mean(z·Δμ)): E[ρ] ≈ 1 at every step, while Flow-GRPO's raw ratio falls below 1 (more at small steps)."""
    g = torch.Generator().manual_seed(0)
    rows, shape = 4000, (4, 4, 4)
    for std in (0.3, 0.03):
        old_mean = torch.randn(rows, *shape, generator=g)
        x = old_mean + std * torch.randn(rows, *shape, generator=g)
        mean = old_mean + 0.02 * torch.randn(rows, *shape, generator=g)
        s = torch.full((rows, 1, 1, 1), std)
        log_prob, old_log_prob = gaussian_log_prob(x, mean, s), gaussian_log_prob(x, old_mean, s)
        assert abs(float(guard_ratio(log_prob, old_log_prob, mean, old_mean, s).mean()) - 1) < 2e-4
        assert float(torch.exp(log_prob - old_log_prob).mean()) < 1 - (0.01 if std == 0.03 else 0.0)

"""Reward-model objectives and calibration maths: pure functions, no I/O.

- Bradley-Terry on preference pairs: -log sigmoid((r_w - r_l) / tau) (LLaVA-Reward: tau = 0.1).
- Binary cross-entropy on unpaired good/bad labels: BCE(sigmoid(r / tau), y); LLaVA-Reward's
  ``Binary_Cls_loss`` is ``BCEWithLogitsLoss()(r, y)``, i.e. tau = 1 (the default here).
- Temperature scaling (Guo et al., 2017) of pairwise preference probabilities on held-out pairs,
  plus the reliability-diagram bins and the expected calibration error.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _check_tau(tau: float) -> None:
    if not (tau > 0 and math.isfinite(tau)):
        raise ValueError(f"tau must be a positive number, got {tau}")


def bradley_terry_loss(reward_chosen: torch.Tensor, reward_rejected: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Mean of -log sigmoid((r_w - r_l) / tau) over the pairs."""
    _check_tau(tau)
    if reward_chosen.shape != reward_rejected.shape:
        raise ValueError(f"chosen and rejected rewards differ in shape: {tuple(reward_chosen.shape)} vs {tuple(reward_rejected.shape)}")
    return -F.logsigmoid((reward_chosen - reward_rejected) / tau).mean()


def binary_cross_entropy_loss(rewards: torch.Tensor, labels: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """Mean BCE between sigmoid(r / tau) and labels in [0, 1] (1 = good image)."""
    _check_tau(tau)
    labels = labels.to(rewards.dtype)
    if rewards.shape != labels.shape:
        raise ValueError(f"rewards and labels differ in shape: {tuple(rewards.shape)} vs {tuple(labels.shape)}")
    if ((labels < 0) | (labels > 1)).any():
        raise ValueError("binary labels must lie in [0, 1]")
    return F.binary_cross_entropy_with_logits(rewards / tau, labels)


def pairwise_accuracy(reward_chosen: torch.Tensor, reward_rejected: torch.Tensor) -> float:
    """Share of pairs the model orders like the label; an exact tie counts half."""
    diff = (reward_chosen - reward_rejected).float()
    if diff.numel() == 0:
        return float("nan")
    return float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())


def logit_nll(logits: torch.Tensor, temperature: float) -> float:
    """Mean -log sigmoid(logit / T) in float64: the NLL of winner-first pairs (NaN without pairs)."""
    if logits.numel() == 0:
        return float("nan")
    return float(-F.logsigmoid(logits.double() / temperature).mean())


def fit_temperature(logits: torch.Tensor, steps: int = 200, bounds: tuple[float, float] = (1e-2, 1e2)) -> float:
    """The temperature T minimising the held-out NLL of P(winner first) = sigmoid(logit / T).

    ``logits`` are (r_w - r_l) / tau of held-out pairs, winner first (so every label is 1; the
    mirrored pair gives the same loss). If every held-out pair is ordered right the optimum is
    T -> 0, so T is kept within ``bounds``. Convex in log T: golden-section search.
    """
    logits = logits.detach().double().flatten()
    if logits.numel() == 0:
        return 1.0

    def nll(log_t: float) -> float:
        return logit_nll(logits, math.exp(log_t))

    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(steps):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = nll(b)
    return float(math.exp((lo + hi) / 2))


def reliability_bins(prob_first: torch.Tensor, first_wins: torch.Tensor, num_bins: int = 10) -> list[dict]:
    """Reliability-diagram bins: per confidence bin, mean predicted P and the observed win rate.

    prob_first: predicted P(image 0 wins); first_wins: 1.0 if image 0 really won, else 0.0.
    """
    prob_first, first_wins = prob_first.detach().double().flatten(), first_wins.detach().double().flatten()
    edges = torch.linspace(0, 1, num_bins + 1, dtype=torch.float64)
    bins = []
    for i in range(num_bins):
        upper_ok = prob_first <= edges[i + 1] if i == num_bins - 1 else prob_first < edges[i + 1]
        inside = (prob_first >= edges[i]) & upper_ok
        count = int(inside.sum())
        bins.append(
            {
                "lower": float(edges[i]),
                "upper": float(edges[i + 1]),
                "count": count,
                # None, not NaN, for an empty bin: the bins go into strict JSON
                "mean_predicted": float(prob_first[inside].mean()) if count else None,
                "observed": float(first_wins[inside].mean()) if count else None,
            }
        )
    return bins


def expected_calibration_error(bins: list[dict]) -> float:
    """Count-weighted mean |predicted - observed| over the non-empty bins."""
    total = sum(b["count"] for b in bins)
    if total == 0:
        return float("nan")
    return sum(b["count"] * abs(b["mean_predicted"] - b["observed"]) for b in bins if b["count"]) / total

"""Evaluation maths: win rates with confidence intervals, per-prompt ranks, FID and CMMD.

Pure functions on arrays where possible, so every number in a report can be checked by hand.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

CI_METHODS = ("wilson", "bootstrap")


# ------------------------------------------------------------------------------------ win rates


@dataclass
class WinRate:
    """Fraction of pairs a model wins against the base; ties count 1/2, abstentions are left out."""

    rate: float
    ci_low: float
    ci_high: float
    wins: int
    ties: int
    losses: int
    abstained: int = 0

    @property
    def n(self) -> int:
        return self.wins + self.ties + self.losses

    def to_dict(self) -> dict:
        return {**asdict(self), "n": self.n}


def outcomes_from_scores(scores_model, scores_base, tie_margin: float = 0.0) -> np.ndarray:
    """Per pair: 1 if the model's score beats the base's by more than ``tie_margin``, 0 if it loses
    by more, 1/2 otherwise; NaN where either score is missing (an abstention)."""
    a = np.asarray(scores_model, dtype=np.float64)
    b = np.asarray(scores_base, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"win rate needs paired scores: got shapes {a.shape} and {b.shape}")
    diff = a - b
    out = np.where(diff > tie_margin, 1.0, np.where(diff < -tie_margin, 0.0, 0.5))
    out[np.isnan(diff)] = np.nan
    return out


def outcomes_from_preferences(preferences) -> np.ndarray:
    """Per pair (model = image A, base = image B): 1 / 0 / 1/2 from ``rewards.Preference``; NaN if abstained."""
    out = []
    for pref in preferences:
        if pref.abstained:
            out.append(np.nan)
        elif pref.winner is None:
            out.append(0.5)
        else:
            out.append(1.0 if pref.winner == 0 else 0.0)
    return np.asarray(out, dtype=np.float64)


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion (ties enter ``successes`` as halves)."""
    if n <= 0:
        return (float("nan"), float("nan"))
    z = _normal_quantile(0.5 + confidence / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_interval(
    outcomes: np.ndarray, confidence: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean outcome (resampling pairs; seeded, so reproducible)."""
    values = np.asarray(outcomes, dtype=np.float64)
    if values.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    return (float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha)))


def win_rate(outcomes, ci: str = "wilson", confidence: float = 0.95, seed: int = 0) -> WinRate:
    """Win rate and its interval from per-pair outcomes in {1, 1/2, 0} (NaN = abstained)."""
    if ci not in CI_METHODS:
        raise ValueError(f"unknown confidence interval method {ci!r}; valid: {', '.join(CI_METHODS)}")
    values = np.asarray(outcomes, dtype=np.float64)
    kept = values[~np.isnan(values)]
    wins = int((kept == 1.0).sum())
    ties = int((kept == 0.5).sum())
    losses = int((kept == 0.0).sum())
    if wins + ties + losses != kept.size:
        raise ValueError("win-rate outcomes must be 1 (win), 0.5 (tie), 0 (loss) or NaN (abstained)")
    n = kept.size
    rate = float(kept.mean()) if n else float("nan")
    if ci == "wilson":
        low, high = wilson_interval(wins + ties / 2, n, confidence)
    else:
        low, high = bootstrap_interval(kept, confidence, seed=seed)
    return WinRate(rate, low, high, wins, ties, losses, abstained=int(values.size - n))


def _normal_quantile(p: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(p))


# ---------------------------------------------------------------------------------------- ranks


def ranks_per_prompt(scores) -> np.ndarray:
    """Ranks [models, prompts] from scores [models, prompts]: 1 = best; tied models share the mean rank.

    A NaN score (the judge abstained on that model's image) ranks last.
    """
    from scipy.stats import rankdata

    values = np.asarray(scores, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"scores must be [models, prompts], got shape {values.shape}")
    filled = np.where(np.isnan(values), -np.inf, values)
    return rankdata(-filled, axis=0, method="average")


def first_place_share(ranks) -> np.ndarray:
    """Per model, the share of prompts it wins; a k-way tie for first gives each of the k models 1/k."""
    r = np.asarray(ranks, dtype=np.float64)
    best = r.min(axis=0, keepdims=True)
    is_first = r == best
    return (is_first / is_first.sum(axis=0, keepdims=True)).mean(axis=1)


def copeland_scores(pairwise_outcomes: dict[tuple[int, int], np.ndarray], num_models: int, num_items: int) -> np.ndarray:
    """Per-item scores [models, items] from pairwise outcomes: wins + ties/2 against the other models.

    ``pairwise_outcomes[(i, j)]`` holds per-item outcomes of model i against model j (1/0.5/0, NaN).
    Lets a pairwise-only judge (a VLM that only answers "which is better") rank models per prompt.
    """
    scores = np.zeros((num_models, num_items))
    for (i, j), outcome in pairwise_outcomes.items():
        o = np.nan_to_num(np.asarray(outcome, dtype=np.float64), nan=0.5)
        scores[i] += o
        scores[j] += 1 - o
    return scores


def pairwise_accuracy(judge_outcomes, oracle_outcomes) -> tuple[float, int]:
    """Agreement with an oracle on the pairs it does not call a tie: 1 agree, 1/2 judge tie or
    abstention, 0 disagree. Outcomes are A-against-B in {1, 0.5, 0} (NaN = abstained).
    Returns (accuracy, pairs used)."""
    judge = np.nan_to_num(np.asarray(judge_outcomes, dtype=float), nan=0.5)
    oracle = np.asarray(oracle_outcomes, dtype=float)
    decided = (oracle == 1.0) | (oracle == 0.0)
    if not decided.any():
        return float("nan"), 0
    agree = np.where(judge[decided] == 0.5, 0.5, (judge[decided] == oracle[decided]).astype(float))
    return float(agree.mean()), int(decided.sum())


def spearman(x, y) -> float:
    """Spearman rank correlation (ties averaged)."""
    from scipy.stats import spearmanr

    return float(spearmanr(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)).statistic)


# ------------------------------------------------------------------------------------ FID, CMMD


class FeatureNetwork(torch.nn.Module):
    """Wrap ``embed(images [N,3,H,W] in [0,1]) -> [N, d]`` as the nn.Module torchmetrics' FID accepts."""

    def __init__(self, embed, num_features: int, name: str = "custom"):
        super().__init__()
        self._embed = embed
        self.num_features = int(num_features)
        self.name = name

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self._embed(images).float().reshape(images.shape[0], -1)


class FeatureStats:
    """Reference statistics computed once, then compared with any number of generated sets.

    ``feature`` is "inception" (torchmetrics' default InceptionV3, 2048-d pool features) or a
    ``torch.nn.Module`` mapping images in [0, 1] to [N, d] features.
    """

    def __init__(self, feature="inception", antialias: bool = False, inception_weights: str | None = None):
        self.feature = feature
        self.metric = make_fid(feature, antialias=antialias, inception_weights=inception_weights)

    @torch.no_grad()
    def add_reference(self, images: torch.Tensor, batch_size: int = 64) -> None:
        for start in range(0, images.shape[0], batch_size):
            self.metric.update(_as_metric_input(images[start : start + batch_size]), real=True)

    @torch.no_grad()
    def fid(self, images: torch.Tensor, batch_size: int = 64) -> float:
        """FID of ``images`` against the reference set (the reference statistics are kept)."""
        self.metric.reset()
        for start in range(0, images.shape[0], batch_size):
            self.metric.update(_as_metric_input(images[start : start + batch_size]), real=False)
        return float(self.metric.compute())


def make_fid(feature="inception", antialias: bool = False, inception_weights: str | None = None):
    """torchmetrics' FrechetInceptionDistance keeping the reference statistics across resets.

    antialias=False keeps numbers comparable with papers computed before torchmetrics 1.8.
    """
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.utilities.imports import _TORCH_FIDELITY_AVAILABLE

    if isinstance(feature, torch.nn.Module):
        return FrechetInceptionDistance(feature=feature, reset_real_features=False, normalize=True)
    if feature != "inception":
        raise ValueError(f"FID feature network must be 'inception' or a torch.nn.Module, got {feature!r}")
    if not _TORCH_FIDELITY_AVAILABLE:
        raise RuntimeError(
            "FID with the default Inception network needs torch-fidelity (pip install torch-fidelity) and "
            "its InceptionV3 weights (downloaded on first use, or pass inception_weights=<path to "
            "weights-inception-2015-12-05-6726825d.pth> offline); or choose another feature network "
            "(for the testbed: --fid-feature shapes-clip)"
        )
    try:
        return FrechetInceptionDistance(
            feature=2048,
            reset_real_features=False,
            normalize=True,
            antialias=antialias,
            feature_extractor_weights_path=inception_weights,
        )
    except (OSError, RuntimeError) as err:
        raise RuntimeError(
            f"cannot load the InceptionV3 weights for FID ({err}); offline, pass inception_weights=<path>"
        ) from err


def _as_metric_input(images: torch.Tensor) -> torch.Tensor:
    images = images.float().clamp(0, 1)
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"FID needs images [N, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
    return images


def fid(reference: torch.Tensor, generated: torch.Tensor, feature="inception", **kwargs) -> float:
    """FID between two image sets [N, 3, H, W] in [0, 1] (each needs at least 2 images)."""
    stats = FeatureStats(feature, **kwargs)
    stats.add_reference(reference)
    return stats.fid(generated)


def cmmd(reference_embeddings: torch.Tensor, generated_embeddings: torch.Tensor, sigma: float = 10.0, scale: float = 1000.0) -> float:
    """CMMD (Jayasumana et al. 2024): squared MMD with a Gaussian RBF kernel on (CLIP) embeddings, x1000.

    Uses all pairs including i = j (the V-statistic), so a set against itself is exactly 0.
    """
    x = torch.as_tensor(reference_embeddings, dtype=torch.float64)
    y = torch.as_tensor(generated_embeddings, dtype=torch.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"CMMD needs embeddings [N, d] and [M, d], got {tuple(x.shape)} and {tuple(y.shape)}")
    gamma = 1.0 / (2 * sigma**2)

    def mean_kernel(a, b):
        return torch.exp(-gamma * torch.cdist(a, b).pow(2)).mean()

    return float(scale * (mean_kernel(x, x) + mean_kernel(y, y) - 2 * mean_kernel(x, y)))


def mean_and_sem(values) -> tuple[float, float]:
    """Mean and standard error of the mean, ignoring NaNs."""
    v = np.asarray(values, dtype=np.float64)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return float("nan"), float("nan")
    sem = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else float("nan")
    return float(v.mean()), sem


# ------------------------------------------------------------------------------------ paired changes


def clustered_sem(values, clusters) -> float:
    """Standard error of the mean of ``values`` whose members of one cluster (e.g. the images of one caption) are
    not independent: the cluster-robust (sandwich) estimator sqrt(G/(G-1) Σ_g (Σ_{i in g} (v_i - mean))²) / N over
    G clusters. With one value per cluster it is the ordinary standard error; NaN values are left out (as by
    mean_and_sem); NaN below two clusters."""
    v = np.asarray(values, dtype=np.float64)
    if len(clusters) != v.size:
        raise ValueError(f"clustered_sem needs one cluster per value: {v.size} values, {len(clusters)} clusters")
    keep = ~np.isnan(v)
    v = v[keep]
    _, index = np.unique(np.asarray([str(c) for c, k in zip(clusters, keep) if k]), return_inverse=True)
    groups = len(set(index.tolist()))
    if groups < 2:
        return float("nan")
    sums = np.bincount(index, weights=v - v.mean(), minlength=groups)
    return float(math.sqrt(groups / (groups - 1) * float((sums**2).sum())) / v.size)


@dataclass
class PairedChange:
    """after - before on the same (prompt, seed) images: the mean, its standard error per image (images
    independent) and clustered by prompt (a prompt's images share its difficulty), and counts."""

    mean: float
    sem_images: float
    sem_prompts: float
    images: int
    prompts: int
    better: int
    worse: int

    @property
    def prompt_se_ratio(self) -> float:
        """The change in clustered standard errors (the bar of experiments/notes: more than four)."""
        return self.mean / self.sem_prompts if self.sem_prompts > 0 else float("nan")


def paired_change(before, after, prompts, same: float = 1e-6) -> PairedChange:
    """The paired change of scores ``after`` over ``before`` of the images of ``prompts`` (one prompt per image;
    images whose score is NaN in either are left out)."""
    b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if not b.shape == a.shape == (len(prompts),):
        raise ValueError(f"paired_change needs one before and after score per prompt: {b.shape}, {a.shape}, "
                         f"{len(prompts)} prompts")
    keep = ~(np.isnan(a) | np.isnan(b))
    diff, kept = a[keep] - b[keep], [p for p, k in zip(prompts, keep) if k]
    mean, sem = mean_and_sem(diff)
    return PairedChange(mean, sem, clustered_sem(diff, kept), int(diff.size), len(set(kept)),
                        int((diff > same).sum()), int((diff < -same).sum()))

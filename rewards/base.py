"""The judge interface: every reward model, rule and (M)LLM judge speaks it.

- ``score(prompts, images) -> tensor[N]``: pointwise, higher is better.
- ``compare(prompts, images_a, images_b) -> list[Preference]``: pairwise.

A pointwise judge gets ``compare`` for free (score difference with a tie margin).
A pairwise-native judge (two-image VLM, API model) overrides ``compare`` and asks
both orders (position-bias control); it may leave ``score`` unimplemented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from rewards.images import Images, num_images


@dataclass
class Preference:
    """One pairwise verdict.

    prob_a: probability that image A is the better one (0.5 = no preference).
    tie: the judge saw no difference (or, for both-order judges, the orders disagreed).
    abstained: the judge gave no usable answer (refusal, unparseable, failed call);
        ``prob_a`` is then 0.5 and the pair must not be used as a label.
    raw: the judge's raw output (scores, text, per-order answers) for audit and re-parsing.
    """

    prob_a: float
    tie: bool = False
    abstained: bool = False
    raw: Any = None

    @property
    def winner(self) -> int | None:
        """0 if A wins, 1 if B wins, None for a tie or abstention."""
        if self.tie or self.abstained or self.prob_a == 0.5:
            return None
        return 0 if self.prob_a > 0.5 else 1


@dataclass
class Judge:
    """Base class. Subclasses set ``name`` and implement ``score`` and/or ``compare``."""

    name: str = "judge"
    tie_margin: float = 0.0
    # True for judges whose native question is "which of two images is better".
    pairwise_native: bool = field(default=False, init=False)

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        raise NotImplementedError(
            f"judge {self.name!r} is pairwise-only and has no pointwise score; use compare()"
        )

    def compare(self, prompts: list[str], images_a: Images, images_b: Images) -> list[Preference]:
        n = len(prompts)
        if num_images(images_a) != n or num_images(images_b) != n:
            raise ValueError(
                f"compare needs one prompt per pair: got {n} prompts, "
                f"{num_images(images_a)} images A and {num_images(images_b)} images B"
            )
        scores_a = self.score(prompts, images_a).detach().float().cpu()
        scores_b = self.score(prompts, images_b).detach().float().cpu()
        return [preference_from_scores(float(a), float(b), self.tie_margin) for a, b in zip(scores_a, scores_b)]

    def close(self) -> None:
        """Release resources (clients, caches). Safe to call twice."""


def preference_from_scores(score_a: float, score_b: float, tie_margin: float = 0.0) -> Preference:
    """Hard preference from two pointwise scores; |a - b| <= tie_margin is a tie (MJ-Bench rule)."""
    raw = {"score_a": score_a, "score_b": score_b}
    if math.isnan(score_a) or math.isnan(score_b):
        return Preference(0.5, tie=False, abstained=True, raw=raw)
    diff = score_a - score_b
    if abs(diff) <= tie_margin:
        return Preference(0.5, tie=True, raw=raw)
    return Preference(1.0 if diff > 0 else 0.0, raw=raw)


def is_pointwise(judge: Judge) -> bool:
    """True when the judge's own ``score`` rates single images. A pairwise-native judge (a two-image VLM or
    API judge, a position-biased oracle) and a judge without its own ``score`` are asked ``compare`` instead."""
    return type(judge).score is not Judge.score and not judge.pairwise_native

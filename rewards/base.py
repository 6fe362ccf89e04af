"""The judge interface: every reward model, rule and (M)LLM judge speaks it.

- ``score(prompts, images) -> tensor[N]``: pointwise, higher is better.
- ``compare(prompts, images_a, images_b) -> list[Preference]``: pairwise.

A pointwise judge gets ``compare`` for free (score difference with a tie margin).
A pairwise-native judge (two-image VLM, API model) overrides ``compare`` and asks
both orders (position-bias control); it may leave ``score`` unimplemented.

Every judge checks its inputs in one place, here: ``Judge.__init_subclass__`` wraps each subclass's
``score`` and ``compare`` so that images are PIL images or a finite float tensor [N, 3, H, W] in
[0, 1], and prompts a list of strings, one per image (rewards.images.check_images / check_prompts).
A bad input raises TypeError/ValueError instead of being clamped into a plausible wrong score.
Calls a judge makes to itself (compare asking score) are not checked again.

Their outputs are checked too (check_answers): a score is finite, or NaN for an abstention from a judge that
declares ``abstains = True`` ((M)LLM judges: a refusal, an answer without a rating, a failed call); a verdict's
P(A better) is in [0, 1]. Anything else raises JudgeAnswerError naming the judge: the run stops.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from rewards.images import Images, check_images, check_prompts, num_images

_checking = threading.local()  # depth of judge calls on this thread: only the outermost one checks its inputs


class JudgeAnswerError(RuntimeError):
    """A judge answered with something that is not a valid score (inf; NaN from a judge that never abstains; a
    rating outside its scale, a logprob that is not one): the run stops in one line naming the judge rather than
    train on, or rank by, it."""


def check_answers(judge, kind: str, result):
    """A judge's outputs are scores or abstentions: a score is finite, or NaN where the judge abstains
    (``judge.abstains``: (M)LLM judges); a verdict's probability is in [0, 1]."""
    if kind == "score":
        values = torch.as_tensor(result).detach().float()
        bad = torch.isinf(values) | (torch.isnan(values) & (not judge.abstains))
        if bool(bad.any()):
            shown = values[bad][:3].tolist()
            raise JudgeAnswerError(f"judge {judge.name!r} returned {int(bad.sum())} score(s) that are not valid "
                                   f"(e.g. {shown}); it is broken or misconfigured, so the run stops")
    else:
        for pref in result:
            if not (0.0 <= float(pref.prob_a) <= 1.0):
                raise JudgeAnswerError(f"judge {judge.name!r} returned a preference with P(A better) = {pref.prob_a!r}, "
                                       "not a probability; it is broken or misconfigured, so the run stops")
    return result


def _checked(method, kind: str):
    """``method`` (a judge's score or compare) with its inputs checked first, at the outermost call."""

    @functools.wraps(method)
    def wrapper(self, prompts, *images, **kwargs):
        depth = getattr(_checking, "depth", 0)
        if depth == 0:
            names = ("images",) if kind == "score" else ("images_a", "images_b")
            batches = list(images) + [kwargs[n] for n in names[len(images):] if n in kwargs]
            counts = [check_images(batch, f"{self.name}.{kind}: {name}") for batch, name in zip(batches, names)]
            if len(set(counts)) > 1:
                raise ValueError(f"{self.name}.{kind}: images_a and images_b must pair up, got {counts[0]} and {counts[1]}")
            check_prompts(prompts, counts[0] if counts else 0, f"{self.name}.{kind}: prompts")
        _checking.depth = depth + 1
        try:
            result = method(self, prompts, *images, **kwargs)
        finally:
            _checking.depth = depth
        return check_answers(self, kind, result)  # at every depth: compare built on score sees bad scores too

    wrapper.checks_inputs = True
    return wrapper


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
    # True for judges that may give no answer (an (M)LLM judge's refusal or failed call): their NaN scores are
    # abstentions; for every other judge a NaN score is a fault (check_answers).
    abstains = False
    # True for judges that can judge an edit prompt ('[source: ...] <instruction>', rewards.edit_prompts): they see
    # the source image and the instruction (VLM and API judges, the edit oracle) or read the image alone (rules).
    judges_edits = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for kind in ("score", "compare"):
            own = cls.__dict__.get(kind)
            if callable(own) and not getattr(own, "checks_inputs", False):
                setattr(cls, kind, _checked(own, kind))

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        raise NotImplementedError(
            f"judge {self.name!r} is pairwise-only and has no pointwise score; use compare()"
        )

    def compare(self, prompts: list[str], images_a: Images, images_b: Images) -> list[Preference]:
        check_pair_counts(prompts, images_a, images_b)
        scores_a = self.score(prompts, images_a).detach().float().cpu()
        scores_b = self.score(prompts, images_b).detach().float().cpu()
        return [preference_from_scores(float(a), float(b), self.tie_margin) for a, b in zip(scores_a, scores_b)]

    @property
    def pointwise(self) -> bool:
        """True when the judge's own ``score`` rates single images. A pairwise-native judge (a two-image VLM or
        API judge, a position-biased oracle) and a judge without its own ``score`` are asked ``compare`` instead."""
        return type(self).score is not Judge.score and not self.pairwise_native

    def check_prompts_supported(self, prompts: list[str]) -> None:
        """Raise ValueError naming the first prompt this judge cannot judge at all, before any image is made (a rule
        judge that parses its captions); most judges take any text and check nothing."""

    def close(self) -> None:
        """Release resources (clients, caches). Safe to call twice."""


# The base class's own methods too: a subclass that inherits compare gets it checked as well.
Judge.score = _checked(Judge.score, "score")
Judge.compare = _checked(Judge.compare, "compare")


def check_pair_counts(prompts: list[str], images_a: Images, images_b: Images) -> None:
    """compare() takes one prompt per pair: as many prompts as images A and images B."""
    n = len(prompts)
    if num_images(images_a) != n or num_images(images_b) != n:
        raise ValueError(
            f"compare needs one prompt per pair: got {n} prompts, "
            f"{num_images(images_a)} images A and {num_images(images_b)} images B"
        )


def preference_from_scores(score_a: float, score_b: float, tie_margin: float = 0.0) -> Preference:
    """Hard preference from two pointwise scores; |a - b| <= tie_margin is a tie (MJ-Bench rule)."""
    raw = {"score_a": score_a, "score_b": score_b}
    if math.isnan(score_a) or math.isnan(score_b):
        return Preference(0.5, tie=False, abstained=True, raw=raw)
    diff = score_a - score_b
    if abs(diff) <= tie_margin:
        return Preference(0.5, tie=True, raw=raw)
    return Preference(1.0 if diff > 0 else 0.0, raw=raw)



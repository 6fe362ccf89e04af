"""The MJ-Bench protocol shared by API judges (rewards.api) and local VLM judges (rewards.vlm).

A multimodal LLM judge is asked a question (judge_prompts.JudgeQuestion) about one or two images,
answers in text, and the answer is parsed (parsing.parse_answer). This module turns those answers
into scores and preferences:

- ``score`` (modes single / likert): one question per image; abstentions are NaN.
- ``compare`` (mode pair): one question per pair in each order (A,B) and (B,A) unless
  ``swap_orders=False``; consistent answers give that preference, inconsistent ones a tie
  (``inconsistent="tie"``) or the mean of the two orders' probabilities (``"average"``).
  ``raw`` records both answers and whether they agreed. In single/likert modes ``compare`` is the
  score difference (base class).

Subclasses implement ``judge_id`` and ``_generate(requests, on_answer)``. Answers are looked up in
and written to the SQLite cache (``cache_path``) one by one, as they arrive.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from rewards.base import Judge, JudgeAnswerError, Preference, check_pair_counts, preference_from_scores
from rewards.cache import CachedAnswer, JudgeCache, cache_key, image_hash
from rewards.concurrency import CallStats
from rewards.edit_prompts import is_edit_prompt, load_source, parse_edit_prompt
from rewards.images import Images, to_pil
from rewards.judge_prompts import JudgeQuestion, load_template, render, render_edit
from rewards.parsing import FAILED, OK, Parsed, parse_answer

INCONSISTENT_POLICIES = ("tie", "average")
ONE_ORDER_POLICIES = ("abstain", "use")


class JudgeNotReadyError(RuntimeError):
    """The judge cannot run (missing key, rejected key or model id, unreachable server)."""


@dataclass
class JudgeRequest:
    """One question to send: the rendered prompt and its images (in the order shown)."""

    caption: str
    prompt: str
    images: list[Image.Image]
    image_hashes: list[str]
    key: str = ""


@dataclass
class Answer:
    """One question's outcome: the raw text (None when no answer came back) and its parse."""

    raw: str | None
    parsed: Parsed
    cached: bool = False
    error: str | None = None

    def as_dict(self) -> dict:
        return {"raw": self.raw, "status": self.parsed.status, "value": self.parsed.value,
                "reason": self.parsed.reason or self.error or "", "cached": self.cached}


@dataclass
class MllmJudge(Judge):
    """Base of the (M)LLM judges. Options are documented in docs/judges_vlm_api.md."""

    model: str = ""
    mode: str = "single"
    perspective: str = "alignment"
    scale: str = "1-10"
    likert_levels: int = 5
    swap_orders: bool = True
    inconsistent: str = "tie"
    one_order: str = "abstain"
    temperature: float | None = 0.0  # None: the provider's default (not sent)
    max_tokens: int = 512
    cache_path: str | None = None
    protocol: str = "project"  # "mjbench": the benchmark's questions (judge_prompts.PROTOCOLS)
    prompt_template: str | None = None  # a template file replacing the question text (e.g. MJ-Bench's own)
    stats: CallStats = field(default_factory=CallStats, repr=False)
    abstains = True  # a refusal, an answer with no rating, a failed call: NaN scores, abstained verdicts
    # An answer with a number that is not a valid score stops the run (check_answers); the judge benchmark, which
    # measures judges, counts it as unparseable instead (MJ-Bench's rule).
    stop_on_invalid_answers: bool = field(default=True, init=False, repr=False)
    last_answers: list = field(default_factory=list, repr=False)
    _cache: JudgeCache | None = field(default=None, init=False, repr=False)
    judges_edits = True  # an edit prompt is asked the editing question, with the source image first

    def __post_init__(self):
        self.use_protocol(self.protocol, self.prompt_template)
        if self.inconsistent not in INCONSISTENT_POLICIES:
            raise ValueError(f"inconsistent={self.inconsistent!r}; valid: {', '.join(INCONSISTENT_POLICIES)}")
        if self.one_order not in ONE_ORDER_POLICIES:
            raise ValueError(f"one_order={self.one_order!r}; valid: {', '.join(ONE_ORDER_POLICIES)}")
        if self.temperature is not None and not (0.0 <= float(self.temperature) <= 2.0):
            raise ValueError(f"temperature={self.temperature!r}; valid: 0 to 2, or None for the provider default")
        self.pairwise_native = self.mode == "pair"
        if self.cache_path:
            self._cache = JudgeCache(self.cache_path)

    def use_protocol(self, protocol: str = "project", prompt_template: str | None = None) -> None:
        """Ask the questions of ``protocol``, or the text of a template file (checked here)."""
        template = load_template(prompt_template) if prompt_template else None
        self.question = JudgeQuestion(self.mode, self.perspective, self.scale, int(self.likert_levels),
                                      protocol, template)
        self.protocol, self.prompt_template = protocol, prompt_template
        if template is not None and getattr(self, "structured", None) not in (None, "none"):
            self.structured = "none"  # a forced JSON schema would contradict the template's own answer format

    # ---- to implement -------------------------------------------------------------------------
    @property
    def judge_id(self) -> str:
        raise NotImplementedError

    def decoding(self) -> dict:
        """Settings that change the answer; part of the cache key."""
        temperature = None if self.temperature is None else float(self.temperature)
        return {"temperature": temperature, "max_tokens": int(self.max_tokens)}

    def _generate(self, requests: list[JudgeRequest], on_answer: Callable[[int, CachedAnswer | Exception], None]):
        """Answer every request, calling ``on_answer(i, answer_or_error)`` as each one finishes."""
        raise NotImplementedError

    def check_ready(self) -> None:
        """Fail fast (JudgeNotReadyError) before any expensive work; cheap when ready."""

    def check_prompts_supported(self, prompts: list[str]) -> None:
        """An edit needs the source image beside the edit: a judge that sees one image per question cannot judge it."""
        if not getattr(self, "multi_image", True) and any(is_edit_prompt(p) for p in prompts):
            raise ValueError(f"judge {self.name!r} looks at one image per question, and an edit is judged with its "
                             "source image beside it; use a model that takes several images")

    def parse(self, raw: str | None) -> Parsed:
        """One raw answer -> rating or verdict; judges with their authors' own answer format override this."""
        return parse_answer(raw, self.question)

    # ---- the protocol -------------------------------------------------------------------------
    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        if self.mode == "pair":
            raise ValueError(
                f"judge {self.name!r} runs in mode 'pair' (two images per question); use compare(), "
                "or load it with mode='single' or mode='likert' for pointwise scores"
            )
        pils = to_pil(images)
        if len(pils) != len(prompts):
            raise ValueError(f"score needs one prompt per image: got {len(prompts)} prompts and {len(pils)} images")
        answers = self.ask([self._request(p, [img]) for p, img in zip(prompts, pils)])
        self.last_answers = answers
        return torch.tensor([a.parsed.value if a.parsed.ok else math.nan for a in answers], dtype=torch.float32)

    def compare(self, prompts: list[str], images_a: Images, images_b: Images) -> list[Preference]:
        check_pair_counts(prompts, images_a, images_b)
        n = len(prompts)
        pa, pb = to_pil(images_a), to_pil(images_b)
        if self.mode != "pair":  # pointwise: score all 2n images in one batch (one round of concurrency)
            scores = self.score(list(prompts) * 2, pa + pb).tolist()
            answers = self.last_answers
            prefs = [preference_from_scores(a, b, self.tie_margin) for a, b in zip(scores[:n], scores[n:])]
            for pref, ans_a, ans_b in zip(prefs, answers[:n], answers[n:]):
                pref.raw = {**pref.raw, "answers": [ans_a.as_dict(), ans_b.as_dict()]}
            return prefs
        requests = [self._request(p, [a, b]) for p, a, b in zip(prompts, pa, pb)]
        if self.swap_orders:
            requests += [self._request(p, [b, a]) for p, a, b in zip(prompts, pa, pb)]
        answers = self.ask(requests)
        self.last_answers = answers
        if not self.swap_orders:
            return [reconcile(ab, None, self.inconsistent, "use") for ab in answers]
        return [reconcile(ab, ba, self.inconsistent, self.one_order) for ab, ba in zip(answers[:n], answers[n:])]

    def _request(self, caption: str, images: list[Image.Image]) -> JudgeRequest:
        edit = parse_edit_prompt(caption)
        if edit is None:
            prompt = render(self.question, caption)
        else:  # an edit: the source image first, then the edit(s), and the editing question
            images = [load_source(edit.source, images[0].size[0])] + list(images)
            prompt = render_edit(self.question, edit.instruction)
        hashes = [image_hash(img) for img in images]
        key = cache_key(self.judge_id, self.question.key(), prompt, hashes, self.decoding())
        return JudgeRequest(caption, prompt, images, hashes, key)

    def ask(self, requests: list[JudgeRequest]) -> list[Answer]:
        """Answers for the requests: from the cache where present, otherwise generated (and cached)."""
        answers: list[Answer | None] = [None] * len(requests)
        todo: list[int] = []
        seen: dict[str, int] = {}
        duplicates: list[tuple[int, int]] = []
        for i, req in enumerate(requests):
            hit = self._cache.get(req.key) if self._cache is not None else None
            if hit is not None:
                self.stats.add(cache_hits=1)
                answers[i] = Answer(hit.raw, self.parse(hit.raw), cached=True)
            elif req.key in seen:  # the same question twice in one batch: ask once
                duplicates.append((i, seen[req.key]))
            else:
                seen[req.key] = i
                todo.append(i)

        def on_answer(j: int, result: CachedAnswer | Exception) -> None:
            i = todo[j]
            if isinstance(result, Exception):
                self.stats.add(failures=1)
                answers[i] = Answer(None, Parsed(FAILED, reason=str(result)), error=str(result))
                return
            self.stats.add(input_tokens=result.input_tokens, output_tokens=result.output_tokens)
            if self._cache is not None:
                req = requests[i]
                self._cache.put(req.key, judge=self.judge_id, question=self.question.key(), prompt=req.prompt,
                                image_hashes=req.image_hashes, decoding=self.decoding(), answer=result)
            answers[i] = Answer(result.raw, self.parse(result.raw))

        if todo:
            self._generate([requests[i] for i in todo], on_answer)
        for i, j in duplicates:
            answers[i] = answers[j]
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:  # a backend bug must not silently drop labels
            raise RuntimeError(f"judge {self.name!r} returned no answer for requests {missing[:5]}")
        if self.stop_on_invalid_answers:
            self.check_answers(requests, answers)
        return answers  # type: ignore[return-value]

    def check_answers(self, requests: list[JudgeRequest], answers: list[Answer]) -> None:
        """An answer holding a number that is not a valid score stops the run (JudgeAnswerError naming the judge); it
        stays in the cache, for audit."""
        bad = [(req, a) for req, a in zip(requests, answers) if a.parsed.invalid]
        if bad:
            req, answer = bad[0]
            where = f"; its raw answers are in {self.cache_path}" if self.cache_path else ""
            raise JudgeAnswerError(
                f"judge {self.name!r} ({self.judge_id}) gave {len(bad)} answer(s) that are not a valid score, e.g. "
                f"for {req.caption!r}: {answer.parsed.reason}; check the judge's model or server{where}")

    def keep_answers_in(self, path: str | Path) -> None:
        """Cache answers at ``path`` (the trainers pass one in the run folder), unless given a cache_path already."""
        if self._cache is None:
            self.cache_path = str(path)
            self._cache = JudgeCache(path)

    def usage_summary(self) -> str:
        return self.stats.summary(self.judge_id, getattr(self, "price_per_mtok", None))

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None


def order_prob(parsed: Parsed, swapped: bool) -> float:
    """P(A better) from one order's answer (better_image 1 = the first image shown)."""
    better = parsed.value["better"]
    if better == 0:
        return 0.5
    first_wins = better == 1
    return float(first_wins != swapped)


def reconcile(ab: Answer, ba: Answer | None, inconsistent: str = "tie", one_order: str = "abstain") -> Preference:
    """Combine the answers for orders (A,B) and (B,A) into one Preference (position-bias control)."""
    orders = [dict(order="AB", **ab.as_dict())] + ([dict(order="BA", **ba.as_dict())] if ba is not None else [])
    probs = [order_prob(ab.parsed, False) if ab.parsed.ok else None]
    if ba is not None:
        probs.append(order_prob(ba.parsed, True) if ba.parsed.ok else None)
    usable = [p for p in probs if p is not None]
    raw: dict[str, Any] = {"orders": orders, "consistent": None}
    if not usable or (len(usable) < len(probs) and one_order == "abstain"):
        return Preference(0.5, abstained=True, raw=raw)
    if len(usable) == 1:
        p = usable[0]
        return Preference(p, tie=p == 0.5, raw=raw)
    p_ab, p_ba = usable
    raw["consistent"] = p_ab == p_ba
    if p_ab == p_ba:
        return Preference(p_ab, tie=p_ab == 0.5, raw=raw)
    if inconsistent == "tie":
        return Preference(0.5, tie=True, raw=raw)
    p = (p_ab + p_ba) / 2
    return Preference(p, tie=p == 0.5, raw=raw)


def reparse(answers: list[Answer], question: JudgeQuestion) -> list[Answer]:
    """Parse stored raw answers again (e.g. after improving the parser); no calls are made."""
    return [a if a.raw is None else Answer(a.raw, parse_answer(a.raw, question), a.cached, a.error) for a in answers]


__all__ = ["Answer", "JudgeNotReadyError", "JudgeRequest", "MllmJudge", "OK", "reconcile", "reparse"]

"""VQAScore's probability rules (Lin et al. 2024), as the authors' t2v_metrics computes them. Pure functions.

Source: github.com/linzhiqiu/t2v_metrics (commit 6ecb74f), ``t2v_metrics/models/vqascore_models``:

- question ``'Does this figure show "{}"? Please answer Yes or No.'``, answer ``'Yes'`` (every model file);
- a local model (``qwen2vl_model.py``): greedy ``generate`` with ``max_new_tokens=1``, ``output_scores=True``;
  the score is the softmax over the *whole vocabulary* of the first answer position's scores (at temperature
  1), taken at the id of ``tokenizer.encode("Yes", add_special_tokens=False)`` - no renormalising over
  yes/no. ``scores`` are generate's processed logits, so a checkpoint's ``repetition_penalty`` applies.
  A multi-token answer scores the geometric mean of its tokens' probabilities;
- a server (``gpt4v_model.py``): ``logprobs=True, top_logprobs=k`` (k=2 by default), first answer token;
  among its top tokens, one whose ``strip().lower()`` is "yes" gives ``exp(logprob)`` (when several match,
  the last one listed wins, as the authors' loop overwrites), else one that is "no" gives
  ``1 - exp(logprob)``, else the score is 0.
"""

from __future__ import annotations

import json
import math

import torch

QUESTION_TEMPLATE = 'Does this figure show "{caption}"? Please answer Yes or No.'
ANSWER = "Yes"


class InvalidLogprobError(ValueError):
    """A server's top logprob that is not a log-probability (NaN, inf, above 0): the authors' rule would turn it
    into a score that is not a probability, so it is no score at all."""


def check_logprobs(top: list[tuple[str, float]]) -> None:
    for token, logprob in top:
        if not (math.isfinite(logprob) and logprob <= 0.0):
            raise InvalidLogprobError(f"the logprob of token {token!r} is {logprob!r}, not a finite number <= 0")


def softmax_answer_probability(scores: list[torch.Tensor], answer_ids: list[int]) -> float:
    """P(answer) from generate's per-position scores [vocab]: full-vocab softmax, geometric mean over tokens."""
    if not answer_ids or len(scores) < len(answer_ids):
        raise ValueError(f"need scores for {len(answer_ids)} answer tokens, got {len(scores)} positions")
    log_p = sum(float(torch.log_softmax(s.double(), dim=-1)[t]) for s, t in zip(scores, answer_ids))
    return math.exp(log_p / len(answer_ids))


def top_logprobs_probability(top: list[tuple[str, float]], answer: str = ANSWER) -> float:
    """P(answer) from a server's first-token top logprobs [(token, logprob), ...] (the authors' API rule); a logprob
    that is not a finite number <= 0 raises InvalidLogprobError (theirs would give NaN, inf or more than 1)."""
    check_logprobs(top)
    target = answer.strip().lower()
    opposite = "no" if target == "yes" else "yes"
    target_lp = opposite_lp = None
    for token, logprob in top:
        token = token.strip().lower()
        if token == target:
            target_lp = logprob  # later matches overwrite earlier ones, as in the authors' loop
        elif token == opposite:
            opposite_lp = logprob
    if target_lp is not None:
        return math.exp(target_lp)
    if opposite_lp is not None:
        return 1.0 - math.exp(opposite_lp)
    return 0.0


def raw_from_probability(p: float, top: list[tuple[str, float]]) -> str:
    """The cached answer of a local model: the probability and the first position's top tokens (for audit)."""
    return json.dumps({"p_answer": p, "top": [[t, lp] for t, lp in top]})


def raw_from_top_logprobs(top: list[tuple[str, float]]) -> str:
    """The cached answer of a server: its first token's top logprobs, so the rule can be applied again."""
    return json.dumps({"top_logprobs": [[t, lp] for t, lp in top]})


def probability_from_raw(raw: str, answer: str = ANSWER) -> float:
    """The score a cached answer (either form above) stands for; ValueError when it is neither."""
    obj = json.loads(raw)
    if "top_logprobs" in obj:
        return top_logprobs_probability([(t, float(lp)) for t, lp in obj["top_logprobs"]], answer)
    if "p_answer" in obj:
        return float(obj["p_answer"])
    raise ValueError("neither p_answer nor top_logprobs in the answer")

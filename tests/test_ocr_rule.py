"""Flow-GRPO's OCR reward rule against the authors' code: tests/data/ocr_rule_reference.json holds the rewards
of flow_grpo/ocr.py (OcrScorer, with the real python-Levenshtein) on recorded PaddleOCR lines
(experiments/rules_reference.py ran it with PaddleOCR replaced by the recorded lines)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rewards.ocr_rule import joined_text, levenshtein, ocr_reward, ocr_reward_for_prompt, quoted_text

REFERENCE = json.loads((Path(__file__).parent / "data" / "ocr_rule_reference.json").read_text())


@pytest.mark.parametrize("index", range(len(REFERENCE["cases"])))
def test_reward_matches_the_authors_on_recorded_ocr_lines(index):
    case = REFERENCE["cases"][index]
    lines = [(text, conf) for text, conf in case["lines"]]
    assert ocr_reward_for_prompt(case["prompt"], lines) == pytest.approx(case["reward"], abs=1e-12)


def test_reference_spans_the_reward_range():
    rewards = {round(c["reward"], 3) for c in REFERENCE["cases"]}
    assert 0.0 in rewards and 1.0 in rewards and any(0 < r < 1 for r in rewards)


def test_levenshtein_by_hand_and_symmetric():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("flaw", "lawn") == 2
    rng = random.Random(0)
    for _ in range(50):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 7)))
        b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 7)))
        assert levenshtein(a, b) == levenshtein(b, a) <= max(len(a), len(b))


def test_the_authors_normalisation():
    assert quoted_text('a sign saying "Hello World" at night') == "Hello World"
    assert ocr_reward("Hello World", "HELLOWORLD") == 1.0  # spaces and case do not count
    assert ocr_reward("Hello", "xx hello yy") == 1.0  # the target inside more text is a match
    assert ocr_reward("abcd", "abcf") == 0.75
    assert ocr_reward("abcd", "zzzzzzzzzzzzzzzzz") == 0.0  # capped at the target's length
    assert ocr_reward("ab\tc", "abc") == pytest.approx(1 - 1 / 4)  # only ' ' is removed, as theirs
    assert joined_text([("OPEN", 0.9), ("ignored", 0.0), ("NOW", 0.5)]) == "OPENNOW"


def test_prompts_without_text_to_render_fail_clearly():
    with pytest.raises(ValueError, match="double quotes"):
        quoted_text("a photo of a cat")
    with pytest.raises(ValueError, match="empty"):
        ocr_reward_for_prompt('an empty sign "  "', [("x", 1.0)])

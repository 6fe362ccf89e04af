"""Turn a judge's raw answer into a rating, or say why it cannot (an abstention).

Order of attempts: a JSON object (bare, fenced or embedded in prose), then key-value lines
("Rating: 7", "BETTER IMAGE: 2"), then common prose shapes ("7/10", "Image 2 is better").
A refusal or an answer with no usable value is an abstention with a reason; it is never
turned into a tie or a middle score. Out-of-range numbers are abstentions too.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from rewards.judge_prompts import JudgeQuestion

OK, REFUSAL, UNPARSEABLE, FAILED = "ok", "refusal", "unparseable", "failed"
# Backends store an API-level refusal (OpenAI ``refusal``, Anthropic stop_reason "refusal", Gemini
# safety block) as this prefix + the provider's text, so the cached raw answer re-parses as a refusal.
REFUSAL_MARKER = "[refused]"

_REFUSAL = re.compile(
    r"\b(i\s*(?:'m|am)\s+(?:sorry|unable|not able)|i\s*(?:can(?:'|no)?t|cannot|won'?t|will not)\s+"
    r"(?:help|assist|evaluate|rate|provide|comply|view|see|analy[sz]e|judge|do that|fulfil)|"
    r"as an ai\b|unable to (?:help|assist|evaluate|rate|provide|comply|view|see)|"
    # Claude 3's way of declining (MJ-Bench's released answers): "I apologize, but I do not feel comfortable ..."
    r"i\s+apologi[sz]e,?\s+but\b|(?:do not|don't)\s+feel\s+comfortable|must refrain from)",
    re.IGNORECASE,
)
_NUMBER = r"[-+]?\d+(?:\.\d+)?"


@dataclass
class Parsed:
    """status: ok | refusal | unparseable | failed (no answer at all, e.g. the call failed)."""

    status: str
    value: Any = None  # float for single/likert; dict(better, rating_1, rating_2) for pair
    reason: str = ""
    # The answer holds a number where the rating goes, but not a valid one (outside the scale, NaN, inf): not an
    # abstention but a judge that answers wrongly; MllmJudge stops the run on it (judge benchmarks count it).
    invalid: bool = False

    @property
    def ok(self) -> bool:
        return self.status == OK


def is_refusal(text: str) -> bool:
    return bool(_REFUSAL.search(text or ""))


def parse_answer(text: str | None, question: JudgeQuestion) -> Parsed:
    """Parse one raw answer for ``question``'s mode."""
    if text is None or not str(text).strip():
        return Parsed(UNPARSEABLE, reason="empty answer")
    text = str(text)
    if text.startswith(REFUSAL_MARKER):
        return Parsed(REFUSAL, reason=text[len(REFUSAL_MARKER):].strip() or "the judge declined to answer")
    obj = extract_json(text)
    if question.mode == "pair":
        parsed = _pair_from_obj(obj, question) if obj is not None else None
        parsed = parsed or _pair_from_text(text, question)
    elif question.mode == "likert":
        parsed = _likert_from_obj(obj, question) if obj is not None else None
        parsed = parsed or _likert_from_text(text, question)
    else:
        parsed = _number_from_obj(obj, question) if obj is not None else None
        parsed = parsed or _number_from_text(text, question)
    if parsed is not None:
        return parsed
    if is_refusal(text):
        return Parsed(REFUSAL, reason="the judge declined to answer")
    return Parsed(UNPARSEABLE, reason=f"no {question.mode} rating found in the answer")


# ---- JSON ---------------------------------------------------------------------------------------

def extract_json(text: str) -> dict | None:
    """The JSON object(s) in ``text`` (bare, in ``` fences, or inside prose), else None.

    Several objects are merged, the first value of a key winning: MJ-Bench's templates ask for
    two objects, ``{"ANALYSIS": ...}`` then ``{"ALIGNMENT-RATING": ...}``, and the rating sits in
    the second one.
    """
    stripped = text.strip()
    try:
        whole = json.loads(stripped)
    except ValueError:
        whole = None
    if isinstance(whole, dict):
        return {_norm_key(k): v for k, v in whole.items()}
    decoder = json.JSONDecoder()
    merged: dict = {}
    position = 0
    while True:
        start = stripped.find("{", position)
        if start < 0:
            break
        try:
            obj, end = decoder.raw_decode(stripped, start)
        except ValueError:
            position = start + 1
            continue
        if isinstance(obj, dict):
            for key, value in obj.items():
                merged.setdefault(_norm_key(key), value)
        position = end
    return merged or None


def _norm_key(key: str) -> str:
    """'IMAGE-1 RATING' / 'image1Rating' / 'Better Image' -> 'image_1_rating' / 'better_image'."""
    key = re.sub(r"(?<=[a-z])(?=[A-Z0-9])|(?<=[0-9])(?=[A-Za-z])", "_", str(key))
    return re.sub(r"[^a-z0-9]+", "_", key.lower()).strip("_")


def _to_number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        match = re.search(rf"({_NUMBER})\s*(?:/\s*({_NUMBER}))?", value)
        if match:
            return float(match.group(1))
    return None


def _in_range(x: float, question: JudgeQuestion) -> bool:
    lo, hi = question.bounds
    return lo <= x <= hi


def _rating_key(obj: dict, preferred: tuple[str, ...]) -> str | None:
    """The key holding the rating: a usual name, else the one key named '<aspect>_rating'
    (MJ-Bench: ALIGNMENT-RATING, ARTIFACTS-RATING, SAFETY-RATING, BIAS-FAIRNESS-RATING)."""
    for key in preferred:
        if key in obj:
            return key
    named = [k for k in obj if k.endswith("_rating") and not re.match(r"image_?\d", k)]
    return named[0] if len(named) == 1 else None


def _number_from_obj(obj: dict, question: JudgeQuestion) -> Parsed | None:
    key = _rating_key(obj, ("rating", "score", "overall_rating", "image_rating", "image_1_rating"))
    if key is None:
        return None
    if isinstance(obj[key], float) and not math.isfinite(obj[key]):
        return _out_of_scale(obj[key], question)
    x = _to_number(obj[key])
    if x is None:
        return None
    if not _in_range(x, question):
        return _out_of_scale(x, question)
    return Parsed(OK, x)


def _out_of_scale(x: float, question: JudgeQuestion) -> Parsed:
    return Parsed(UNPARSEABLE, reason=f"rating {x} outside the scale {question.scale}", invalid=True)


def _likert_from_obj(obj: dict, question: JudgeQuestion) -> Parsed | None:
    key = _rating_key(obj, ("rating", "label", "score", "image_rating"))
    if key is not None and isinstance(obj[key], str):
        return _likert_from_text(obj[key], question, whole=True)
    return None


def _pair_from_obj(obj: dict, question: JudgeQuestion) -> Parsed | None:
    r1 = _to_number(obj.get("image_1_rating", obj.get("rating_1")))
    r2 = _to_number(obj.get("image_2_rating", obj.get("rating_2")))
    better_raw = obj.get("better_image", obj.get("better", obj.get("preferred_image")))
    better = _better_from_value(better_raw)
    return _pair_result(better, r1, r2, question)


# ---- free text ----------------------------------------------------------------------------------

def _number_from_text(text: str, question: JudgeQuestion) -> Parsed | None:
    patterns = (
        rf"(?:rating|score)\s*(?:\*\*)?\s*(?:is|of|[:=\-])?\s*(?:\*\*)?\s*({_NUMBER})",
        rf"({_NUMBER})\s*(?:/|out of)\s*{_NUMBER}",
        rf"(?:rate|give)\s+(?:it|this image|the image)\s+(?:a\s+|an\s+)?({_NUMBER})",
        # LLaVA-1.6's prose under a "RATING:" heading: "I would rate this image as a 5 on the scale"
        rf"\brate\s+(?:it|this image|the image|the [a-z ]{{1,40}}? of this image)\s+(?:as|at)\s+(?:a\s+|an\s+)?({_NUMBER})",
        rf"\brating\s+(?:for|of)\s+(?:this|the)\s+image\s+(?:is|would be)\s+(?:a\s+)?({_NUMBER})",
        # a "<ASPECT>-RATING:" heading, then a bullet "- **Artifacts**: 3"
        rf"rating\s*:\s*\n\s*[-*]?\s*(?:\*\*)?[a-z][a-z &/-]{{0,30}}(?:\*\*)?\s*:\s*(?:\*\*)?\s*({_NUMBER})",
    )
    for pattern in patterns:
        matches = re.findall(pattern, text, re.IGNORECASE)
        if matches:
            x = float(matches[-1])  # the final verdict comes last when the judge revises itself
            if not _in_range(x, question):
                return _out_of_scale(x, question)
            return Parsed(OK, x)
    bare = re.fullmatch(rf"\s*({_NUMBER})\s*\.?\s*", text)
    if bare:
        x = float(bare.group(1))
        return Parsed(OK, x) if _in_range(x, question) else _out_of_scale(x, question)
    return None


def _likert_from_text(text: str, question: JudgeQuestion, whole: bool = False) -> Parsed | None:
    labels = question.labels
    # Longest first so "Below Average" is not read as "Average" and "Very Poor" not as "Poor".
    by_length = sorted(range(len(labels)), key=lambda i: -len(labels[i]))

    def labels_in(fragment: str) -> list[int]:
        found, taken = [], fragment.lower()
        for i in by_length:
            pattern = r"\b" + re.escape(labels[i].lower()) + r"\b"
            if re.search(pattern, taken):
                found.append(i)
                taken = re.sub(pattern, " ", taken)
        return found

    rating_line = None if whole else re.search(r"(?:rating|label|score)\s*(?:\*\*)?\s*[:=\-]\s*(.+)", text, re.I)
    for fragment in ([rating_line.group(1)] if rating_line else []) + [text]:
        found = labels_in(fragment)
        if len(found) == 1:
            return Parsed(OK, float(found[0] + 1))
        if len(found) > 1:
            return Parsed(UNPARSEABLE, reason="more than one Likert label in the answer")
    return None


def _better_from_value(value) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value) if value in (0, 1, 2) else None
    text = str(value).strip().lower()
    if re.fullmatch(r"(?:image[\s_-]*)?([012])\.?", text):
        return int(re.search(r"[012]", text).group())
    if text in ("tie", "equal", "none", "neither", "both"):
        return 0
    return None


def _pair_from_text(text: str, question: JudgeQuestion) -> Parsed | None:
    def rating(idx: int) -> float | None:
        match = re.findall(
            rf"image[\s_-]*{idx}[\s_-]*(?:rating|score)\s*(?:\*\*)?\s*[:=\-]?\s*(?:\*\*)?\s*({_NUMBER})", text, re.I
        )
        return float(match[-1]) if match else None

    better = None
    labelled = re.findall(r"better[\s_-]*image\s*(?:\*\*)?\s*[:=\-]?\s*(?:\*\*)?\s*(image[\s_-]*)?([012]|tie)", text, re.I)
    if labelled:
        better = _better_from_value(labelled[-1][1])
    else:
        prose = re.findall(
            r"image[\s_-]*([12])\s+is\s+(?:clearly\s+|slightly\s+|much\s+)?(?:better|preferred|superior)"
            r"|(?:prefer|choose|pick)\s+image[\s_-]*([12])",
            text,
            re.I,
        )
        picks = {a or b for a, b in prose}
        if len(picks) == 1:
            better = int(picks.pop())
        elif re.search(r"\b(?:it'?s a tie|they are equally good|equally good)\b", text, re.I):
            better = 0
    return _pair_result(better, rating(1), rating(2), question)


def _pair_result(better: int | None, r1: float | None, r2: float | None, question: JudgeQuestion) -> Parsed | None:
    for r in (r1, r2):
        if r is not None and not _in_range(r, question):
            return _out_of_scale(r, question)
    if better is None and r1 is not None and r2 is not None:
        better = 0 if r1 == r2 else (1 if r1 > r2 else 2)  # no explicit choice: the ratings decide
    if better is None:
        return None
    return Parsed(OK, {"better": better, "rating_1": r1, "rating_2": r2})

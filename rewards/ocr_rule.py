"""Flow-GRPO's OCR reward as a pure rule: the prompt's quoted text against the text read from the image.

As in the authors' ``flow_grpo/ocr.py`` (``OcrScorer.__call__``):

    target     = the text after the prompt's first '"' up to the next one (``prompt.split('"')[1]``)
    read       = the engine's text lines with a confidence above 0, joined with nothing between them
    both lose their spaces (' ' only; other whitespace stays) and are lower-cased
    distance   = 0 when the target occurs inside the read text, else the Levenshtein distance,
                 capped at len(target) ("many unrelated characters cost no more than a miss")
    reward     = 1 - distance / len(target)        in [0, 1]

Differences from the authors, on purpose: a prompt without a '"' or with an empty quote raises a
ValueError naming it (theirs raises IndexError / ZeroDivisionError); the engine's own failures are not
turned into a reward of 0 here (the judge lets them surface).
"""

from __future__ import annotations

from collections.abc import Iterable


def quoted_text(prompt: str) -> str:
    """The text the image must show: what follows the first '"' up to the next one (or the end)."""
    parts = prompt.split('"')
    if len(parts) < 2:
        raise ValueError(f'OCR reward needs the text to render in double quotes ("..."); prompt has none: {prompt!r}')
    return parts[1]


def joined_text(lines: Iterable[tuple[str, float]]) -> str:
    """An engine's (text, confidence) lines as the authors join them: kept when confidence > 0, no separator."""
    return "".join(text if confidence > 0 else "" for text, confidence in lines)


def normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute; each costs 1), as python-Levenshtein's ``distance``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def ocr_distance(target: str, read: str) -> int:
    """The capped edit distance of the rule above (both texts already normalised)."""
    if target in read:
        return 0
    return min(levenshtein(read, target), len(target))


def ocr_reward(target: str, read: str) -> float:
    """1 - normalised edit distance between the target text and the text read from the image."""
    target, read = normalise(target), normalise(read)
    if not target:
        raise ValueError("OCR reward: the quoted text is empty once spaces are removed; nothing to read")
    return 1.0 - ocr_distance(target, read) / len(target)


def ocr_reward_for_prompt(prompt: str, lines: Iterable[tuple[str, float]]) -> float:
    """The reward of one image: ``prompt`` as written, ``lines`` as the engine read them."""
    return ocr_reward(quoted_text(prompt), joined_text(lines))

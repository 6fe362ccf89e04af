"""``shapes-ocr``: Flow-GRPO's OCR reward on the shapes testbed, offline (a stand-in engine, not OCR).

The reward rule is Flow-GRPO's own (rewards.ocr_rule, the code the ``ocr`` judge runs). What stands in:

    engine   a "reader" that transcribes the testbed image's objects as caption words: the pixel
             analysis (rewards.shapes.detect_objects) groups objects by colour and shape, leftmost group
             first, written as the caption grammar writes groups ("two red circles and a blue square").
             It reads no glyphs; it is an honest stand-in so the reward's plumbing runs end to end.
    target   the text in the prompt's double quotes, as the authors; a testbed caption has none, so its
             canonical text (rewards.shapes_grammar.format_caption) is the target instead.

Relations and sizes are not transcribed, so a spatial or sized caption scores below 1 even when drawn
perfectly; the reward still rises as the right objects, colours and counts appear.
"""

from __future__ import annotations

from rewards.ocr import Lines, OcrJudge
from rewards.ocr_rule import quoted_text
from rewards.shapes import _as_arrays, detect_objects
from rewards.shapes_grammar import COUNT_WORDS, ObjectGroup, format_caption, format_group, parse_caption


def transcribe(pixels) -> str:
    """The objects in an RGB array as caption words, leftmost group first ('' when none)."""
    groups: dict[tuple[str, str], list] = {}
    for obj in detect_objects(pixels):
        groups.setdefault((obj.colour, obj.shape), []).append(obj)
    ordered = sorted(groups.items(), key=lambda item: min(o.box[0] for o in item[1]))
    parts = [format_group(ObjectGroup(shape, min(len(objs), max(COUNT_WORDS)), colour))
             for (colour, shape), objs in ordered]
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def read_scenes(images) -> list[Lines]:
    return [[(text, 1.0)] if (text := transcribe(pixels)) else [] for pixels in _as_arrays(images)]


def caption_target(prompt: str) -> str:
    """The quoted text when there is one, else the testbed caption's canonical text."""
    if '"' in prompt:
        return quoted_text(prompt)
    try:
        return format_caption(parse_caption(prompt))
    except ValueError as err:
        raise ValueError(f"shapes-ocr: the prompt has no quoted text and is not a testbed caption: {err}") from None


def shapes_ocr(tie_margin: float = 0.0) -> OcrJudge:
    """Flow-GRPO's OCR reward with the testbed's transcribing stand-in engine."""
    return OcrJudge(name="shapes-ocr", read=read_scenes, target=caption_target, tie_margin=tie_margin)

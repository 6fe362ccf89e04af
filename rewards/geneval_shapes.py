"""``geneval-shapes``: GenEval's rules on the shapes testbed, offline (a stand-in, not GenEval).

The rules are GenEval's own (rewards.geneval_rules, the same code the ``geneval`` judge runs); what stands
in for the models is exact:

    metadata   derived from the testbed caption (``metadata_from_caption``): each group an include of its
               shape with its count and colour; "A <relation> B" becomes GenEval's form (B first, then A
               with position [relation, 0]); a single counted group also excludes count + 1
    detector   the testbed's pixel analysis (rewards.shapes.detect_objects): every object it finds, with
               confidence 1 and its box, under its shape ("square") and under its colour and shape
               ("red square"), a finer class than COCO's
    colour     the palette colour that analysis assigns (the testbed's six colours, not GenEval's ten)

GenEval's prompts never name one class twice, and its rules check a class's most confident objects for
every include of that class; so when a testbed caption names one shape in two groups told apart by colour
("a red square and a green square"), those includes use the finer class ("red square"), else GenEval's
rule would test the same top square for both colours. Sizes ("small", "large") are not checked: GenEval has no size rule. Tags follow GenEval's tasks: position
(a relation), counting (one group of two or three), colors (one coloured group), single_object,
color_attr (several groups, some coloured), two_object (several groups, none coloured).
"""

from __future__ import annotations

import numpy as np

from rewards.geneval import RULES, GenEvalJudge
from rewards.geneval_rules import Detection
from rewards.shapes import _as_arrays, detect_objects
from rewards.shapes_grammar import COLOURS, Caption, parse_caption


def metadata_from_caption(caption: str | Caption) -> dict:
    """GenEval metadata ({tag, include, exclude?, prompt}) for a testbed caption."""
    parsed = parse_caption(caption)
    groups = list(parsed.groups)

    shapes = [g.shape for g in groups]

    def include(group):
        fine = group.colour is not None and shapes.count(group.shape) > 1
        entry = {"class": f"{group.colour} {group.shape}" if fine else group.shape, "count": group.count}
        if group.colour is not None:
            entry["color"] = group.colour
        return entry

    meta: dict = {"prompt": caption if isinstance(caption, str) else str(caption)}
    if parsed.relation is not None:
        first, second = groups
        meta["tag"] = "position"
        meta["include"] = [include(second), {**include(first), "position": [parsed.relation, 0]}]
    elif len(groups) == 1:
        group = groups[0]
        meta["include"] = [include(group)]
        if group.count > 1:
            meta["tag"] = "counting"
            meta["exclude"] = [{"class": group.shape, "count": group.count + 1}]
        else:
            meta["tag"] = "colors" if group.colour is not None else "single_object"
    else:
        meta["tag"] = "color_attr" if any(g.colour is not None for g in groups) else "two_object"
        meta["include"] = [include(g) for g in groups]
    return meta


def scene_detections(pixels: np.ndarray) -> tuple[dict[str, list[Detection]], dict]:
    """The testbed's objects as GenEval detections (confidence 1), and each one's exact colour."""
    detections: dict[str, list[Detection]] = {}
    colours = {}
    for obj in detect_objects(pixels):
        det = Detection(tuple(float(v) for v in obj.box), 1.0)
        for classname in (obj.shape, f"{obj.colour} {obj.shape}"):
            detections.setdefault(classname, []).append(det)
            colours[(classname, det.box)] = obj.colour
    return detections, colours


class _ExactScene:
    """detect / colours for GenEvalJudge from the pixel analysis (one analysis per image)."""

    def __init__(self):
        self._last: tuple[bytes, tuple] | None = None

    def _analyse(self, image):
        key = image.tobytes() + repr(image.size).encode()
        if self._last is None or self._last[0] != key:
            self._last = (key, scene_detections(_as_arrays([image])[0]))
        return self._last[1]

    def detect(self, image):
        return self._analyse(image)[0]

    def colours(self, image, classname, detections):
        table = self._analyse(image)[1]
        return [table[(classname, d.box)] for d in detections]


def geneval_shapes(rule: str = "geneval", tie_margin: float = 0.0) -> GenEvalJudge:
    """GenEval's rules on the shapes testbed (``rule``: geneval | flow-grpo | flow-grpo-strict)."""
    if rule not in RULES:
        raise ValueError(f"geneval-shapes: unknown rule {rule!r}; valid: {', '.join(RULES)}")
    scene = _ExactScene()
    name = "geneval-shapes" if rule == "geneval" else f"geneval-shapes[rule={rule}]"

    def metadata_for(prompt: str) -> dict:
        try:
            return metadata_from_caption(prompt)
        except ValueError as err:
            raise ValueError(f"geneval-shapes judges testbed captions only: {err}") from None

    return GenEvalJudge(name=name, rule=rule, detect=scene.detect, colours=scene.colours, metadata_for=metadata_for,
                        colour_vocabulary=tuple(COLOURS), tie_margin=tie_margin)

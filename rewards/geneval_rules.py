"""GenEval's rules (Ghosh et al. 2023) as pure functions over detections, and Flow-GRPO's reward variant.

They follow the authors' ``evaluation/evaluate_images.py`` (djghosh13/geneval): which detections are
kept, how relative position is read from two boxes, and when a prompt's metadata holds. Flow-GRPO's
reward (yifan123/reward-server, ``reward_server/gen_eval.py``, ``evaluate_reward``) is kept beside it:
partial credit per clause and a "strict" verdict that wants exact counts.

A detection is a box (x0, y0, x1, y1) in pixels, a confidence and optionally a mask; colours come from a
callable ``colours_of(classname, detections) -> [colour per detection]`` so that the CLIP classifier
(``rewards.geneval``) or the shapes testbed's exact colours (``rewards.geneval_shapes``) can feed the
same rules. Metadata is GenEval's: ``{"tag", "include": [{"class", "count", "color"?, "position"?:
[relation, index of an earlier include]}], "exclude": [{"class", "count"}]}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# The authors' defaults (evaluate_images.py's --options and the reward server's constants).
THRESHOLD = 0.3  # keep a detection whose confidence is above this ...
COUNTING_THRESHOLD = 0.9  # ... or above this for "counting" prompts
MAX_OBJECTS = 16  # most detections kept per class
NMS_THRESHOLD = 1.0  # IoU above which a lower-confidence box of the same class is dropped (1 = never)
POSITION_THRESHOLD = 0.1  # margin, as a fraction of the two boxes' summed sizes, before an offset counts
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


@dataclass(frozen=True)
class Detection:
    box: tuple[float, float, float, float]
    score: float
    mask: Any = None  # bool array [H, W] or None

    def row(self) -> list[float]:
        return [*map(float, self.box), float(self.score)]


Detections = Mapping[str, Sequence[Detection]]
ColoursOf = Callable[[str, Sequence[Detection]], list[str]]


def compute_iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """IoU with the authors' inclusive-pixel convention (width = x1 - x0 + 1)."""
    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0


def select_detections(
    raw: Detections,
    tag: str,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    nms_threshold: float = NMS_THRESHOLD,
) -> dict[str, list[Detection]]:
    """The detections GenEval keeps, per class, most confident first; classes with none are left out.

    Confidences compare in float32, as the authors' comparison of mmdet's float32 scores with a Python float
    does (0.3 is then not above 0.3). Equal confidences keep their input order (numpy's unstable argsort
    leaves that order unspecified).
    """
    cutoff = np.float32(counting_threshold if tag == "counting" else threshold)
    kept = {}
    for classname, found in raw.items():
        order = sorted(found, key=lambda d: -np.float32(d.score))
        order = [d for d in order if np.float32(d.score) > cutoff][:max_objects]
        chosen = []
        while order:
            best = order.pop(0)
            chosen.append(best)
            if nms_threshold != 1:
                order = [d for d in order if compute_iou(best.box, d.box) < nms_threshold]
        if chosen:
            kept[classname] = chosen
    return kept


def relative_position(box_a: Sequence[float], box_b: Sequence[float], margin: float = POSITION_THRESHOLD) -> set[str]:
    """Where A lies relative to B: the centre offset shrunk by ``margin`` x (size A + size B) per axis,
    then a relation for each axis whose share of the (unshrunk) offset's length is above one half."""
    boxes = np.array([list(box_a)[:4], list(box_b)[:4]], dtype=np.float64).reshape(2, 2, 2)
    centre_a, centre_b = boxes.mean(axis=-2)
    size_a, size_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = centre_a - centre_b
    revised = np.maximum(np.abs(offset) - margin * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _colour_summary(colours: list[str], vocabulary: Sequence[str]) -> str:
    order = list(vocabulary) + sorted(set(colours) - set(vocabulary))
    return ", ".join(f"{colours.count(c)} {c}" for c in order if c in colours)


def _position_holds(found, targets, relation, margin, reason, classname) -> bool:
    for obj in found:
        for target in targets:
            true_relations = relative_position(obj.box, target.box, margin)
            if relation not in true_relations:
                found_text = " and ".join(r for r in RELATIONS if r in true_relations)  # the authors join a set (any order)
                reason.append(f"expected {classname} {relation} target, found {found_text} target")
                return False
    return True


def evaluate(
    objects: Detections,
    metadata: Mapping,
    colours_of: ColoursOf,
    margin: float = POSITION_THRESHOLD,
    vocabulary: Sequence[str] = COLORS,
) -> tuple[bool, str]:
    """GenEval's verdict: every include holds (at least ``count`` of the class; colour and position checked
    on the ``count`` most confident ones) and no exclude does (fewer than ``count`` of the class)."""
    correct, reason, matched_groups = True, [], []
    for req in metadata.get("include", []):
        classname, count = req["class"], req["count"]
        matched = True
        found = list(objects.get(classname, []))[:count]
        if len(found) < count:
            correct = matched = False
            reason.append(f"expected {classname}>={count}, found {len(found)}")
        else:
            if "color" in req:
                colours = colours_of(classname, found)
                if colours.count(req["color"]) < count:
                    correct = matched = False
                    reason.append(_colour_reason(req["color"], classname, count, colours, vocabulary))
            if "position" in req and matched:
                relation, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                    reason.append(f"no target for {classname} to be {relation}")
                elif not _position_holds(found, matched_groups[target_group], relation, margin, reason, classname):
                    correct = matched = False
        matched_groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        classname = req["class"]
        if len(objects.get(classname, [])) >= req["count"]:
            correct = False
            reason.append(f"expected {classname}<{req['count']}, found {len(objects[classname])}")
    return correct, "\n".join(reason)


def _colour_reason(colour: str, classname: str, count: int, colours: list[str], vocabulary: Sequence[str]) -> str:
    """The reason line of a failed colour check, worded as GenEval's (Flow-GRPO's server copies it)."""
    return (f"expected {colour} {classname}>={count}, found {colours.count(colour)} {colour}; and "
            + _colour_summary(colours, vocabulary))


def evaluate_reward(
    objects: Detections,
    metadata: Mapping,
    colours_of: ColoursOf,
    margin: float = POSITION_THRESHOLD,
    vocabulary: Sequence[str] = COLORS,
) -> tuple[bool, float, str]:
    """Flow-GRPO's GenEval reward: (strict verdict, partial credit in [0, 1], reason).

    Per include: a count term 1 - |count - found| / count (may go below 0 when far too many are found),
    then, when the count is exact, a colour term of the same form and a position term; a wrong count
    scores 0 for colour/position together. The reward is the mean of the terms. Kept as the authors wrote
    it: a failed position adds a 0 and then a 1 (their final append runs after the loop either way), and
    excludes are not checked (the exact count already rules out extra objects of the class).
    """
    correct, reason, rewards, matched_groups = True, [], [], []
    for req in metadata.get("include", []):
        classname, count = req["class"], req["count"]
        matched = True
        found = list(objects.get(classname, []))
        rewards.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            correct = matched = False
            reason.append(f"expected {classname}=={count}, found {len(found)}")
            if "color" in req or "position" in req:
                rewards.append(0.0)
        else:
            if "color" in req:
                colours = colours_of(classname, found)
                rewards.append(1 - abs(count - colours.count(req["color"])) / count)
                if colours.count(req["color"]) != count:
                    correct = matched = False
                    reason.append(_colour_reason(req["color"], classname, count, colours, vocabulary))
            if "position" in req and matched:
                relation, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                    reason.append(f"no target for {classname} to be {relation}")
                    rewards.append(0.0)
                else:
                    if not _position_holds(found, matched_groups[target_group], relation, margin, reason, classname):
                        correct = matched = False
                        rewards.append(0.0)
                    rewards.append(1.0)
        matched_groups.append(found if matched else None)
    reward = sum(rewards) / len(rewards) if rewards else 0
    return correct, float(reward), "\n".join(reason)


def task_table(tags: Sequence[str], correct: Sequence[bool]) -> dict:
    """GenEval's summary (summary_scores.py): accuracy per task in first-seen order, and the overall
    score as the mean of the task accuracies (not of the images)."""
    table: dict[str, dict] = {}
    for tag, ok in zip(tags, correct):
        row = table.setdefault(tag, {"correct": 0, "images": 0})
        row["correct"] += int(bool(ok))
        row["images"] += 1
    for row in table.values():
        row["accuracy"] = row["correct"] / row["images"]
    overall = float(np.mean([row["accuracy"] for row in table.values()])) if table else float("nan")
    return {"tasks": table, "overall": overall}

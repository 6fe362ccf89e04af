"""GenEval's rules against the authors' code: tests/data/geneval_rules_reference.json holds the verdicts of
djghosh13/geneval's evaluate_images.py and Flow-GRPO's reward server on recorded detections
(experiments/rules_reference.py ran their code, with the detector and CLIP replaced by the recorded outputs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rewards.geneval_rules import (
    Detection,
    compute_iou,
    evaluate,
    evaluate_reward,
    relative_position,
    select_detections,
    task_table,
)

REFERENCE = json.loads((Path(__file__).parent / "data" / "geneval_rules_reference.json").read_text())


def _relations_unordered(reason: str) -> str:
    """The authors write a set of relations in the set's (hash-seeded) order: compare them as sets."""
    return re.sub(r"found ([a-z ]+?) target", lambda m: "found " + " and ".join(sorted(m.group(1).split(" and "))) + " target",
                  reason)


def _case_inputs(case):
    raw, colours = {}, {}
    for classname, items in case["detections"].items():
        raw[classname] = [Detection(tuple(d["box"]), d["score"]) for d in items]
        for d, det in zip(items, raw[classname]):
            colours[(classname, det.box, det.score)] = d["colour"]

    def colours_of(classname, found):
        return [colours[(classname, d.box, d.score)] for d in found]

    return raw, colours_of


@pytest.mark.parametrize("index", range(len(REFERENCE["cases"])))
def test_rules_match_the_authors_on_recorded_detections(index):
    case = REFERENCE["cases"][index]
    raw, colours_of = _case_inputs(case)
    kept = select_detections(raw, case["metadata"]["tag"], nms_threshold=case["nms_threshold"])
    assert {k: [d.row() for d in v] for k, v in kept.items()} == case["kept"]
    correct, reason = evaluate(kept, case["metadata"], colours_of)
    assert (correct, _relations_unordered(reason)) == (case["correct"], _relations_unordered(case["reason"]))
    strict, score, reason = evaluate_reward(kept, case["metadata"], colours_of)
    assert (strict, _relations_unordered(reason)) == (case["strict_correct"], _relations_unordered(case["reward_reason"]))
    assert score == pytest.approx(case["score"], abs=1e-12)


def test_reference_covers_every_task_and_verdict():
    tags = {c["metadata"]["tag"] for c in REFERENCE["cases"]}
    assert tags == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    assert {c["correct"] for c in REFERENCE["cases"]} == {True, False}
    assert {c["strict_correct"] for c in REFERENCE["cases"]} == {True, False}
    assert any(c["score"] < 0 for c in REFERENCE["cases"])  # the count term goes negative for far too many


def test_relative_position_matches_the_authors_around_the_margin():
    for case in REFERENCE["positions"]:
        assert sorted(relative_position(case["box_a"], case["box_b"])) == case["relations"], case


def test_position_margin_by_hand():
    b = (200, 200, 300, 300)
    # centres 120 px apart horizontally, margin 0.1 * (100 + 100) = 20 px: clearly left
    assert relative_position((80, 200, 180, 300), b) == {"left of"}
    # 19 px apart: inside the margin, no relation at all
    assert relative_position((181, 200, 281, 300), b) == set()
    # diagonal at 45 degrees: each axis holds 0.707 of the offset before the margin shrinks it
    assert relative_position((0, 0, 100, 100), b) == {"left of", "above"}


def test_iou_uses_inclusive_pixels():
    assert compute_iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0
    assert compute_iou((0, 0, 9, 9), (10, 10, 19, 19)) == 0.0
    assert compute_iou((0, 0, 9, 9), (5, 0, 14, 9)) == pytest.approx(50 / 150)


def test_thresholds_are_strict_and_counting_uses_its_own():
    raw = {"dog": [Detection((0, 0, 10, 10), 0.3), Detection((20, 0, 30, 10), 0.5), Detection((40, 0, 50, 10), 0.95)]}
    assert [d.score for d in select_detections(raw, "single_object")["dog"]] == [0.95, 0.5]
    assert [d.score for d in select_detections(raw, "counting")["dog"]] == [0.95]
    assert select_detections({"cat": [Detection((0, 0, 1, 1), 0.1)]}, "two_object") == {}


def test_flow_grpo_reward_keeps_the_authors_position_quirk():
    """A failed position adds a 0 and then a 1: two objects, wrong side -> (1 + 1 + 0 + 1) / 4."""
    metadata = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                               {"class": "dog", "count": 1, "position": ["left of", 0]}]}
    objects = {"cat": [Detection((0, 0, 10, 10), 0.9)], "dog": [Detection((100, 0, 110, 10), 0.9)]}
    strict, score, _ = evaluate_reward(objects, metadata, lambda c, d: [])
    assert not strict and score == pytest.approx(0.75)
    assert evaluate(objects, metadata, lambda c, d: [])[0] is False


def test_task_table_averages_tasks_not_images():
    table = task_table(["counting", "counting", "counting", "colors"], [True, True, False, False])
    assert list(table["tasks"]) == ["counting", "colors"]
    assert table["tasks"]["counting"] == {"correct": 2, "images": 3, "accuracy": pytest.approx(2 / 3)}
    assert table["overall"] == pytest.approx((2 / 3 + 0) / 2)

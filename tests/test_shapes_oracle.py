"""The shapes-oracle judge: agreement with the renderer, partial credit, degraded variants."""

from collections import defaultdict

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

import rewards
from align.testbed.scene import render, render_mismatched, sample_captions
from rewards.images import to_tensor
from rewards.shapes import ShapesOracle, detect_objects
from rewards.shapes_grammar import CATEGORIES, parse_caption


@pytest.fixture(scope="module")
def world():
    """500 random captions, their renders and one near-miss render each (32 px)."""
    captions = sample_captions(500, seed=123)
    truth = [render(c, seed) for seed, c in enumerate(captions)]
    wrong = [render_mismatched(c, seed) for seed, c in enumerate(captions)]
    return captions, truth, wrong


def test_oracle_scores_every_ground_truth_render_1(world):
    captions, truth, _ = world
    scores, details = ShapesOracle().score_with_details(captions, truth)
    failures = [(c, d["facts"]) for c, s, d in zip(captions, scores.tolist(), details) if s != 1.0]
    assert not failures, failures[:3]
    # detected objects match what the caption asks for
    for caption, detail in zip(captions, details):
        assert len(detail["objects"]) == parse_caption(caption).num_objects


def test_oracle_scores_mismatched_renders_clearly_lower_per_category(world):
    captions, _, wrong = world
    scores, _ = ShapesOracle().score_with_details(captions, [w[0] for w in wrong])
    assert scores.max() < 1.0  # every corruption breaks at least one fact
    by_category = defaultdict(list)
    for caption, score in zip(captions, scores.tolist()):
        by_category[parse_caption(caption).category].append(score)
    assert set(by_category) == set(CATEGORIES)
    for category, values in by_category.items():
        assert np.mean(values) < 0.75, (category, np.mean(values))


def test_oracle_scores_renders_of_other_captions_lower(world):
    captions, truth, _ = world
    shifted = truth[1:] + truth[:1]  # each caption against the image of the next caption
    scores, _ = ShapesOracle().score_with_details(captions, shifted)
    assert scores.mean() < 0.5


def test_oracle_agrees_at_64_px_and_on_tensors():
    captions = sample_captions(100, seed=9)
    images = [render(c, seed, size=64) for seed, c in enumerate(captions)]
    oracle = ShapesOracle()
    assert torch.all(oracle.score(captions, images) == 1.0)
    assert torch.equal(oracle.score(captions, to_tensor(images)), oracle.score(captions, images))


def test_oracle_tolerates_blur(world):
    captions, truth, _ = world
    blurred = [img.filter(ImageFilter.GaussianBlur(0.6)) for img in truth[:200]]
    assert ShapesOracle().score(captions[:200], blurred).mean() > 0.95


def test_partial_credit_for_right_colours_and_wrong_count():
    oracle = ShapesOracle()
    one = render("a red circle", seed=0)
    scores, details = oracle.score_with_details(["two red circles"], [one])
    # there is a circle, nothing else, there is a red circle hold; the count does not
    assert scores.item() == pytest.approx(0.75)
    assert details[0]["by_category"] == {
        "object": {"checked": 2, "held": 2},
        "attribute": {"checked": 1, "held": 1},
        "count": {"checked": 1, "held": 0},
    }
    blank = Image.new("RGB", (32, 32))
    assert oracle.score(["a red circle"], [blank]).item() < 0.5
    swapped = render("a red circle right of a blue square", seed=1)
    facts = oracle.score_with_details(["a red circle left of a blue square"], [swapped])[1][0]["facts"]
    assert [f["category"] for f in facts if not f["holds"]] == ["spatial"]


def test_detector_reports_shapes_colours_sizes_and_positions():
    image = render("a small red circle left of a large blue triangle", seed=2, size=64)
    objects = sorted(detect_objects(np.asarray(image)), key=lambda o: o.box[0])
    assert [(o.shape, o.colour, o.size) for o in objects] == [
        ("circle", "red", "small"),
        ("triangle", "blue", "large"),
    ]


def test_bad_prompts_fail_before_any_analysis():
    with pytest.raises(ValueError, match="prompt 1.*a photo of a cat"):
        ShapesOracle().score(["a circle", "a photo of a cat"], [render("a circle", 0)] * 2)
    with pytest.raises(ValueError, match="one prompt per image"):
        ShapesOracle().score(["a circle"], [render("a circle", 0)] * 2)
    with pytest.raises(ValueError, match=r"noise must be a number in \[0, 1\]"):
        ShapesOracle(noise=1.5)


def test_registry_builds_the_oracle_with_options():
    judge = rewards.load("shapes-oracle")
    assert isinstance(judge, ShapesOracle) and judge.exact and judge.name == "shapes-oracle"
    noisy = rewards.load("shapes-oracle[noise=0.2,seed=3]")
    assert noisy.noise == 0.2 and noisy.seed == 3 and noisy.name == "shapes-oracle[noise=0.2]"


# ---------------------------------------------------------------- pairwise and degraded judges


@pytest.fixture(scope="module")
def pairs(world):
    """250 pairs whose exact verdict is A (ground truth first, near miss second)."""
    captions, truth, wrong = world
    return captions[:250], truth[:250], [w[0] for w in wrong[:250]]


def test_exact_compare_prefers_ground_truth_in_both_orders(pairs):
    captions, good, bad = pairs
    oracle = ShapesOracle()
    forward = oracle.compare(captions, good, bad)
    backward = oracle.compare(captions, bad, good)
    assert all(p.winner == 0 and not p.raw["flipped"] for p in forward)
    assert all(p.winner == 1 and not p.raw["position_bias_applied"] for p in backward)
    assert forward[0].raw["score_a"] == 1.0 and "count" in forward[0].raw["by_category_a"]
    tie = oracle.compare(captions[:1], good[:1], good[:1])[0]
    assert tie.tie and tie.winner is None


def test_noise_flips_the_stated_fraction_of_verdicts(pairs):
    captions, good, bad = pairs
    verdicts = ShapesOracle(noise=0.3, seed=0).compare(captions, good, bad)
    flipped = [p.raw["flipped"] for p in verdicts]
    assert [p.winner == 1 for p in verdicts] == flipped  # raw says exactly which were flipped
    assert 0.2 < np.mean(flipped) < 0.4  # 250 draws: mean 0.3, sd 0.029
    again = ShapesOracle(noise=0.3, seed=0).compare(captions, good, bad)
    assert [p.winner for p in again] == [p.winner for p in verdicts]  # reproducible for a seed
    scores = ShapesOracle(noise=0.1, seed=0).score(captions, good)
    assert 0.08 < float((scores - 1.0).std()) < 0.12


def test_position_bias_prefers_the_first_image(pairs):
    captions, good, bad = pairs
    always = ShapesOracle(position_bias=1.0).compare(captions, bad, good)
    assert all(p.winner == 0 and p.raw["position_bias_applied"] for p in always)
    half = ShapesOracle(position_bias=0.5, seed=1).compare(captions, bad, good)
    first = np.mean([p.winner == 0 for p in half])
    assert 0.4 < first < 0.6  # 250 draws: sd 0.032
    assert all((p.winner == 0) == p.raw["position_bias_applied"] for p in half)

"""The geneval judge's adapters: mmdetection's Mask2Former post-processing, a tiny transformers Mask2Former
saved and loaded back, CLIP's colour classifier on a tiny CLIP, and the testbed stand-in geneval-shapes."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from script_loader import load_experiment
from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig
from transformers.models.mask2former.image_processing_pil_mask2former import Mask2FormerImageProcessorPil

import rewards
from align.testbed.scene import render
from align.testing.tiny_judges import save_tiny_clip
from rewards.geneval import (
    ClipColours,
    GenEvalJudge,
    Mask2FormerDetector,
    bundled_metadata,
    colour_crop,
    instance_detections,
    load_clip_colours,
    mask_boxes,
    object_names,
    upsample_masks,
)
from rewards.geneval_rules import Detection
from rewards.geneval_shapes import metadata_from_caption
from rewards.weights import MissingWeightsError


def test_bundled_metadata_and_class_names():
    table = bundled_metadata()
    assert len(table) == 553
    assert {m["tag"] for m in table.values()} == {"single_object", "two_object", "counting", "colors", "position",
                                                  "color_attr"}
    names = object_names()
    assert len(names) == 80 and names[0] == "person"
    assert {r["class"] for m in table.values() for r in m["include"]} <= set(names)


def test_instance_postprocessing_as_mmdetection():
    """Two queries over three classes: scores are class probability x mean sigmoid inside the mask."""
    class_logits = torch.tensor([[4.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 1.0]])
    masks = torch.full((2, 6, 8), -5.0)
    masks[0, 1:3, 2:5] = 2.0
    masks[1, 4:6, 0:2] = 1.0
    found = instance_detections(class_logits, masks, ["cat", "dog", "cow"], max_per_image=2)
    probs = torch.softmax(class_logits, -1)
    assert set(found) == {"cat", "dog"}
    cat, dog = found["cat"][0], found["dog"][0]
    assert cat.box == (2.0, 1.0, 5.0, 3.0) and dog.box == (0.0, 4.0, 2.0, 6.0)
    assert cat.score == pytest.approx(float(probs[0, 0] * torch.sigmoid(torch.tensor(2.0))), rel=1e-5)
    assert dog.score == pytest.approx(float(probs[1, 1] * torch.sigmoid(torch.tensor(1.0))), rel=1e-5)
    assert cat.mask.shape == (6, 8) and cat.mask.sum() == 6
    # all 6 (query, class) pairs kept when max_per_image allows: one detection list per class
    assert sum(len(v) for v in instance_detections(class_logits, masks, ["cat", "dog", "cow"]).values()) == 6


def test_mask_boxes_and_upsampling_geometry():
    masks = torch.zeros((2, 5, 5), dtype=torch.bool)
    masks[0, 1:4, 2] = True
    assert mask_boxes(masks).tolist() == [[2.0, 1.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]
    # a block in the valid (unpadded) part of a 4x4 decoder grid lands in the same place of the image
    logits = torch.full((1, 4, 4), -5.0)
    logits[0, 0:2, 0:2] = 5.0  # top-left quarter of the padded 32x32 input
    up = upsample_masks(logits, padded=(32, 32), valid=(16, 32), original=(16, 32))
    box = mask_boxes(up > 0)[0].tolist()
    assert box[0] == 0 and box[1] == 0 and 14 <= box[2] <= 18 and 14 <= box[3] <= 16


def _tiny_mask2former(folder):
    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=2, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, feature_size=32, mask_feature_size=32, hidden_dim=32,
                               encoder_feedforward_dim=32, dim_feedforward=32, encoder_layers=1, decoder_layers=2,
                               num_attention_heads=2, num_queries=6, num_labels=80, use_pretrained_backbone=False)
    torch.manual_seed(0)
    Mask2FormerForUniversalSegmentation(config).eval().save_pretrained(folder)
    Mask2FormerImageProcessorPil(size={"shortest_edge": 64, "longest_edge": 96}).save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("geneval")
    _tiny_mask2former(root / "detector")
    save_tiny_clip(root / "clip")
    return root


def test_tiny_mask2former_loads_and_detects(tiny_models):
    detector = Mask2FormerDetector.load(tiny_models / "detector", device="cpu")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8))
    found = detector.detect(image)
    assert set(found) <= set(object_names())
    dets = [d for v in found.values() for d in v]
    assert len(dets) == min(100, 6 * 80)  # mmdetection's top 100 (query, class) pairs
    for d in dets:
        assert 0 <= d.score <= 1 and d.mask.shape == (40, 50)
        assert 0 <= d.box[0] <= d.box[2] <= 50 and 0 <= d.box[1] <= d.box[3] <= 40


def test_colour_classifier_is_the_mean_of_normalised_templates(tiny_models):
    colours = load_clip_colours(tiny_models / "clip", device="cpu")
    weights = colours.classifier("cat")
    assert weights.shape[0] == 10 and torch.allclose(weights.norm(dim=-1), torch.ones(10), atol=1e-5)
    texts = ["a photo of a red cat", "a photo of a red-colored cat", "a photo of a red object"]
    by_hand = torch.nn.functional.normalize(colours.embedder.text_embeddings(texts).mean(0), dim=0)
    assert torch.allclose(weights[0], by_hand, atol=1e-6)
    image = Image.new("RGB", (20, 10), (200, 30, 30))
    assert all(c in colours.colours for c in colours(image, "cat", [Detection((0, 0, 10, 10), 0.9)]))
    assert isinstance(colours, ClipColours)


def test_colour_crop_paints_outside_the_mask_grey():
    image = Image.new("RGB", (6, 4), (255, 0, 0))
    mask = np.zeros((4, 6), dtype=bool)
    mask[1:3, 1:3] = True
    crop = colour_crop(image, Detection((0, 0, 4, 4), 0.9, mask))
    assert crop.size == (4, 4)
    assert crop.getpixel((0, 0)) == (0x99, 0x99, 0x99) and crop.getpixel((1, 1)) == (255, 0, 0)


def test_geneval_judge_loads_by_name_and_checks_prompts_first(tiny_models):
    judge = rewards.load("geneval", detector=str(tiny_models / "detector"), clip_model=str(tiny_models / "clip"),
                         device="cpu")
    prompts = ["a photo of a bench", "a photo of two clocks"]
    images = [Image.new("RGB", (48, 40), "white"), Image.new("RGB", (40, 48), "black")]
    scores, details = judge.score_with_details(prompts, images)
    assert set(scores.tolist()) <= {0.0, 1.0} and [d["tag"] for d in details] == ["single_object", "counting"]
    with pytest.raises(ValueError, match="no GenEval metadata"):
        judge.score(["a photo of a unicorn"], images[:1])
    table = judge.breakdown(prompts, [1.0, 0.0])
    assert table["tasks"]["single_object"]["accuracy"] == 1.0 and table["overall"] == 0.5
    with pytest.raises(ValueError, match="unknown rule"):
        rewards.load("geneval[rule=best]")


# ---------------------------------------------------------------------------------------- testbed stand-in


@pytest.mark.parametrize("caption, expected", [
    ("a circle", {"tag": "single_object", "include": [{"class": "circle", "count": 1}]}),
    ("two red squares", {"tag": "counting", "include": [{"class": "square", "count": 2, "color": "red"}],
                         "exclude": [{"class": "square", "count": 3}]}),
    ("a blue triangle", {"tag": "colors", "include": [{"class": "triangle", "count": 1, "color": "blue"}]}),
    ("a circle and a square", {"tag": "two_object", "include": [{"class": "circle", "count": 1},
                                                                {"class": "square", "count": 1}]}),
    ("a red circle left of a blue square", {"tag": "position", "include": [
        {"class": "square", "count": 1, "color": "blue"},
        {"class": "circle", "count": 1, "color": "red", "position": ["left of", 0]}]}),
    ("a red square and a green square", {"tag": "color_attr", "include": [
        {"class": "red square", "count": 1, "color": "red"}, {"class": "green square", "count": 1, "color": "green"}]}),
])
def test_testbed_captions_become_geneval_metadata(caption, expected):
    meta = metadata_from_caption(caption)
    assert {k: v for k, v in meta.items() if k != "prompt"} == expected


def test_geneval_shapes_scores_renders_by_the_rules():
    judge = rewards.load("geneval-shapes")
    captions = ["two red squares", "a red circle left of a blue square", "a green triangle"]
    images = [render(c, seed=3) for c in captions]
    assert judge.score(captions, images).tolist() == [1.0, 1.0, 1.0]
    swapped = judge.score(captions, images[::-1]).tolist()
    assert swapped[0] == 0.0 and swapped[2] == 0.0
    reward = rewards.load("geneval-shapes[rule=flow-grpo]")
    # one red square where two are asked: count term 1 - 1/2, colour term 0 -> 0.25
    assert reward.score(["two red squares"], [render("a red square", seed=0)]).tolist() == [pytest.approx(0.25)]
    assert isinstance(judge, GenEvalJudge)


def test_missing_weights_name_the_option_to_pass(tmp_path, tiny_models):
    with pytest.raises(MissingWeightsError, match="Pass detector="):
        rewards.load("geneval", detector=str(tmp_path / "none"), clip_model=str(tiny_models / "clip"))
    with pytest.raises(MissingWeightsError, match="Pass clip_model="):
        rewards.load("geneval", detector=str(tiny_models / "detector"), clip_model=str(tmp_path / "none"))


def test_agreement_script_compares_with_the_authors_results(tmp_path, tiny_models, monkeypatch):


    script = load_experiment("geneval_agreement")
    rows = []
    for i, (prompt, correct) in enumerate([("a photo of a bench", True), ("a photo of two clocks", False)]):
        Image.new("RGB", (40, 32), "gray").save(tmp_path / f"{i}.png")
        meta = bundled_metadata()[prompt]
        rows.append({"filename": f"{i}.png", "tag": meta["tag"], "prompt": prompt, "correct": correct,
                     "reason": "", "metadata": json.dumps(meta)})
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "agreement.json"
    monkeypatch.setattr(sys, "argv", ["geneval_agreement", str(tmp_path / "results.jsonl"), "--image-root",
                                      str(tmp_path), "--detector", str(tiny_models / "detector"), "--clip-model",
                                      str(tiny_models / "clip"), "--device", "cpu", "--out", str(out)])
    script.main()
    table = json.loads(out.read_text())["table"]
    assert table["all"]["images"] == 2 and table["all"]["authors_accuracy"] == 0.5
    assert set(table) == {"single_object", "counting", "all"}
    by_hand = script.agreement_table([{"tag": "a", "authors": True, "ours": False}, {"tag": "a", "authors": True, "ours": True}])
    assert by_hand["a"]["agreement"] == 0.5 and by_hand["all"]["ours_accuracy"] == 0.5


def test_colour_classification_matches_the_authors_code_on_a_tiny_clip(tmp_path):
    """tests/data/geneval_colour_reference.json: GenEval's color_classification (its crops, clip_benchmark's
    classifier and classification, float32) on save_tiny_clip(seed=0), run by experiments/rules_reference.py."""
    reference = json.loads((Path(__file__).parent / "data" / "geneval_colour_reference.json").read_text())
    save_tiny_clip(tmp_path / "clip", seed=0)
    colours = load_clip_colours(tmp_path / "clip", device="cpu")
    for case in reference["cases"]:
        image = Image.open(io.BytesIO(base64.b64decode(case["image_png"]))).convert("RGB")
        found = []
        for obj in case["objects"]:
            mask = None
            if obj["mask"] is not None:
                h, w = obj["shape"]
                mask = np.unpackbits(np.array(obj["mask"], dtype=np.uint8))[: h * w].reshape(h, w).astype(bool)
            found.append(Detection(tuple(obj["box"]), 0.9, mask))
        crops = [colour_crop(image, d) for d in found]
        logits = 100.0 * colours.embedder.image_embeddings(crops) @ colours.classifier(case["classname"]).T
        expected = torch.tensor(case["logits"])
        spread = float(expected.max() - expected.min())
        assert (logits - expected).abs().max() <= 1e-5 * spread, (logits, expected)  # 1e-5 of the score spread
        margins = expected.sort(dim=1).values[:, -1] - expected.sort(dim=1).values[:, -2]
        predicted = colours(image, case["classname"], found)
        assert [p for p, m in zip(predicted, margins) if m > 1e-3] == [c for c, m in zip(case["colours"], margins) if m > 1e-3]

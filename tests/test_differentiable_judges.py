"""The judges' differentiable scoring path (rewards/differentiable.py): the tensor preprocessing follows each judge's
evaluation path (the authors' PIL one) up to 8-bit rounding, the scores agree with ``score`` and carry gradients to the
pixels (not to the judge's weights), and a judge without such a path is refused in one line."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

import rewards
from align.testing.tiny_judges import bert_tokenizer, images_as_tensor, random_images, save_tiny_clip
from rewards.checkpoint_keys import ScoreMLP
from rewards.clip import AestheticPredictor, ClipSimilarity
from rewards.differentiable import (
    centre_crop,
    check_differentiable,
    letterbox,
    processor_pixels,
    resize_and_crop,
    resize_bicubic,
)
from rewards.imagereward import CLIP_MEAN, CLIP_STD, BlipRewardJudge, center_crop_pixels
from rewards.preprocess import hps_pixels, openai_clip_pixels
from tests.test_judge_imagereward import TINY_MED, tiny_image_reward_model, to_image_reward_layout

# 8-bit input images make the two paths' inputs identical; what may still differ is PIL rounding the resized image to 8
# bits (and its fixed-point filter): at most a couple of levels of 255, in units of CLIP's std (about 0.27)
ROUNDING = 2.5 / 255 / min(CLIP_STD)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-clip-224")
    save_tiny_clip(folder, seed=1, image_size=32)
    return folder


def smooth_images(n: int, width: int, height: int, seed: int) -> list[Image.Image]:
    """8-bit images without the pixel-level noise whose bicubic overshoot PIL clips to [0, 255] (the tensor path keeps
    it: the difference docs/judges_scoring.md measures)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    images = []
    for _ in range(n):
        f = rng.uniform(1, 4, size=(3, 2))
        channels = [127 + 100 * np.sin(f[c, 0] * 3 * x + f[c, 1] * 2 * y) for c in range(3)]
        images.append(Image.fromarray(np.stack(channels, -1).round().astype(np.uint8)))
    return images


def test_bicubic_resize_is_pils_filter():
    image = np.random.default_rng(0).uniform(0, 1, (32, 40)).astype(np.float32)
    pil = np.asarray(Image.fromarray(image, mode="F").resize((30, 24), Image.BICUBIC))
    ours = resize_bicubic(torch.from_numpy(image)[None, None], 24, 30)[0, 0].numpy()
    assert np.abs(ours - pil).max() < 1e-5


@pytest.mark.parametrize("size", [(40, 32), (300, 200), (32, 48)])
def test_tensor_preprocessing_follows_each_judges_pil_path(size, clip_folder):
    images = smooth_images(3, *size, seed=5)
    tensor = images_as_tensor(images)
    # HPS: the authors' transform already works on the float tensor: the same numbers
    torch.testing.assert_close(letterbox(tensor, 24, CLIP_MEAN, CLIP_STD), hps_pixels(images, 24, CLIP_MEAN, CLIP_STD))
    # OpenAI CLIP's (aesthetic) and ImageReward's resize + rounded centre crop; the CLIP processors' floored crop
    processor = AutoProcessor.from_pretrained(clip_folder, backend="pil")
    pairs = [(resize_and_crop(tensor, 24, (24, 24), CLIP_MEAN, CLIP_STD, rounded=True),
              openai_clip_pixels(images, 24, CLIP_MEAN, CLIP_STD)),
             (resize_and_crop(tensor, 24, (24, 24), CLIP_MEAN, CLIP_STD, rounded=True), center_crop_pixels(images, 24)),
             (processor_pixels(processor.image_processor)(tensor),
              processor(images=images, return_tensors="pt")["pixel_values"])]
    for ours, theirs in pairs:
        assert ours.shape == theirs.shape
        assert float((ours - theirs).abs().max()) < ROUNDING


def test_centre_crop_offsets_round_as_torchvision_or_floor_as_transformers():
    images = torch.arange(7.0).reshape(1, 1, 1, 7).expand(1, 3, 1, 7)
    assert centre_crop(images, 1, 4, rounded=True)[0, 0, 0].tolist() == [2, 3, 4, 5]  # round(1.5) = 2
    assert centre_crop(images, 1, 4, rounded=False)[0, 0, 0].tolist() == [1, 2, 3, 4]  # 3 // 2 = 1


def _judges(clip_folder, tmp_path):
    head = tmp_path / "head.pth"
    torch.manual_seed(0)
    torch.save(OrderedDict((k, v.clone()) for k, v in ScoreMLP(16).state_dict().items()), head)
    release = tmp_path / "ImageReward"
    bert_tokenizer(release)
    torch.save(to_image_reward_layout(tiny_image_reward_model().state_dict(), TINY_MED["max_position_embeddings"]),
               release / "ImageReward.pt")
    (release / "med_config.json").write_text(json.dumps(TINY_MED))
    return {"clip": rewards.load("clip", model=str(clip_folder), device="cpu"),
            "pickscore": rewards.load("pickscore", model=str(clip_folder), processor=str(clip_folder), device="cpu"),
            "aesthetic": rewards.load("aesthetic", model=str(head), clip_model=str(clip_folder), device="cpu"),
            "imagereward": rewards.load("imagereward", model=str(release), device="cpu"),
            "shapes-clip": rewards.load("shapes-clip")}


def test_differentiable_scores_agree_with_the_evaluation_path_and_reach_the_pixels(clip_folder, tmp_path):
    images = images_as_tensor(random_images(3, size=(32, 32), seed=7))  # 8-bit values at the judges' 32 px: no resize
    prompts = ["a red circle", "a blue square", "a photo of a cat"]
    for name, judge in _judges(clip_folder, tmp_path).items():
        pixels = images.clone().requires_grad_(True)
        scores = judge.score_differentiable(prompts, pixels)
        torch.testing.assert_close(scores.detach(), judge.score(prompts, images).float(), rtol=1e-4, atol=1e-4)
        scores.sum().backward()
        assert pixels.grad is not None and bool(torch.isfinite(pixels.grad).all()) and pixels.grad.abs().sum() > 0, name
        model = getattr(getattr(judge, "embedder", None), "model", None) or judge.model
        assert all(p.grad is None and not p.requires_grad for p in model.parameters()), name  # the judge never trains


def test_differentiable_path_refuses_what_it_cannot_score(clip_folder):
    judge = rewards.load("clip", model=str(clip_folder), device="cpu")
    for images, message in [(torch.rand(2, 32, 32, 3), "shape"), (torch.rand(2, 3, 8, 8) * 2, r"in \[0, 1\]"),
                            ([None], "float image tensor")]:
        with pytest.raises((TypeError, ValueError), match=message):
            judge.score_differentiable(["x", "y"], images)


@pytest.mark.parametrize("spec", ["shapes-oracle", "gpt4o", "hps:0.5,shapes-oracle:0.5", "geneval-shapes",
                                  "qwen2.5-vl-7b"])
def test_judges_without_a_differentiable_path_are_refused_in_one_line(spec):
    with pytest.raises(rewards.NotDifferentiableError) as err:
        check_differentiable(spec)
    assert "\n" not in str(err.value) and "no differentiable scoring path" in str(err.value)


def test_every_judge_with_a_differentiable_path_is_registered_and_has_the_method():
    for name in rewards.DIFFERENTIABLE_JUDGES:
        rewards.check_name(name)
    check_differentiable("hps:0.7,pickscore:0.3")  # a mix of differentiable judges is one
    assert all(callable(getattr(cls, "score_differentiable", None))
               for cls in (ClipSimilarity, AestheticPredictor, BlipRewardJudge))

"""Judges refuse inputs they would otherwise score wrongly (rewards.base wraps every score/compare).

Before: the oracle clamped diffusers' [-1, 1] images into [0, 1] and scored a perfect image 0.25;
a uint8 batch, NaN pixels or a bare string prompt gave plausible numbers. Now each is a TypeError or
ValueError naming the problem, and rewards.images.to_unit_range converts the other conventions.
"""

from __future__ import annotations

import pytest
import torch

import rewards
from align.testbed.scene import render
from align.testing.fake_judge_servers import FakeJudgeServer
from align.testing.tiny_judges import save_tiny_clip
from rewards.images import check_images, to_tensor, to_unit_range

CAPTION = "a red circle"


@pytest.fixture(scope="module")
def oracle_images():
    return to_tensor([render(CAPTION, seed) for seed in range(2)])  # [2, 3, H, W] in [0, 1]


@pytest.fixture(scope="module")
def clip_judge(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    save_tiny_clip(folder)
    return rewards.load("clip", model=str(folder), device="cpu")


def bad_inputs(good: torch.Tensor):
    """(images, prompts, error type, words the message must hold) for each way of getting it wrong."""
    n = good.shape[0]
    nan = good.clone()
    nan[0, 0, 0, 0] = float("nan")
    return [
        (good * 2 - 1, [CAPTION] * n, ValueError, "minus_one_one"),  # diffusers' [-1, 1]
        (good * 255, [CAPTION] * n, ValueError, "zero_255"),  # [0, 255] floats
        ((good * 255).round().to(torch.uint8), [CAPTION] * n, TypeError, "source='uint8'"),
        (nan, [CAPTION] * n, ValueError, "NaN"),
        (good.clone().fill_(float("inf")), [CAPTION] * n, ValueError, "infinite"),
        (good.permute(0, 2, 3, 1), [CAPTION] * n, ValueError, "channels last"),
        (good[0], [CAPTION], ValueError, "[N, 3, H, W]"),
        (good, CAPTION, TypeError, "not a single string"),
        (good, [CAPTION] * (n + 1), ValueError, f"{n + 1} prompts for {n} images"),
        (good, [CAPTION, None][:n], TypeError, "must be strings"),
        (good.numpy(), [CAPTION] * n, TypeError, "ndarray"),
        ([good[0]], [CAPTION], TypeError, "PIL images"),
    ]


def test_the_oracle_refuses_every_bad_input_and_scores_the_converted_one(oracle_images):
    oracle = rewards.load("shapes-oracle")
    assert oracle.score([CAPTION] * 2, oracle_images).tolist() == [1.0, 1.0]
    for images, prompts, error, words in bad_inputs(oracle_images):
        with pytest.raises(error, match=None) as caught:
            oracle.score(prompts, images)
        assert words in str(caught.value), (words, str(caught.value))
    # The documented conversions give back the right score.
    assert oracle.score([CAPTION] * 2, to_unit_range(oracle_images * 2 - 1, source="minus_one_one")).tolist() == [1.0, 1.0]
    as_uint8 = (oracle_images * 255).round().to(torch.uint8)
    assert oracle.score([CAPTION] * 2, to_unit_range(as_uint8, source="uint8")).tolist() == [1.0, 1.0]


def test_compare_checks_both_sides_and_their_pairing(oracle_images):
    oracle = rewards.load("shapes-oracle")
    with pytest.raises(ValueError, match="images_b.*minus_one_one"):
        oracle.compare([CAPTION] * 2, oracle_images, oracle_images * 2 - 1)
    with pytest.raises(ValueError, match="must pair up, got 2 and 1"):
        oracle.compare([CAPTION] * 2, oracle_images, oracle_images[:1])
    with pytest.raises(TypeError, match="not a single string"):
        oracle.compare(CAPTION, oracle_images[:1], oracle_images[:1])


def test_a_learned_judge_refuses_bad_inputs(clip_judge, oracle_images):
    images = torch.nn.functional.interpolate(oracle_images, size=32)
    assert clip_judge.score([CAPTION] * 2, images).shape == (2,)
    for bad, prompts, error, words in bad_inputs(images):
        with pytest.raises(error) as caught:
            clip_judge.score(prompts, bad)
        assert words in str(caught.value)
    with pytest.raises(ValueError, match="minus_one_one"):
        clip_judge.compare([CAPTION] * 2, images * 2 - 1, images)


def test_an_api_judge_refuses_bad_inputs_before_any_request(monkeypatch, oracle_images):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-TEST-judge-inputs-0000")
    with FakeJudgeServer("openai", api_key="sk-TEST-judge-inputs-0000") as server:
        judge = rewards.load("openai:fake-model", base_url=server.base_url, timeout=5)
        for images, prompts, error, words in bad_inputs(oracle_images):
            with pytest.raises(error) as caught:
                judge.compare(prompts, images, oracle_images)
            assert words in str(caught.value)
        assert server.calls == []  # nothing was paid for
        assert len(judge.compare([CAPTION] * 2, oracle_images, oracle_images * 0.5)) == 2  # the good input is asked
        assert len(server.calls) > 0
        judge.close()


def test_float_rounding_at_the_edges_is_tolerated_and_exact_edges_pass():
    images = torch.zeros(1, 3, 4, 4)
    images[0, 0, 0, 0], images[0, 1, 0, 0] = -5e-4, 1 + 5e-4  # a VAE decode's rounding
    assert check_images(images) == 1
    images[0, 0, 0, 0] = -0.01
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        check_images(images)


def test_to_unit_range_refuses_unknown_sources():
    with pytest.raises(ValueError, match="minus_one_one, uint8, zero_255"):
        to_unit_range(torch.zeros(1, 3, 2, 2), source="0-1")

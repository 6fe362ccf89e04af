"""HPSv3 on transformers' Qwen2-VL classes: a tiny base and a checkpoint in the authors' layout built here, scored
against mu and sigma pinned from the authors' ``hpsv3`` package (experiments/hpsv3_reference.py ->
tests/data/hpsv3_reference.json)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import rewards
from align.eval import best_of_n as bon
from align.testbed.models import build_pipeline
from align.testbed.tokenizer import testbed_tokenizer
from align.testing.tiny_hpsv3 import authors_checkpoint_shapes, build_hpsv3, hpsv3_images
from rewards.checkpoint_keys import CheckpointLayoutError
from rewards.hpsv3 import PIXELS, smart_resize

REFERENCE = json.loads((Path(__file__).parent / "data" / "hpsv3_reference.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_hpsv3(tmp_path_factory.mktemp("hpsv3"))


def _close(got, want, spread):
    assert max(abs(g - w) for g, w in zip(got, want)) <= 1e-5 * spread, (got, want)


def test_checkpoint_layout_is_the_authors(tiny):
    base, _ = tiny
    assert {k: list(v) for k, v in authors_checkpoint_shapes(base).items()} == REFERENCE["checkpoint_shapes"]


def test_mu_and_sigma_match_the_authors_code(tiny):
    base, checkpoint = tiny
    judge = rewards.load("hpsv3", model=str(checkpoint), base=str(base), batch_size=3)  # one batch, as the reference ran
    mu, sigma = judge.score_with_uncertainty(REFERENCE["prompts"], hpsv3_images())
    # within 1e-5 of the score's (mu's) spread, for mu and for sigma, the head's second output on the same scale;
    # sigma's own spread on this tiny model is 16x smaller than mu's and nearer float32 noise (~2e-7 here between
    # transformers 4.45 and 5, both on CPU)
    spread = max(REFERENCE["mu"]) - min(REFERENCE["mu"])
    _close(mu.tolist(), REFERENCE["mu"], spread)
    _close(sigma.tolist(), REFERENCE["sigma"], spread)
    assert torch.equal(judge.score(REFERENCE["prompts"], hpsv3_images()), mu) and torch.equal(judge.last_sigma, sigma)


def test_smart_resize_keeps_the_authors_area():
    assert smart_resize(448, 448) == (448, 448)
    for h, w in [(260, 300), (380, 520), (64, 64), (1024, 768)]:
        rh, rw = smart_resize(h, w)
        assert rh % 28 == 0 and rw % 28 == 0 and abs(rh * rw - PIXELS) / PIXELS < 0.15


def test_a_checkpoint_of_another_layout_fails_with_one_message(tiny, tmp_path):
    base, checkpoint = tiny
    state = load_file(str(checkpoint))
    state.pop("rm_head.5.bias")
    state["rm_head.9.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointLayoutError, match=r"rm_head does not fit .*missing \['5.bias'\]; unexpected \['9.weight'\]"):
        rewards.load("hpsv3", model=str(tmp_path / "bad.safetensors"), base=str(base))
    renamed = {("language_model." + k if k.startswith("model.") else k): v for k, v in load_file(str(checkpoint)).items()}
    save_file(renamed, str(tmp_path / "renamed.safetensors"))
    with pytest.raises((CheckpointLayoutError, ValueError), match="vocabulary|does not fit"):
        rewards.load("hpsv3", model=str(tmp_path / "renamed.safetensors"), base=str(base))


def test_best_of_n_runs_with_the_tiny_hpsv3_judge(tiny, tmp_path):
    base, checkpoint = tiny
    torch.manual_seed(1)
    build_pipeline(testbed_tokenizer()).save_pretrained(tmp_path / "pipe")
    name = f"hpsv3[model={checkpoint},base={base}]"
    bon.main(["--model", str(tmp_path / "pipe"), "--reward", name, "--prompts", "testbed", "--num_prompts", "2",
              "--n", "2", "--num_inference_steps", "2", "--device", "cpu", "--output_dir", str(tmp_path / "bon")])
    saved = json.loads((tmp_path / "bon" / "results.json").read_text())
    scores = next(iter(saved["scores"].values()))
    assert len(scores) == 2 and len(set(s for row in scores for s in row)) > 1

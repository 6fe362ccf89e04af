"""VQAScore judges: P("Yes") from a tiny local Qwen2.5-VL (built here, saved and loaded back) and from a fake
OpenAI-compatible server's token logprobs, against values pinned from the authors' t2v_metrics code
(experiments/vqascore_reference.py -> tests/data/vqascore_reference.json)."""

import json
import math
from pathlib import Path

import pytest
import torch

import rewards
from align.api_cost import JudgeCalls, estimate, is_paid
from align.eval import best_of_n as bon
from align.testbed.models import build_pipeline
from align.testbed.tokenizer import testbed_tokenizer
from align.testing import tiny_vlms
from align.testing.fake_judge_servers import FakeJudgeServer
from align.testing.tiny_vlms import build_vqascore_qwen, vqascore_images
from rewards.mllm import JudgeNotReadyError
from rewards.vqascore_rules import QUESTION_TEMPLATE, probability_from_raw, top_logprobs_probability

FAST = dict(timeout=5, backoff_base=0.01, backoff_max=0.5)
REFERENCE = json.loads((Path(__file__).parent / "data" / "vqascore_reference.json").read_text())


def _close(got, want):
    spread = max(want) - min(want)
    assert max(abs(g - w) for g, w in zip(got, want)) <= 1e-5 * spread


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vqascore-qwen")
    build_vqascore_qwen(folder)
    return folder


def test_local_scores_match_the_authors_code(tiny_qwen, tmp_path):
    captions = REFERENCE["captions"]
    judge = rewards.load(f"vqascore-hf:{tiny_qwen}", cache_path=str(tmp_path / "cache.sqlite"))
    scores = judge.score(captions, vqascore_images(len(captions)))
    _close(scores.tolist(), REFERENCE["local_scores"])
    raw = json.loads(judge.last_answers[0].raw)
    assert len(raw["top"]) == 5 and probability_from_raw(judge.last_answers[0].raw) == pytest.approx(scores[0].item())
    judge.close()
    again = rewards.load(f"vqascore-hf:{tiny_qwen}", cache_path=str(tmp_path / "cache.sqlite"))
    assert torch.equal(again.score(captions, vqascore_images(len(captions))), scores)
    assert again.stats.cache_hits == len(captions)


def test_batched_scoring_pads_without_changing_scores(tiny_qwen):
    captions = REFERENCE["captions"]
    batched = rewards.load(f"vqascore-hf:{tiny_qwen}", batch_size=4).score(captions, vqascore_images(len(captions)))
    assert torch.allclose(batched.double(), torch.tensor(REFERENCE["local_scores"]).double(), rtol=1e-4)


def test_question_is_the_authors_template(tiny_qwen):
    judge = rewards.load(f"vqascore-hf:{tiny_qwen}")
    request = judge._request("a red cube", vqascore_images(1))
    assert request.prompt == 'Does this figure show "a red cube"? Please answer Yes or No.'
    with pytest.raises(ValueError, match="mode='single'"):
        rewards.load(f"vqascore-hf:{tiny_qwen}", mode="pair")


def test_server_rule_matches_the_authors_code_on_recorded_answers():
    got = [top_logprobs_probability([(t, lp) for t, lp in top]) for top in REFERENCE["recorded_top_logprobs"]]
    _close(got, REFERENCE["api_scores"])


def _logprobs(prompt, images):
    bright = sum(images[0].convert("L").getdata()) / (255.0 * images[0].width * images[0].height)
    p_yes = min(max(bright, 0.01), 0.99)
    return [("Yes", math.log(p_yes)), ("No", math.log(1 - p_yes))]


def test_server_scores_from_token_logprobs(tmp_path):
    images = torch.stack([torch.full((3, 16, 16), v) for v in (0.2, 0.5, 0.8)])
    with FakeJudgeServer("openai", answer=lambda prompt, images: "Yes", logprobs=_logprobs) as server:
        spec = f"vqascore-openai:fake-model[base_url={server.base_url}]"
        judge = rewards.load(spec, cache_path=str(tmp_path / "cache.sqlite"), **FAST)
        judge.check_ready()  # asks one question about a grey square: are there logprobs to score with?
        assert [call["prompt"] for call in server.calls] == [QUESTION_TEMPLATE.format(caption="a grey square")]
        server.calls.clear()
        scores = judge.score(["a", "b", "c"], images)
        judge.close()
        body = server.calls[0]["body"]
        assert body["logprobs"] is True and body["top_logprobs"] == 2 and body["max_tokens"] == 1
        assert "temperature" not in body  # as t2v_metrics asks
        assert [part["type"] for part in body["messages"][0]["content"]] == ["text", "image_url"]
        assert sorted(call["prompt"] for call in server.calls) == [QUESTION_TEMPLATE.format(caption=c) for c in "abc"]
        again = rewards.load(spec, cache_path=str(tmp_path / "cache.sqlite"), **FAST)
        assert torch.equal(again.score(["a", "b", "c"], images), scores) and len(server.calls) == 3
        prefs = again.compare(["c"], images[2:], images[:1])  # pointwise: the score difference
    assert scores.tolist() == pytest.approx([0.2, 0.5, 0.8], abs=0.01)
    assert prefs[0].winner == 0


def test_server_without_logprobs_fails_with_one_line():
    with FakeJudgeServer("openai", answer=lambda prompt, images: "Yes") as server:
        judge = rewards.load(f"vqascore-openai:fake-model[base_url={server.base_url}]", timeout=5)
        with pytest.raises(JudgeNotReadyError, match="returned no token logprobs") as err:
            judge.score(["a", "b"], torch.rand(2, 3, 16, 16))
    assert "\n" not in str(err.value) and len(server.calls) >= 1


def test_cost_guard_prices_the_api_and_counts_a_local_server_free(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    paid = rewards.load("vqascore-openai:gpt-4o")
    free = rewards.load("vqascore-openai:my-vlm[base_url=http://127.0.0.1:9/v1]")
    assert is_paid(paid) and is_paid(free)
    calls, usd, _ = estimate(JudgeCalls(paid, "x", scores=100))
    assert calls == 100 and usd > 0
    assert estimate(JudgeCalls(free, "x", scores=100))[1] == 0.0
    assert not is_paid(rewards.load("shapes-oracle"))


def test_best_of_n_runs_with_the_tiny_vqascore_judge(tiny_qwen, tmp_path):
    torch.manual_seed(1)
    build_pipeline(testbed_tokenizer()).save_pretrained(tmp_path / "pipe")
    bon.main(["--model", str(tmp_path / "pipe"), "--reward", f"vqascore-hf:{tiny_qwen}", "--prompts", "testbed",
              "--num_prompts", "2", "--n", "2", "--num_inference_steps", "2", "--device", "cpu",
              "--output_dir", str(tmp_path / "bon")])
    saved = json.loads((tmp_path / "bon" / "results.json").read_text())
    scores = saved["scores"][f"vqascore-hf:{tiny_qwen}"]
    assert len(scores) == 2 and all(0.0 < s < 1.0 for row in scores for s in row)


@pytest.mark.parametrize("builder", ["build_llava_next", "build_internvl"])
def test_other_families_score_the_full_vocabulary_softmax(builder, tmp_path):
    getattr(tiny_vlms, builder)(tmp_path, words=("Yes", "No"))
    judge = rewards.load(f"vqascore-hf:{tmp_path}")
    images, captions = vqascore_images(2), ["a red cube", "a cat"]
    scores = judge.score(captions, images)
    # the same probability from a plain forward pass: softmax over the whole vocabulary at the last position
    yes = judge._processor.tokenizer.convert_tokens_to_ids("Yes")
    for caption, image, score in zip(captions, images, scores):
        text = judge._chat_text(judge._request(caption, [image]))
        inputs = judge._processor(images=[image], text=[text], return_tensors="pt")
        with torch.no_grad():
            logits = judge._model(**inputs).logits[0, -1]
        assert score.item() == pytest.approx(torch.softmax(logits.double(), -1)[yes].item(), rel=1e-5)


def test_the_checkpoints_logits_processors_apply_as_in_t2v_metrics(tiny_qwen):
    # t2v_metrics reads generate's processed scores: a generation_config repetition_penalty changes P("Yes")
    captions, images = ["Yes Yes", "a cat"], vqascore_images(2)
    judge = rewards.load(f"vqascore-hf:{tiny_qwen}")
    plain = judge.score(captions, images)
    judge._model.generation_config.repetition_penalty = 1.5
    penalised = judge.score(captions, images)
    yes = judge._processor.tokenizer.convert_tokens_to_ids("Yes")
    text = judge._chat_text(judge._request(captions[0], [images[0]]))
    inputs = judge._processor(images=[images[0]], text=[text], return_tensors="pt")
    with torch.no_grad():
        logits = judge._model(**inputs).logits[0, -1].double()
    seen = torch.unique(inputs["input_ids"][0])
    logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.5, logits[seen] * 1.5)
    assert penalised[0].item() == pytest.approx(torch.softmax(logits, -1)[yes].item(), rel=1e-5)
    assert penalised[0].item() != pytest.approx(plain[0].item(), rel=1e-3)

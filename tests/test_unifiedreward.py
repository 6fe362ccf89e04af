"""UnifiedReward judges: the authors' parsing on recorded answers (pinned from their code by
experiments/unifiedreward_reference.py), a tiny Qwen2.5-VL stand-in saved and loaded back, and the pairwise
protocol (both orders, ties, abstentions) against a fake OpenAI-compatible server."""

import csv
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import rewards
from align.eval import best_of_n as bon
from align.judgebench import benchmark as judgebench
from align.testbed.models import build_pipeline
from align.testbed.tokenizer import testbed_tokenizer
from align.testing.fake_judge_servers import FakeJudgeServer, brightness
from align.testing.tiny_vlms import build_qwen25_vl, record_generate
from rewards.unifiedreward_rules import PAIR_TEMPLATE, POINT_TEMPLATE, pair_verdict, point_score

REFERENCE = json.loads((Path(__file__).parent / "data" / "unifiedreward_reference.json").read_text())
FAST = dict(timeout=5, backoff_base=0.01, backoff_max=0.5)


def test_point_parsing_matches_the_authors_code():
    for answer, theirs in zip(REFERENCE["point_answers"], REFERENCE["point_scores"]):
        ours = point_score(answer)
        has_digits = any(ch.isdigit() for ch in answer.split("Final Score:")[-1])
        # same number wherever they read one; their 0 for "no digits" is an abstention here
        assert ours == theirs if has_digits else (ours is None and theirs == 0)


def test_pair_parsing_matches_the_authors_code():
    for answer, matches in zip(REFERENCE["pair_answers"], REFERENCE["pair_matches"]):
        verdict = pair_verdict(answer)
        if sum(matches) == 1:
            assert verdict == {0: 1, 1: 2, 2: 0}[matches.index(True)]
        else:
            assert verdict is None
    assert pair_verdict("Image 1 is better. No wait, Image 2 is better.") is None


def test_templates_are_the_authors_text():
    assert POINT_TEMPLATE.endswith("after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{caption}]")
    assert '"Both images are equally good."' in PAIR_TEMPLATE and "{caption}" in PAIR_TEMPLATE


@pytest.fixture(scope="module")
def tiny_unifiedreward(tmp_path_factory):
    folder = tmp_path_factory.mktemp("unifiedreward")
    build_qwen25_vl(folder, constant_answer=True)  # greedy answer "7": "Final Score" parsing reads 7
    return folder


def test_local_pointwise_shows_the_image_then_the_question(tiny_unifiedreward, tmp_path):
    judge = rewards.load(f"unifiedreward-hf:{tiny_unifiedreward}", max_tokens=2, cache_path=str(tmp_path / "c.sqlite"))
    seen = record_generate(judge)
    scores = judge.score(["a red cube", "a cat"], torch.rand(2, 3, 56, 56))
    assert scores.tolist() == [7.0, 7.0]
    pad = judge._processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(seen) == 2 and (seen[0]["input_ids"] == pad).sum() == 4  # one image per question
    text = judge._chat_text(judge._request("a red cube", [_img()]))
    assert text.index("<|image_pad|>") < text.index("You are given")  # image first, then the authors' question
    assert text.count("<|image_pad|>") == 1 and "Text Caption: [a red cube]" in text


def _img():
    return Image.new("RGB", (56, 56))


def test_local_pairwise_asks_both_orders_with_two_images(tiny_unifiedreward):
    judge = rewards.load(f"unifiedreward-hf:{tiny_unifiedreward}", mode="pair", max_tokens=2, batch_size=4)
    seen = record_generate(judge)
    prefs = judge.compare(["a cat"], torch.rand(1, 3, 56, 56), torch.rand(1, 3, 56, 56))
    pad = judge._processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert seen[0]["input_ids"].shape[0] == 2 and ((seen[0]["input_ids"] == pad).sum(dim=1) == 8).all()
    assert prefs[0].abstained and [o["order"] for o in prefs[0].raw["orders"]] == ["AB", "BA"]  # "7": no verdict
    with pytest.raises(ValueError, match="mode="):
        rewards.load(f"unifiedreward-hf:{tiny_unifiedreward}", mode="likert")


def _brighter_is_better(prompt, images):
    a, b = (brightness(img) for img in images)
    return "Both images are equally good." if abs(a - b) < 0.01 else f"Image {1 if a > b else 2} is better."


def test_server_pairwise_reconciles_orders_ties_and_abstentions(tmp_path):
    dark, light = torch.full((2, 3, 16, 16), 0.2), torch.full((2, 3, 16, 16), 0.8)
    with FakeJudgeServer("openai", answer=_brighter_is_better) as server:
        judge = rewards.load(f"unifiedreward-openai:fake-model[base_url={server.base_url},mode=pair]", **FAST)
        prefs = judge.compare(["a", "b"], torch.stack([light[0], dark[0]]), torch.stack([dark[1], dark[1]]))
        assert [p.winner for p in prefs] == [0, None] and prefs[1].tie and not prefs[1].abstained
        content = server.calls[0]["body"]["messages"][0]["content"]
        assert [c["type"] for c in content] == ["image_url", "image_url", "text"]
        assert content[2]["text"] in {PAIR_TEMPLATE.format(caption=c) for c in "ab"}
        assert len(server.calls) == 3  # both orders of two pairs; the identical pair asks its one question once
        server.answer = lambda prompt, images: "Image 1 is better."  # position bias: the orders disagree
        biased = judge.compare(["c"], light[:1], dark[:1])[0]
        assert biased.tie and biased.raw["consistent"] is False
        server.inject("garbage", "garbage")
        lost = judge.compare(["d"], light[:1], dark[:1])[0]
        assert lost.abstained
        point = rewards.load(f"unifiedreward-openai:fake-model[base_url={server.base_url}]", **FAST)
        server.answer = lambda prompt, images: "cat (object): 1\nFinal Score: 4"
        assert point.score(["a"], light[:1]).tolist() == [4.0]
        assert server.calls[-1]["body"]["messages"][0]["content"][-1]["text"] == POINT_TEMPLATE.format(caption="a")


def test_best_of_n_runs_with_the_tiny_unifiedreward_judge(tiny_unifiedreward, tmp_path):
    torch.manual_seed(1)
    build_pipeline(testbed_tokenizer()).save_pretrained(tmp_path / "pipe")
    name = f"unifiedreward-hf:{tiny_unifiedreward}[max_tokens=2]"
    bon.main(["--model", str(tmp_path / "pipe"), "--reward", name, "--prompts", "testbed", "--num_prompts", "2",
              "--n", "2", "--num_inference_steps", "2", "--device", "cpu", "--output_dir", str(tmp_path / "bon")])
    saved = json.loads((tmp_path / "bon" / "results.json").read_text())
    assert next(iter(saved["scores"].values())) == [[7.0, 7.0], [7.0, 7.0]]


def test_judgebench_runs_the_pairwise_server_judge_on_the_testbed(tmp_path):


    with FakeJudgeServer("openai", answer=_brighter_is_better) as server:
        name = f"unifiedreward-openai:fake-model[base_url={server.base_url},mode=pair,timeout=5]"
        judgebench.main(["--judges", name, "--data", "testbed", "--output_dir", str(tmp_path / "jb"),
                         "--testbed_pairs", "2", "--testbed_bias_groups", "1", "--batch_size", "8"])
        assert server.calls and all(len(call["images"]) == 2 for call in server.calls)
    row = next(csv.DictReader((tmp_path / "jb" / "leaderboard.csv").open()))
    assert row["judge"] == name and float(row["order_consistency"]) > 0.0


def test_options_that_would_change_the_authors_question_are_refused(tiny_unifiedreward):
    with pytest.raises(ValueError, match="does not apply"):
        rewards.load(f"unifiedreward-hf:{tiny_unifiedreward}", protocol="mjbench")
    with pytest.raises(ValueError, match="does not apply"):
        rewards.load(f"unifiedreward-hf:{tiny_unifiedreward}", prompt_template="x.txt")

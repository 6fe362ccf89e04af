"""A judge's answer that is not a valid score stops the run in one line naming the judge (issue 61 finding 4):
NaN/inf logprobs from a VQAScore server, a server that sends no logprobs (found by the readiness check, before any
image is made), a rating outside the judge's scale, an inf score from any judge. Refusals and answers without a
rating stay abstentions; the judge benchmark, which measures judges, counts an off-scale rating as unparseable."""

from __future__ import annotations

import json
import math

import pytest
import torch

import rewards
from align.errors import ConfigError
from align.eval import best_of_n as bon
from align.judges import load_judge
from align.testbed.models import build_pipeline
from align.testbed.tokenizer import testbed_tokenizer
from align.testing.fake_judge_servers import FakeJudgeServer
from rewards.base import Judge, JudgeAnswerError
from rewards.mllm import JudgeNotReadyError

FAST = dict(timeout=5, backoff_base=0.01, backoff_max=0.5)
PROBE = "a grey square"  # what ApiVqaScore.check_ready asks about


def nan_logprobs(prompt, images):
    return [("Yes", float("nan")), ("No", float("inf"))]


def nan_after_the_probe(prompt, images):
    """A server whose logprobs are fine for the readiness question and NaN afterwards (it breaks mid-run)."""
    return [("Yes", math.log(0.5)), ("No", math.log(0.5))] if PROBE in prompt else nan_logprobs(prompt, images)


@pytest.mark.parametrize("logprobs, says", [(nan_logprobs, "the logprob of token 'Yes' is nan"),
                                            (None, "returned no token logprobs")])
def test_a_vqascore_server_without_valid_logprobs_is_refused_before_any_image(logprobs, says):
    with FakeJudgeServer("openai", answer=lambda prompt, images: "Yes", logprobs=logprobs) as server:
        spec = f"vqascore-openai:fake-model[base_url={server.base_url},timeout=5]"
        with pytest.raises(JudgeNotReadyError, match=says):
            rewards.load(spec).check_ready()
        with pytest.raises(ConfigError, match=f"vqascore-openai:fake-model.*{says}"):  # what every command calls
            load_judge(spec)


def test_nan_logprobs_mid_run_stop_scoring_naming_the_judge(tmp_path):
    images = torch.rand(2, 3, 16, 16)
    with FakeJudgeServer("openai", answer=lambda prompt, images: "Yes", logprobs=nan_after_the_probe) as server:
        judge = rewards.load(f"vqascore-openai:fake-model[base_url={server.base_url}]",
                             cache_path=str(tmp_path / "answers.sqlite"), **FAST)
        judge.check_ready()
        with pytest.raises(JudgeAnswerError, match=r"judge 'vqascore-openai:fake-model'.* 2 answer\(s\) that are not a "
                                                   r"valid score.*answers.sqlite") as err:
            judge.score(["a", "b"], images)
        assert "\n" not in str(err.value)


def test_best_of_n_with_a_judge_that_breaks_mid_run_ends_in_one_line(tmp_path, capsys):
    """The finding: nan scores and "gain +nan", exit 0; and a JudgeNotReadyError traceback for a server without
    logprobs. Now: one line, exit 3 (the server broke after its readiness check) or 2 (before: nothing generated)."""
    torch.manual_seed(1)
    build_pipeline(testbed_tokenizer()).save_pretrained(tmp_path / "pipe")
    argv = ["--model", str(tmp_path / "pipe"), "--prompts", "testbed", "--num_prompts", "2", "--n", "2",
            "--num_inference_steps", "2", "--device", "cpu"]
    for name, logprobs, code in (("later", nan_after_the_probe, 3), ("none", None, 2)):
        with FakeJudgeServer("openai", answer=lambda prompt, images: "Yes", logprobs=logprobs) as server:
            out = tmp_path / name
            capsys.readouterr()
            with pytest.raises(SystemExit) as exit_:
                bon.main([*argv, "--reward", f"vqascore-openai:fake-model[base_url={server.base_url},timeout=5]",
                          "--output_dir", str(out)])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert exit_.value.code == code and len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert "vqascore-openai:fake-model" in lines[0]
        assert not (out / "results.json").exists()
        if code == 2:
            assert not (out / "candidates").exists()  # refused before any image was generated


def test_a_rating_outside_the_scale_stops_the_run_but_is_counted_by_a_benchmark(tmp_path):
    def off_scale(prompt, images):
        return json.dumps({"analysis": "great", "rating": 42})

    def refusing(prompt, images):
        return "I'm sorry, I can't help with that."

    images = torch.rand(1, 3, 16, 16)
    with FakeJudgeServer("openai", answer=off_scale) as server:
        judge = rewards.load("openai:fake-model", base_url=server.base_url, mode="single", structured="none", **FAST)
        with pytest.raises(JudgeAnswerError, match="rating 42.0 outside the scale 1-10"):
            judge.score(["x"], images)
        judge.stop_on_invalid_answers = False  # what align.judgebench sets: MJ-Bench counts it as unparseable
        assert math.isnan(float(judge.score(["x"], images)[0]))
    with FakeJudgeServer("openai", answer=refusing) as server:
        judge = rewards.load("openai:fake-model", base_url=server.base_url, mode="single", structured="none", **FAST)
        assert math.isnan(float(judge.score(["x"], images)[0]))  # a refusal is an abstention, as before


class InfJudge(Judge):
    def score(self, prompts, images):
        return torch.tensor([1.0, math.inf, math.nan])[: len(prompts)]


def test_a_judge_that_never_abstains_may_not_return_nan_or_inf():
    judge = InfJudge(name="broken")
    assert judge.score(["a"], torch.rand(1, 3, 8, 8)).tolist() == [1.0]
    with pytest.raises(JudgeAnswerError, match="judge 'broken' returned 1 score"):
        judge.score(["a", "b"], torch.rand(2, 3, 8, 8))
    with pytest.raises(JudgeAnswerError, match="judge 'broken' returned 2 score"):
        judge.compare(["a", "b", "c"], torch.rand(3, 3, 8, 8), torch.rand(3, 3, 8, 8))

"""API judges against fake OpenAI / Anthropic / Gemini servers on 127.0.0.1, driven by the real SDKs."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from script_loader import load_script

import rewards
from align.testing.fake_judge_servers import FakeJudgeServer, position_biased_judge
from rewards.cache import JudgeCache, image_hash
from rewards.images import to_pil
from rewards.judge_prompts import CRITERIA
from rewards.mllm import JudgeNotReadyError

KEY_VARS = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY", "gemini": "GEMINI_API_KEY"}
PREFIX = {"openai": "openai", "anthropic": "anthropic", "gemini": "google"}
SECRET = "sk-TEST-do-not-leak-7c1e5b"
KINDS = ("openai", "anthropic", "gemini")
FAST = dict(timeout=5, backoff_base=0.01, backoff_max=0.5)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY"):
        monkeypatch.delenv(var, raising=False)


def serve(kind, monkeypatch, **kwargs):
    monkeypatch.setenv(KEY_VARS[kind], SECRET)
    return FakeJudgeServer(kind, api_key=SECRET, **kwargs)


def load(kind, server, **options):
    return rewards.load(f"{PREFIX[kind]}:fake-model", base_url=server.base_url, **{**FAST, **options})


def pairs(n, seed=0):
    """n pairs where A is always brighter than B, with random texture (distinct images)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(n, 3, 12, 12, generator=g) * 0.2
    levels = torch.linspace(0.0, 0.3, n).view(n, 1, 1, 1)
    return 0.6 + levels + noise * 0.5, 0.1 + levels * 0.5 + noise * 0.5


def pixels(img):
    return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize("kind", KINDS)
def test_requests_carry_model_prompt_images_and_temperature(kind, monkeypatch):
    a, b = pairs(2)
    with serve(kind, monkeypatch) as server:
        judge = load(kind, server, perspective="artifacts")
        judge.check_ready()
        prefs = judge.compare(["a red cube", "two cats"], a, b)
    assert server.model_checks == ["fake-model"]
    assert [p.winner for p in prefs] == [0, 0]
    assert all(p.raw["consistent"] for p in prefs)
    assert len(server.calls) == 4  # both orders of both pairs
    pa, pb = to_pil(a), to_pil(b)
    by_prompt = {}
    for call in server.calls:
        assert call["model"] == "fake-model"
        assert call["temperature"] == 0.0
        assert CRITERIA["artifacts"] in call["prompt"]
        assert len(call["images"]) == 2
        by_prompt.setdefault("a red cube" if "a red cube" in call["prompt"] else "two cats", []).append(call)
    for i, caption in enumerate(["a red cube", "two cats"]):
        shown = sorted(([pixels(im) for im in c["images"]] for c in by_prompt[caption]), key=lambda x: -x[0].mean())
        # the brighter image (A) first in one request, second in the other: the images sent are exact
        assert np.array_equal(shown[0][0], pixels(pa[i])) and np.array_equal(shown[0][1], pixels(pb[i]))
        assert np.array_equal(shown[1][0], pixels(pb[i])) and np.array_equal(shown[1][1], pixels(pa[i]))
    body = server.calls[0]["body"]
    if kind == "openai":
        assert body["response_format"]["type"] == "json_schema"
        assert body["response_format"]["json_schema"]["schema"]["required"][-1] == "better_image"
    elif kind == "anthropic":
        assert body["tool_choice"] == {"type": "tool", "name": body["tools"][0]["name"]}
        assert "better_image" in body["tools"][0]["input_schema"]["properties"]
    else:
        config = body["generationConfig"]
        assert config["responseMimeType"] == "application/json"
        assert "better_image" in config["responseJsonSchema"]["properties"]


@pytest.mark.parametrize("kind", KINDS)
def test_pointwise_modes(kind, monkeypatch):
    a, b = pairs(3)
    images = torch.cat([a, b])
    with serve(kind, monkeypatch) as server:
        single = load(kind, server, mode="single", scale="0-100", temperature=0.3)
        scores = single.score(["x"] * 6, images)
        likert = load(kind, server, mode="likert", likert_levels=10)
        levels = likert.score(["x"] * 6, images)
        with pytest.raises(ValueError, match="pair"):
            load(kind, server).score(["x"], images[:1])
    assert scores.shape == (6,) and torch.all((scores >= 0) & (scores <= 100))
    assert torch.all(scores[:3] > scores[3:])  # brighter scores higher
    assert torch.all((levels >= 1) & (levels <= 10)) and torch.all(levels[:3] >= levels[3:])
    assert {c["temperature"] for c in server.calls[:6]} == {0.3}
    assert [a.parsed.status for a in likert.last_answers] == ["ok"] * 6
    assert json.loads(likert.last_answers[0].raw)["rating"]  # raw answers are kept


def test_position_bias_is_caught_by_order_swapping(monkeypatch):
    a, b = pairs(4)
    with serve("openai", monkeypatch, answer=position_biased_judge) as server:
        swapped = load("openai", server).compare(["x"] * 4, a, b)
        averaged = load("openai", server, inconsistent="average").compare(["x"] * 4, a, b)
        one_order = load("openai", server, swap_orders=False).compare(["x"] * 4, a, b)
    assert all(p.tie and not p.abstained and p.raw["consistent"] is False for p in swapped)
    assert all(p.prob_a == 0.5 and p.tie for p in averaged)
    assert all(p.winner == 0 for p in one_order)  # what the reference code would have recorded
    assert len(server.calls) == 8 + 8 + 4  # both orders twice, then one order


@pytest.mark.parametrize("kind", KINDS)
def test_faults_every_label_obtained_or_abstained(kind, monkeypatch):
    a, b = pairs(4)
    with serve(kind, monkeypatch, timeout_sleep=3.0) as server:
        # concurrency 1: request k is the k-th call, so each fault hits a known request. The client's timeout leaves an
        # ordinary request a second on a loaded machine (at 0.4 s, beside five CPU-bound jobs, the count was once 11)
        judge = load(kind, server, concurrency=1, max_retries=4, timeout=1.0)
        server.inject("429", "500", "timeout", "malformed", None, "refusal", None, "garbage")
        prefs = judge.compare(["x"] * 4, a, b)
    faults = [c["fault"] for c in server.calls]
    assert faults[:4] == ["429", "500", "timeout", "malformed"]
    # first request: 4 failures then success; the other 7 requests once each
    assert len(server.calls) == 4 + 8
    assert judge.stats.retries == 4 and judge.stats.failures == 0
    # Retry-After honoured: the retry after the 429 came at least 0.2 s later
    assert server.calls[1]["time"] - server.calls[0]["time"] >= 0.2
    statuses = [ans.parsed.status for ans in judge.last_answers]
    assert statuses.count("refusal") == 1 and statuses.count("unparseable") == 1
    assert statuses.count("ok") == 6
    assert len(prefs) == 4  # nothing lost
    abstained = [p for p in prefs if p.abstained]
    assert len(abstained) == 2  # the pairs with the refusal and the garbage answer
    assert all(p.winner == 0 for p in prefs if not p.abstained)
    assert all(not p.tie for p in abstained)  # never silently a tie


def test_exhausted_retries_abstain_and_are_not_cached(monkeypatch, tmp_path):
    a, b = pairs(2)
    cache = tmp_path / "cache.sqlite"
    with serve("openai", monkeypatch) as server:
        judge = load("openai", server, concurrency=1, max_retries=2, mode="single", cache_path=str(cache))
        server.inject("500", "500", "500")
        scores = judge.score(["x", "y"], a)
        assert torch.isnan(scores[0]) and not torch.isnan(scores[1])
        assert judge.last_answers[0].parsed.status == "failed"
        assert judge.stats.failures == 1
        judge.close()
        rerun = load("openai", server, concurrency=1, mode="single", cache_path=str(cache))
        calls_before = len(server.calls)
        again = rerun.score(["x", "y"], a)
    assert not torch.isnan(again).any()
    assert len(server.calls) - calls_before == 1  # only the failed one is asked again
    assert again[1] == scores[1]


def test_bad_request_is_recorded_not_retried(monkeypatch):
    a, _ = pairs(1)
    with serve("openai", monkeypatch, models=("fake-model",)) as server:
        judge = rewards.load("openai:unknown-model", base_url=server.base_url, mode="single", **FAST)
        with pytest.raises(JudgeNotReadyError, match="unknown-model"):  # 404 on a call stops the run
            judge.score(["x"], a)
    assert len(server.calls) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_fail_fast_without_key_or_with_unknown_model(kind, monkeypatch):
    preset = {"openai": "gpt4o", "anthropic": "claude", "gemini": "gemini"}[kind]
    with pytest.raises(JudgeNotReadyError, match=KEY_VARS[kind]):
        rewards.load(preset)
    with serve(kind, monkeypatch) as server:
        judge = rewards.load(preset, base_url=server.base_url)  # default model id: unknown to the fake
        with pytest.raises(JudgeNotReadyError, match="does not know model"):
            judge.check_ready()
        monkeypatch.setenv(KEY_VARS[kind], "wrong-key")
        with pytest.raises(JudgeNotReadyError, match="rejected the API key"):
            load(kind, server).check_ready()
    assert server.calls == []  # nothing generated


def test_google_api_key_is_accepted_too(monkeypatch):
    monkeypatch.setenv("GOOGLE_API_KEY", SECRET)
    with FakeJudgeServer("gemini", api_key=SECRET) as server:
        load("gemini", server).check_ready()


def test_openai_compatible_local_server_needs_no_key():
    a, b = pairs(1)
    # like `vllm serve` without --api-key: no key, and models are only listed, not retrievable by id
    with FakeJudgeServer("openai", retrieve_endpoint=False, models=("fake-model", "other")) as server:
        judge = rewards.load("openai:fake-model", base_url=server.base_url, structured="none", **FAST)
        judge.check_ready()
        with pytest.raises(JudgeNotReadyError, match="it serves: fake-model, other"):
            rewards.load("openai:typo-model", base_url=server.base_url).check_ready()
        assert judge.compare(["x"], a, b)[0].winner == 0
    assert "response_format" not in server.calls[0]["body"]


def test_rpm_limit_spaces_requests(monkeypatch):
    a, _ = pairs(5)
    with serve("openai", monkeypatch) as server:
        judge = load("openai", server, mode="single", concurrency=5, rpm=600)  # one per 0.1 s
        judge.score(["x"] * 5, a)
    times = sorted(c["time"] for c in server.calls)
    assert times[-1] - times[0] >= 0.3  # 4 intervals of 0.1 s, with slack for a loaded machine


def test_usage_and_cost_summary(monkeypatch):
    a, b = pairs(2)
    with serve("openai", monkeypatch, models=("gpt-4o-2024-11-20",)) as server:
        judge = rewards.load("gpt4o", base_url=server.base_url, **FAST)
        judge.compare(["x", "y"], a, b)
    summary = judge.usage_summary()
    # the fake server reports 100 + 85 per image input tokens and 20 output tokens per call
    assert judge.stats.input_tokens == 4 * 270 and judge.stats.output_tokens == 4 * 20
    expected_cost = (4 * 270 * 2.50 + 4 * 20 * 10.00) / 1e6
    assert f"${expected_cost:.4f}" in summary and "4 requests" in summary


def test_key_never_reaches_logs_cache_or_reprs(monkeypatch, tmp_path, caplog, capsys):
    caplog.set_level(logging.DEBUG)  # SDK debug logs included
    a, b = pairs(2)
    cache = tmp_path / "run" / "cache.sqlite"
    with serve("openai", monkeypatch) as server:
        judge = load("openai", server, cache_path=str(cache))
        judge.check_ready()
        server.inject("429", "refusal")
        prefs = judge.compare(["x", "y"], a, b)
        print(judge, judge.usage_summary(), prefs)
        monkeypatch.setenv("OPENAI_API_KEY", SECRET + "-wrong")
        with pytest.raises(JudgeNotReadyError) as err:
            load("openai", server).check_ready()
    judge.close()
    captured = capsys.readouterr()
    texts = [caplog.text, captured.out, captured.err, repr(judge), str(err.value), repr(prefs)]
    texts += [p.read_bytes().decode("latin-1") for p in (tmp_path / "run").iterdir()]
    assert server.calls[0]["headers"]["authorization"] == f"Bearer {SECRET}"  # it was used
    for text in texts:
        assert SECRET not in text


CRASH_SCRIPT = textwrap.dedent(
    """
    import sys, torch, rewards
    base_url, cache = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(0)
    images = torch.rand(24, 3, 8, 8, generator=g)
    judge = rewards.load("openai:fake-model", base_url=base_url, mode="single", concurrency=2, cache_path=cache)
    print(judge.score(["a caption"] * 24, images).tolist())
    """
)


def test_crash_mid_run_then_rerun_repeats_no_call(monkeypatch, tmp_path):
    cache = tmp_path / "cache.sqlite"
    script = tmp_path / "label.py"
    script.write_text(CRASH_SCRIPT)
    with serve("openai", monkeypatch, latency=0.05) as server:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        proc = subprocess.Popen([sys.executable, str(script), server.base_url, str(cache)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while len(server.calls) < 10 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # the crash
        proc.wait()
        first_run = len(server.calls)
        assert 10 <= first_run < 24, proc.stderr.read().decode()[-2000:]
        store = JudgeCache(cache)
        done_keys = {row["key"] for row in store.rows()}
        done_prompts = {(row["prompt"], row["image_hashes"]) for row in store.rows()}
        store.close()
        assert len(done_keys) >= first_run - 2  # at most the in-flight requests were lost

        judge = load("openai", server, mode="single", concurrency=4, cache_path=str(cache))
        g = torch.Generator().manual_seed(0)
        images = torch.rand(24, 3, 8, 8, generator=g)
        scores = judge.score(["a caption"] * 24, images)
    rerun_calls = server.calls[first_run:]
    assert not torch.isnan(scores).any()
    assert len(rerun_calls) == 24 - len(done_keys)  # every cached answer reused, none asked again
    assert judge.stats.cache_hits == len(done_keys)

    rerun_hashes = {json.dumps([image_hash(c["images"][0])]) for c in rerun_calls}
    assert not rerun_hashes & {h for _, h in done_prompts}


def test_pointwise_compare_asks_all_images_in_one_round(monkeypatch, capsys):
    a, b = pairs(3)
    with serve("gemini", monkeypatch, latency=0.5) as server:
        judge = load("gemini", server, mode="single", concurrency=6)
        prefs = judge.compare(["x"] * 3, a, b)
    assert [p.winner for p in prefs] == [0, 0, 0]
    arrivals = [c["time"] for c in server.calls]
    assert len(arrivals) == 6 and max(arrivals) - min(arrivals) < 0.4  # not two sequential batches
    assert prefs[0].raw["answers"][0]["status"] == "ok"
    judge.close()
    assert "6 requests" in capsys.readouterr().err  # usage printed at the end of the run


@pytest.mark.parametrize("server", [["--in-process-server"], ["--server-workers", "2"]], ids=["threads", "two-processes"])
def test_benchmark_script_smoke(tmp_path, server):
    bench_api_judges = load_script("bench_api_judges")
    results = bench_api_judges.main(["--pairs", "6", "--latency", "0.05", "--concurrency", "6", "--size", "16",
                                     *server, "--json", str(tmp_path / "bench.json")])
    assert results["labelled_pairs"] == 6 and results["requests"] == 12
    assert results["reference_loop_s"] >= 12 * 0.05
    assert results["ours_c6_s"] < results["reference_loop_s"]
    assert json.loads((tmp_path / "bench.json").read_text())["pairs"] == 6


def test_presets_map_to_current_ids(monkeypatch):
    for var in KEY_VARS.values():
        monkeypatch.setenv(var, SECRET)
    ids = {name: rewards.load(name) for name in ("gpt4o", "gpt4v", "gemini", "claude")}
    assert ids["gpt4o"].model == "gpt-4o-2024-11-20" and ids["gpt4o"].structured == "json_schema"
    assert ids["gpt4v"].model == "gpt-4-turbo" and ids["gpt4v"].structured == "json_object"
    assert ids["gemini"].provider == "google" and ids["claude"].provider == "anthropic"
    assert rewards.load("gpt4o", model="gpt-4.1").model == "gpt-4.1"  # user override
    with pytest.raises(ValueError, match="structured"):
        rewards.load("claude", structured="json_object")
    with pytest.raises(ValueError, match="concurrency"):
        rewards.load("gpt4o", concurrency=0)


def test_anthropic_json_schema_output_and_temperature_in_body(monkeypatch):
    a, b = pairs(1)
    with serve("anthropic", monkeypatch) as server:
        assert load("anthropic", server, structured="json_schema").compare(["x"], a, b)[0].winner == 0
        load("anthropic", server, temperature=None, mode="single").score(["x"], a)
    body = server.calls[0]["body"]
    assert body["output_config"]["format"]["type"] == "json_schema" and "tools" not in body
    assert body["temperature"] == 0.0  # the SDK has no temperature argument: sent in extra_body
    assert "temperature" not in server.calls[-1]["body"]  # None: provider default

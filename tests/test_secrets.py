"""Secrets never reach a log line, an error message, a config, a model card, a report or a cache
(rewards/secrets.py), and a key pasted where an environment-variable name goes is refused unrepeated."""

from __future__ import annotations

import base64
import json
import logging
import os
import sqlite3

import pytest

import rewards
from align.run_folder import atomic_write_text
from align.testing.fake_judge_servers import FakeJudgeServer, brightness
from align.train import dpo
from rewards.cache import CachedAnswer, JudgeCache
from rewards.secrets import check_key_env_name, install_log_scrubber, looks_like_secret, scrub, scrub_text

PASTED_KEY = "sk-proj-Zq8TESTpastedKEYnever0shown4u"  # what a user pastes into a spec
ENV_KEY = "plain-words-secret-value-831"  # a key of no known shape: masked because a key variable holds it


@pytest.fixture(autouse=True)
def no_real_keys(monkeypatch):
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "HF_TOKEN", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("key", [
    "sk-abcdefgh12345678", "sk-ant-api03-Abc123Def456Ghi789", "AIzaSyA1234567890abcdefghijklmnop",
    "hf_AbCdEfGhIjKlMnOpQrStUvWx", "Xk29QmZ7Lp04WnB8Rt3YvC6Hd1Fs5Gj",  # the last: a random token of no known shape
])
def test_key_shapes_are_masked_in_text(key):
    assert scrub_text(f"judge gpt4o[api_key_env={key}] failed") == "judge gpt4o[api_key_env=***] failed"
    assert looks_like_secret(key)


@pytest.mark.parametrize("text", [
    "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "stable-diffusion-v1-5/stable-diffusion-v1-5",
    "3f786850e387550fdab836ed7e6dc881de23001b3f786850e387550fdab836ed",  # a sha256: one case only
    "runs/dpo/checkpoints/step_0000500", "pytorch_lora_weights.safetensors", "constant_with_warmup",
    "OPENAI_API_KEY", "a photo of a red circle on the left of a blue square",
    "StableDiffusion3Pipeline", "StableDiffusionXLPipeline", "CLIPTextModelWithProjection",  # class names in messages
])
def test_ordinary_values_are_left_alone(text):
    assert scrub_text(text) == text and not looks_like_secret(text)


def test_images_embedded_in_a_report_are_not_damaged():
    data = base64.b64encode(os.urandom(200_000)).decode()
    html = f'<img src="data:image/png;base64,{data}">'
    assert scrub_text(html) == html


def test_values_of_key_variables_are_masked_whatever_their_shape(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", ENV_KEY)
    monkeypatch.setenv("MY_JUDGE_KEY", "another-plain-secret-77")
    monkeypatch.setenv("SHORT_TOKEN", "abc")  # too short to mask safely
    text = f"header {ENV_KEY} and another-plain-secret-77 and abc"
    assert scrub_text(text) == "header *** and *** and abc"
    assert scrub({"reward": f"x {ENV_KEY}", "api_key": "anything", "nested": [ENV_KEY], "lr": 1.0}) == \
        {"reward": "x ***", "api_key": "***", "nested": ["***"], "lr": 1.0}


def test_a_key_where_a_variable_name_goes_is_refused_without_repeating_it():
    for spec in (f"gpt4o[api_key_env={PASTED_KEY}]", "gpt4o[api_key_env=AIzaSyA1234567890abcdefghijklmnop]",
                 "claude[api_key_env=12345678901234567890]"):
        for call in (rewards.check_name, rewards.load):
            with pytest.raises(ValueError) as caught:
                call(spec)
            message = str(caught.value)
            assert "must be the NAME of an environment variable" in message
            assert spec.split("=")[1].rstrip("]") not in message
    check_key_env_name("MY_JUDGE_KEY")  # a name is fine


def test_every_log_record_is_scrubbed(caplog):
    install_log_scrubber()
    caplog.set_level(logging.DEBUG)
    logging.getLogger("some.library.deep").warning("request failed for key %s", PASTED_KEY)
    logging.getLogger("t2i").info(f"spec gpt4o[api_key_env={PASTED_KEY}]")
    assert PASTED_KEY not in caplog.text and caplog.text.count("***") == 2


def test_text_files_and_cache_entries_are_scrubbed(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", ENV_KEY)
    atomic_write_text(tmp_path / "README.md", f"reward: gpt4o[api_key_env={PASTED_KEY}]\nheader: {ENV_KEY}\n")
    card = (tmp_path / "README.md").read_text()
    assert PASTED_KEY not in card and ENV_KEY not in card and "gpt4o[api_key_env=***]" in card
    cache = JudgeCache(tmp_path / "answers.sqlite")
    cache.put("k", judge="j", question="q", prompt="p", image_hashes=["h"], decoding={},
              answer=CachedAnswer(raw=f"echoed {ENV_KEY} back", input_tokens=1, output_tokens=1))
    cache.close()
    stored = sqlite3.connect(tmp_path / "answers.sqlite").execute("SELECT raw FROM answers").fetchall()
    assert stored == [("echoed *** back",)]


def test_a_pasted_key_stops_a_run_before_anything_is_written(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        dpo.main(["--model", tiny_model, "--output_dir", str(run), "--reward", f"gpt4o[api_key_env={PASTED_KEY}]",
                  "--prompts", "testbed:2", "--report_to", "none"])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and "api_key_env" in out.err and "Traceback" not in out.err
    assert PASTED_KEY not in out.out + out.err and not run.exists()


def test_a_training_run_writes_and_prints_no_key(tiny_model, tmp_path, capsys, caplog, monkeypatch):
    # The key sits in a variable the spec names; the server (a compromised one) even echoes it in its answers.
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("T2I_TEST_JUDGE_CRED", ENV_KEY)  # a name that says nothing of keys

    def echoing_judge(prompt, images):  # the brighter image wins (a consistent verdict in both orders)
        first, second = (round(brightness(image), 4) for image in images)
        return json.dumps({"analysis": f"your key {ENV_KEY} works", "better_image": 1 if first >= second else 2})

    with FakeJudgeServer("openai", answer=echoing_judge, api_key=ENV_KEY) as server:
        spec = f"gpt4o[model=fake-model,base_url={server.base_url},timeout=10,api_key_env=T2I_TEST_JUDGE_CRED]"
        run = tmp_path / "run"
        dpo.main([
            "--model", tiny_model, "--output_dir", str(run), "--reward", spec, "--prompts", "testbed:2",
            "--images_per_prompt", "2", "--max_steps", "1", "--finetune", "lora", "--lora_rank", "4",
            "--resolution", "16", "--num_inference_steps", "2", "--checkpointing_steps", "1", "--report_to", "tensorboard",
        ])
        assert server.calls and server.calls[0]["headers"]["authorization"] == f"Bearer {ENV_KEY}"  # it was used
    out = capsys.readouterr()
    written = [p for p in run.rglob("*") if p.is_file()]
    assert (run / "final" / "README.md") in written and (run / "config.yaml") in written
    assert any(p.suffix == ".parquet" for p in written) and any("tfevents" in p.name for p in written)
    assert [str(p.relative_to(run)) for p in written if ENV_KEY.encode() in p.read_bytes()] == []
    assert ENV_KEY not in out.out + out.err + caplog.text

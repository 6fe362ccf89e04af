"""The headline commands with an API judge: `align/dpo.py --reward gpt4o` and `align/ddpo.py --reward gpt4o`,
through their command-line entry points, the real OpenAI SDK client and a fake server on 127.0.0.1.

The fake server answers as a brightness judge (the brighter of two images wins), so the tests can check
that the trainers used the server's verdicts on the images they sent, and that the API key never reaches
anything the run writes or prints."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from align.run_folder import JUDGE_ANSWERS
from align.testing.fake_judge_servers import FakeJudgeServer, brightness
from align.train import ddpo, dpo

SECRET = "sk-TEST-trainer-key-never-written-4d2a"


def rating(image: Image.Image) -> float:
    """1-10 by brightness, to 1e-4: the tiny random pipeline's images differ only slightly."""
    return round(1 + 9 * brightness(image), 4)


def fine_brightness_judge(prompt: str, images: list[Image.Image]) -> str:
    """The brighter of two images wins."""
    first, second = (rating(image) for image in images)
    better = 0 if first == second else (1 if first > second else 2)
    return json.dumps({"analysis": "brighter is better", "image_1_rating": first, "image_2_rating": second,
                       "better_image": better})


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\n")
    return str(path)


@pytest.fixture
def server(monkeypatch):
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    with FakeJudgeServer("openai", answer=fine_brightness_judge, api_key=SECRET) as fake:
        yield fake


def gpt4o(server) -> str:
    """The gpt4o preset pointed at the fake server (which knows the model as fake-model)."""
    return f"gpt4o[model=fake-model,base_url={server.base_url},timeout=10,backoff_base=0.01]"


def ddpo_command(model: str, prompts: str, server, out: Path, **flags) -> list[str]:
    """align/ddpo.py's command line for a tiny run judged by the fake server; ``flags`` add to or replace the defaults."""
    settings = {"num_inference_steps": 3, "samples_per_epoch": 4, "sample_batch_size": 4, "images_per_prompt": 2,
                "advantage": "group", "train_batch_size": 2, "report_to": "none", **flags}
    return ["--model", model, "--output-dir", str(out), "--reward", gpt4o(server), "--prompts", prompts,
            *[part for key, value in settings.items() for part in (f"--{key}", str(value))]]


def assert_secret_nowhere(run: Path, *texts: str) -> None:
    written = [p for p in run.rglob("*") if p.is_file()]
    assert written
    leaks = [str(p.relative_to(run)) for p in written if SECRET.encode() in p.read_bytes()]
    assert leaks == []
    for text in texts:
        assert SECRET not in text


def test_dpo_with_gpt4o_trains_on_the_servers_verdicts(tiny_model, prompt_file, server, tmp_path, capsys):
    run = tmp_path / "dpo-run"
    dpo.main([
        "--model", tiny_model, "--output-dir", str(run), "--reward", gpt4o(server), "--prompts", prompt_file,
        "--images_per_prompt", "2", "--max_steps", "2", "--train_batch_size", "1", "--finetune", "lora", "--lora_rank", "4",
        "--resolution", "16", "--num_inference_steps", "2", "--checkpointing_steps", "2", "--report_to", "none",
    ])
    out = capsys.readouterr()

    assert "[feedback] 2 prompts x 2 images: gpt4o is asked 2 comparisons (adjacent pairs)" in out.out  # before asking
    # every generation request asked the configured model with both images of a pair attached
    assert server.calls and {call["model"] for call in server.calls} == {"fake-model"}
    assert all(len(call["images"]) == 2 for call in server.calls)

    # the feedback data holds one labelled pair per prompt, and each label is the server's verdict:
    # the brighter image won
    shards = list((run / "feedback").rglob("*.parquet"))
    rows = pq.read_table(shards[0]).to_pylist()
    assert len(shards) == 1 and len(rows) == 2 and not any(r["abstained"] for r in rows)
    for row in rows:
        first, second = (rating(Image.open(io.BytesIO(row[key]))) for key in ("jpg_0", "jpg_1"))
        assert first != second and (row["label_0"] > row["label_1"]) == (first > second)

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 2
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file() and (run / "report.html").is_file()
    assert server.base_url in (run / "config.yaml").read_text()  # the run says which judge labelled it
    assert_secret_nowhere(run, out.out, out.err)


def test_a_resumed_ddpo_run_asks_the_server_nothing_it_asked_before(tiny_model, prompt_file, server, tmp_path, monkeypatch):
    def command(out, *extra):
        return ddpo_command(tiny_model, prompt_file, server, out, sample_batch_size=2, gradient_accumulation_steps=2,
                            num_epochs=2, checkpointing_epochs=1, learning_rate=0.01) + list(extra)

    ddpo.main(command(tmp_path / "straight"))
    straight_calls = len(server.calls)

    # the same run, stopped during epoch 2's update: after the server judged epoch 2, before its checkpoint
    update = ddpo.train_epoch
    updates = []

    def stops_in_the_second_epoch(*args, **kwargs):
        updates.append(1)
        if len(updates) == 2:
            raise KeyboardInterrupt
        return update(*args, **kwargs)

    monkeypatch.setattr(ddpo, "train_epoch", stops_in_the_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        ddpo.main(command(tmp_path / "stopped"))
    monkeypatch.setattr(ddpo, "train_epoch", update)
    asked = len(server.calls) - straight_calls
    assert asked == straight_calls  # both epochs were judged once

    ddpo.main(command(tmp_path / "stopped", "--resume", "latest"))  # re-samples epoch 2 from the epoch-1 checkpoint
    assert len(server.calls) - straight_calls == asked  # its images are the same: every verdict from the run's cache
    assert (tmp_path / "stopped" / JUDGE_ANSWERS / "process_0.sqlite").is_file()
    final = "final/pytorch_lora_weights.safetensors"
    straight, resumed = load_file(tmp_path / "straight" / final), load_file(tmp_path / "stopped" / final)
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_ddpo_with_gpt4o_rewards_are_win_rates_from_the_server(tiny_model, prompt_file, server, tmp_path, capsys):
    run = tmp_path / "ddpo-run"
    ddpo.main(ddpo_command(tiny_model, prompt_file, server, run, num_epochs=1, checkpointing_epochs=1))
    out = capsys.readouterr()

    # gpt4o compares images (pairwise-native): each image's reward is its win rate against the other images of
    # its caption in the epoch, and the server's verdict on the images it was sent is what decides each pair
    assert server.calls and all(len(call["images"]) == 2 for call in server.calls)
    logged = json.loads((run / "samples" / "epoch_00001.json").read_text())
    row = Image.open(run / "samples" / "epoch_00001.png")
    width = row.width // len(logged)
    ratings = [rating(row.crop((i * width, 0, (i + 1) * width, row.height))) for i in range(len(logged))]
    assert len(logged) == 4 and len(set(ratings)) > 1
    for i, entry in enumerate(logged):
        others = [j for j, other in enumerate(logged) if other["prompt"] == entry["prompt"] and j != i]
        wins = [1.0 if ratings[i] > ratings[j] else 0.5 if ratings[i] == ratings[j] else 0.0 for j in others]
        assert entry["reward"] == pytest.approx(sum(wins) / len(wins))

    # 4 images in groups of 2: at least 2 comparisons (a caption drawn twice in a batch merges its groups), each asked
    # in both orders
    assert "at least 2 comparisons per epoch (2 in all;" in out.out and len(server.calls) >= 2 * 2
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 1 and metrics[-1]["reward_mean"] == pytest.approx(0.5)
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file() and (run / "report.html").is_file()
    assert_secret_nowhere(run, out.out, out.err)


def test_a_judge_with_no_usable_answer_stops_ddpo_and_its_answers_stay_in_the_run(tiny_model, prompt_file, server, tmp_path, capsys):
    server.answer = lambda prompt, images: "I cannot tell which is better."
    run = tmp_path / "unusable"
    with pytest.raises(SystemExit) as exit_:
        ddpo.main(ddpo_command(tiny_model, prompt_file, server, run))
    err = capsys.readouterr().err
    assert exit_.value.code == 3 and "non-finite reward(s)" in err and "judge_answers/" in err
    kept = b"".join(path.read_bytes() for path in (run / JUDGE_ANSWERS).rglob("*") if path.is_file())
    assert b"I cannot tell which is better." in kept  # what the judge said, to read after the stop

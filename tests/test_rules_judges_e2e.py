"""The rule judges' testbed stand-ins end to end on the bundled testbed pipeline: DDPO training, best-of-N,
evaluation (with GenEval's per-task table) and the judge benchmark, each by its registered name."""

from __future__ import annotations

import csv
import json

import pytest

from align.eval import best_of_n as bon
from align.eval import evaluate as ev
from align.judgebench import benchmark as judgebench
from align.train import ddpo
from align.train.ddpo import DDPOConfig


def _train(tmp_path, reward):
    config = DDPOConfig(model="testbed", reward=reward, prompts="testbed:4", output_dir=str(tmp_path / "run"),
                        report_to="none", num_inference_steps=3, samples_per_epoch=4, sample_batch_size=4,
                        train_batch_size=2, gradient_accumulation_steps=1, timestep_fraction=0.34, num_epochs=1,
                        checkpointing_epochs=1, learning_rate=1e-3)
    run = ddpo.train(config)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records and 0.0 <= records[-1]["reward_mean"] <= 1.0
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()


def _best_of_n(tmp_path, reward):
    config = bon.BestOfNConfig(model="testbed", reward=reward, prompts="testbed", num_prompts=2, n=4, batch_size=8,
                               num_inference_steps=4, device="cpu", output_dir=str(tmp_path / "bon"))
    results = bon.best_of_n(config)
    curve = results["curves"][reward]
    assert curve[0] <= curve[-1]  # the best of 4 by the selector is never below the mean of the candidates


@pytest.mark.parametrize("reward", ["geneval-shapes[rule=flow-grpo]", "shapes-ocr"])
def test_trains_and_selects_with_the_stand_in(tmp_path, reward):
    _train(tmp_path, reward)
    _best_of_n(tmp_path, reward)


def test_evaluate_reports_geneval_per_task_table(tmp_path, capsys):
    out = tmp_path / "eval"
    ev.main(["--models", "testbed", "--judges", "geneval-shapes,shapes-ocr", "--prompts", "testbed", "--num_prompts",
             "6", "--num_inference_steps", "4", "--device", "cpu", "--output_dir", str(out)])
    results = json.loads((out / "results.json").read_text())
    tasks = results["judges"]["geneval-shapes"]["tasks"]["testbed"]
    scores = results["judges"]["geneval-shapes"]["scores"][0]
    assert sum(row["images"] for row in tasks["tasks"].values()) == 6
    assert sum(row["correct"] for row in tasks["tasks"].values()) == sum(scores)
    accuracies = [row["accuracy"] for row in tasks["tasks"].values()]
    assert tasks["overall"] == pytest.approx(sum(accuracies) / len(accuracies))
    assert results["judges"]["shapes-ocr"]["tasks"] is None  # a judge without its own table
    printed = capsys.readouterr().out
    assert "geneval-shapes per task" in printed and "overall (mean of tasks)" in printed
    assert "the judge&#x27;s own per-task table" in (out / "report.html").read_text()


def test_judge_benchmark_ranks_the_stand_ins(tmp_path):
    out = tmp_path / "jb"
    judgebench.main(["--judges", "geneval-shapes,shapes-ocr,random", "--data", "testbed", "--output_dir", str(out),
                     "--testbed_pairs", "3", "--testbed_bias_groups", "1", "--batch_size", "8"])
    rows = {r["judge"]: r for r in csv.DictReader((out / "leaderboard.csv").open())}
    assert set(rows) == {"geneval-shapes", "shapes-ocr", "random"}
    for name in ("geneval-shapes", "shapes-ocr"):
        assert 0.0 <= float(rows[name]["alignment_acc_with_ties"]) <= 1.0


@pytest.mark.parametrize("command", ["evaluate", "best_of_n", "ddpo"])
def test_prompts_a_judge_cannot_read_stop_before_generation(tmp_path, capsys, command):
    out = tmp_path / "out"
    argv = {
        "evaluate": (ev.main, ["--models", "testbed", "--judges", "geneval-shapes", "--prompts", "animals"]),
        "best_of_n": (bon.main, ["--model", "testbed", "--reward", "shapes-ocr", "--prompts", "animals"]),
        "ddpo": (ddpo.main, ["--model", "testbed", "--reward", "geneval-shapes", "--prompts", "animals"]),
    }[command]
    with pytest.raises(SystemExit) as exit_:
        argv[0]([*argv[1], "--output_dir", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "cannot judge these prompts" in err and "Traceback" not in err
    assert not out.exists()

"""Run folders: what a resume truncates and what --overwrite clears."""

from __future__ import annotations

import json

from align.runs import EVALS, JUDGE_ANSWERS, RunFolder


def _fill(folder):
    run = RunFolder(folder)
    run.prepare()
    for step in (1, 2, 3, 4):
        run.log(step, {"loss": float(step)})
    for step in (2, 4):
        (folder / EVALS).mkdir(exist_ok=True)
        (folder / EVALS / f"step_{step:07d}.json").write_text(json.dumps({"mean": 0.5}))
        (folder / EVALS / f"step_{step:07d}.png").write_bytes(b"png")
    (folder / "config.yaml").write_text("model: x\n")


def test_resume_drops_metrics_and_held_out_scores_after_the_checkpoint(tmp_path):
    _fill(tmp_path / "run")
    RunFolder(tmp_path / "run", resume="latest").truncate_metrics(2)
    assert [r["step"] for r in RunFolder(tmp_path / "run", resume="latest").read_metrics()] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "run" / EVALS).iterdir()) == ["step_0000002.json", "step_0000002.png"]


def test_overwrite_clears_the_held_out_scores_and_judge_answers_of_the_old_run(tmp_path):
    _fill(tmp_path / "run")
    (tmp_path / "run" / "notes.txt").write_text("mine")
    (tmp_path / "run" / JUDGE_ANSWERS).mkdir()
    (tmp_path / "run" / JUDGE_ANSWERS / "process_0.sqlite").write_bytes(b"old answers")
    RunFolder(tmp_path / "run", overwrite=True).prepare()
    assert not (tmp_path / "run" / EVALS).exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / JUDGE_ANSWERS).exists()  # a fresh run asks its judge afresh
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # only the run's own outputs go

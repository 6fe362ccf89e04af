"""experiments/testbed_sft_ceiling.py: true training pairs, held-out captions kept out, a budgeted run's curve."""

from __future__ import annotations

import json

import pytest
from script_loader import load_experiment

import rewards


@pytest.fixture(scope="module")
def sft_ceiling():
    return load_experiment("testbed_sft_ceiling")


def test_training_scenes_are_true_to_their_captions_and_leave_the_held_out_captions_out(sft_ceiling):
    first = sft_ceiling.render_training_scenes(12, held_out=set(), seed=0)[0]
    held_out = set(first[:5])
    captions, images = sft_ceiling.render_training_scenes(12, held_out=held_out, seed=0)
    assert len(captions) == 12 and images.shape == (12, 3, 32, 32)
    assert not held_out & set(captions)
    assert images.min() >= -1.0 and images.max() <= 1.0
    scores = rewards.load("shapes-oracle").score(captions, (images + 1) / 2)
    assert scores.tolist() == [1.0] * 12  # every image is a perfect answer to its caption


def test_a_budgeted_run_scores_before_during_and_after_and_writes_its_curve(sft_ceiling, tmp_path):
    out = tmp_path / "sft"
    curve = sft_ceiling.main(["--minutes", "0.03", "--eval-every", "0.01", "--num-scenes", "32", "--batch-size", "4",
                              "--eval-prompts", "testbed:3:1000", "--eval-images-per-prompt", "1", "--out", str(out)])
    assert curve[0]["step"] == 0 and curve[0]["cpu_minutes"] == 0.0
    assert len(curve) >= 3  # before, at least one evaluation on the way, after
    assert curve[-1]["cpu_minutes"] >= 0.03 and curve[-1]["step"] > curve[-2]["step"] > 0
    assert all(0.0 <= point["mean_oracle_score"] <= 1.0 for point in curve)
    assert json.loads((out / "curve.json").read_text())["curve"] == curve
    before = json.loads((out / "eval_before.json").read_text())
    assert len(before["scores"]) == 3 and before["mean"] == pytest.approx(curve[0]["mean_oracle_score"])
    after = json.loads((out / "eval_after.json").read_text())
    assert after["seeds"] == before["seeds"]  # the same held-out captions and seeds each time


def test_a_folder_with_results_is_refused_before_any_work(sft_ceiling, tmp_path, capsys):
    out = tmp_path / "sft"
    out.mkdir()
    (out / "curve.json").write_text("{}")
    with pytest.raises(SystemExit) as stopped:
        sft_ceiling.main(["--out", str(out)])
    assert stopped.value.code == 2 and "is not empty" in capsys.readouterr().err
    assert (out / "curve.json").read_text() == "{}"
    with pytest.raises(SystemExit):
        sft_ceiling.parse_args(["--minutes", "0", "--out", str(tmp_path / "other")])

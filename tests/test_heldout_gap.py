"""experiments/heldout_gap.py: the split of the held-out shortfall into a caption part and a seed part."""

from __future__ import annotations

import json

import pytest
import yaml
from script_loader import load_experiment

heldout_gap = load_experiment("heldout_gap")


def test_gap_parts_match_hand_computed_values():
    # Seed-major, 2 seeds x 2 captions: caption 0 scores 1.0 / 0.5, caption 1 scores 0.5 / 0.5.
    parts = heldout_gap.gap_parts([1.0, 0.5, 0.5, 0.5], images_per_prompt=2)
    assert parts["mean"] == pytest.approx(0.625)
    assert parts["gap"] == pytest.approx(0.375)
    assert parts["caption_part"] == pytest.approx((0.0 + 0.5) / 2)  # 1 - best seed, per caption
    assert parts["seed_part"] == pytest.approx((0.25 + 0.0) / 2)  # best seed - mean, per caption
    assert parts["caption_part"] + parts["seed_part"] == pytest.approx(parts["gap"])
    assert parts["all_seeds_perfect"] == 0.0 and parts["no_seed_perfect"] == 0.5


def test_gap_parts_read_the_layout_seed_major_not_caption_major():
    # Caption-major reading would pair 1.0 with 1.0 (a perfect caption); seed-major pairs 1.0 with 0.0.
    parts = heldout_gap.gap_parts([1.0, 1.0, 0.0, 0.0], images_per_prompt=2)
    assert parts["all_seeds_perfect"] == 0.0 and parts["no_seed_perfect"] == 0.0
    assert parts["seed_part"] == pytest.approx(0.5) and parts["caption_part"] == 0.0


@pytest.mark.parametrize("scores, k", [([1.0, 0.5, 0.2], 2), ([1.0, 0.5], 1)])
def test_gap_parts_reject_a_layout_that_is_not_k_seeds_per_caption(scores, k):
    with pytest.raises(ValueError, match="K >= 2"):
        heldout_gap.gap_parts(scores, images_per_prompt=k)


def test_main_reads_a_run_folders_evaluations_in_training_order(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "evals").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"eval_images_per_prompt": 2}))
    for path, scores in ((run / "eval_before.json", [0.5, 0.5, 0.5, 0.5]),
                         (run / "evals" / "step_0000010.json", [1.0, 0.5, 0.5, 0.5]),
                         (run / "evals" / "step_0000005.json", [1.0, 0.5, 0.5, 1.0]),
                         (run / "eval_after.json", [1.0, 1.0, 1.0, 1.0])):
        path.write_text(json.dumps({"scores": scores}))
    heldout_gap.main([str(run)])
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [line.split(":")[0] for line in lines] == ["before", "step 5", "step 10", "after"]
    assert "shortfall 0.500 = caption part 0.500 + seed part 0.000" in lines[0]
    assert "shortfall 0.250 = caption part 0.000 + seed part 0.250" in lines[1]
    assert "every seed perfect 100%" in lines[3]


def test_main_refuses_a_run_evaluated_with_one_seed_per_caption(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"eval_images_per_prompt": 1}))
    with pytest.raises(SystemExit, match="several seeds per caption"):
        heldout_gap.main([str(tmp_path)])

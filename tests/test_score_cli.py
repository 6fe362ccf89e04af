"""`python -m rewards.score`: prints scores; unknown judge, missing weights, unreadable image fail clearly."""

from __future__ import annotations

import runpy
import sys

import pytest
import torch

import rewards
from align.testing.tiny_judges import random_images, save_tiny_clip
from rewards.score import main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_tiny_clip(root / "clip", seed=3)
    paths = []
    for i, img in enumerate(random_images(2, seed=21)):
        paths.append(root / f"img{i}.png")
        img.save(paths[-1])
    (root / "broken.png").write_bytes(b"not an image")
    return root, [str(p) for p in paths]


def test_prints_one_score_per_image(files, capsys):
    root, paths = files
    code = main(["--judge", "clip", "--model", str(root / "clip"), "--device", "cpu",
                 "--batch-size", "1", "--prompt", "a red circle", *paths])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[1] for line in lines] == paths
    printed = torch.tensor([float(line.split("\t")[0]) for line in lines])
    judge = rewards.load("clip", model=str(root / "clip"), device="cpu")
    expected = judge.score(["a red circle"] * 2, [rewards.images.load_image(p) for p in paths])
    torch.testing.assert_close(printed, expected, atol=1e-6, rtol=0)


def test_judge_spec_options_pass_through(files, capsys):
    root, paths = files
    assert main(["--judge", "clip[variant=clip-s]", "--model", str(root / "clip"), "--device", "cpu",
                 "--prompt", "a cat", *paths]) == 0
    assert all(float(line.split("\t")[0]) >= 0 for line in capsys.readouterr().out.splitlines())


def test_unknown_judge_lists_the_known_ones(files, capsys):
    _, paths = files
    assert main(["--judge", "clipp", "--prompt", "x", *paths]) == 2
    err = capsys.readouterr().err
    assert "unknown judge 'clipp'" in err and "pickscore" in err and "hps" in err


@pytest.mark.parametrize("judge, message", [
    ("gpt4o", "needs an API key: set OPENAI_API_KEY"),
    ("shapes-oracle[nosie=0.2]", "judge 'shapes-oracle' has no option 'nosie'"),
    ("jpeg-compressibility:0.5,random:0.5", "is a weighted mix of judges"),
])
def test_an_unusable_judge_is_one_line_and_exit_2(files, capsys, monkeypatch, judge, message):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    _, paths = files
    assert main(["--judge", judge, "--prompt", "x", *paths]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_missing_weights_are_reported(files, capsys, tmp_path):
    _, paths = files
    assert main(["--judge", "clip", "--model", str(tmp_path / "none"), "--prompt", "x", *paths]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: judge 'clip': cannot load weights") and "none" in err


def test_unreadable_image_is_named_before_loading_weights(files, capsys, tmp_path):
    root, paths = files
    # the model folder does not exist either: the image error must come first
    assert main(["--judge", "clip", "--model", str(tmp_path / "none"), "--prompt", "x",
                 paths[0], str(root / "broken.png")]) == 2
    err = capsys.readouterr().err
    assert "broken.png" in err and "cannot load weights" not in err
    assert main(["--judge", "clip", "--prompt", "x", str(root / "missing.png")]) == 2
    assert "image file not found" in capsys.readouterr().err


def test_runs_as_a_module_with_a_rule_judge(files, capsys, monkeypatch):
    _, paths = files
    monkeypatch.delitem(sys.modules, "rewards.score", raising=False)  # run it fresh, as `python -m` does
    monkeypatch.setattr(sys, "argv", ["rewards.score", "--judge", "jpeg-compressibility", "--prompt", "x", *paths])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("rewards.score", run_name="__main__", alter_sys=True)
    assert done.value.code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(float(line.split("\t")[0]) < 0 for line in lines)  # minus JPEG kB

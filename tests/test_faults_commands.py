"""kill -9 at a random moment of each command other than the trainers (tests/test_faults.py covers those):
evaluate, best-of-N, reward-model training and the judge benchmark. Each is run straight, then killed
after a seeded random delay, then run again into the same folder (train_reward with --resume latest, the
others by their own rule: evaluate and best_of_n reuse their caches, judgebench takes --overwrite); the
rerun finishes and its results equal the straight run's, bit for bit (all four are deterministic on a
CPU with the settings here: seeded sampling, deterministic judges, seeded training)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_reward import pairs_file, tiny_clip  # noqa: F401 (fixtures used by reward_inputs)

from align.testbed.models import build_pipeline
from align.testbed.tokenizer import testbed_tokenizer

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def _command(module: str, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(child: subprocess.Popen, started: Path) -> float:
    """Wait until ``started`` exists (the command has begun writing) or the command ends; returns when."""
    while not started.exists() and child.poll() is None:
        time.sleep(0.02)
    return time.monotonic()


def _run(module: str, argv: list[str], started: Path) -> float:
    """Run the command to the end; returns the seconds of its work: from ``started`` appearing to the end."""
    child = _command(module, argv)
    began = _wait_for(child, started)
    output, _ = child.communicate()
    assert child.returncode == 0, output[-3000:]
    return time.monotonic() - began


def _kill_after(module: str, argv: list[str], started: Path, delay: float) -> str:
    """Start the command and kill -9 it ``delay`` seconds after ``started`` appears; returns how it ended."""
    child = _command(module, argv)
    _wait_for(child, started)
    try:
        child.communicate(timeout=delay)
        return f"finished (exit {child.returncode}) before the kill"
    except subprocess.TimeoutExpired:
        os.kill(child.pid, signal.SIGKILL)
        child.communicate()
        return "killed"


# Seeded moments, as fractions of the straight run's work (from its first write to its end): the same on
# every run of the suite, so a failure reproduces. One per command by default, two more each marked slow.
_FRACTIONS = random.Random(40).sample([x / 100 for x in range(0, 100)], 12)


def _moments(i: int) -> list:
    a, b, c = _FRACTIONS[3 * i : 3 * i + 3]
    return [a, pytest.param(b, marks=pytest.mark.slow), pytest.param(c, marks=pytest.mark.slow)]


def _killed_then_rerun(module: str, argv: list[str], rerun_argv: list[str], started: Path, work_seconds: float, fraction: float) -> None:
    ended = _kill_after(module, argv, started, fraction * work_seconds)
    assert ended == "killed" or ended.startswith("finished (exit 0)"), ended
    _run(module, rerun_argv, started)


def _no_leftovers(folder: Path) -> None:
    leftovers = [str(p.relative_to(folder)) for p in folder.rglob(".*")]
    assert leftovers == [], leftovers  # no temporary file or staging folder left behind by the rerun


def _hashes(folder: Path, pattern: str) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob(pattern)) if p.is_file()}


# ------------------------------------------------------------------ align.eval.evaluate


@pytest.fixture(scope="module")
def testbed_model(tmp_path_factory):
    """A random pipeline of the testbed architecture (32 px, as tests/test_best_of_n.py builds it)."""
    folder = tmp_path_factory.mktemp("testbed") / "pipe"
    torch.manual_seed(1)
    build_pipeline(testbed_tokenizer()).save_pretrained(folder)
    return str(folder)


def _eval_argv(model: str, out: Path) -> list[str]:
    return ["--models", f"a={model},b={model}", "--judges", "jpeg-compressibility,first-image", "--prompts", "testbed",
            "--num_prompts", "3", "--seeds", "0,1", "--num_inference_steps", "2", "--guidance_scale", "3.0",
            "--batch_size", "4", "--device", "cpu", "--fid_reference", "testbed",
            "--fid_feature", "pixels", "--output_dir", str(out)]


def _eval_results(out: Path) -> dict:
    """results.json less what legitimately differs after a kill: how many images this run had to generate."""
    results = json.loads((out / "results.json").read_text())
    for model in results["models"]:
        model.pop("images_generated")
    results["config"].pop("output_dir")
    return results


@pytest.fixture(scope="module")
def eval_straight(testbed_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "straight"
    return out, _run("align.eval.evaluate", _eval_argv(testbed_model, out), out)


@pytest.mark.parametrize("fraction", _moments(0))
def test_evaluate_killed_at_a_random_moment_finishes_bit_identical(testbed_model, eval_straight, tmp_path, fraction):
    straight, seconds = eval_straight
    out = tmp_path / "eval"
    argv = _eval_argv(testbed_model, out)
    _killed_then_rerun("align.eval.evaluate", argv, argv, out, seconds, fraction)
    assert _eval_results(out) == _eval_results(straight)
    assert _hashes(out, "generations/*/*.png") == _hashes(straight, "generations/*/*.png")  # the cached images, bit for bit
    assert (out / "results.csv").read_text() == (straight / "results.csv").read_text()
    assert (out / "report.html").is_file()
    _no_leftovers(out)


@pytest.mark.slow  # the suite's time budget on the 2-core CI machine
def test_evaluate_rerun_removes_the_temporary_files_of_a_killed_write(testbed_model, eval_straight, tmp_path):
    straight, _ = eval_straight
    out = tmp_path / "eval"
    shutil.copytree(straight, out)
    image = sorted(out.glob("generations/*/*.png"))[0]
    _plant_interrupted_writes(out, [str(image.relative_to(out)), "results.json"])
    _run("align.eval.evaluate", _eval_argv(testbed_model, out), out)
    assert _eval_results(out) == _eval_results(straight)
    assert _hashes(out, "generations/*/*.png") == _hashes(straight, "generations/*/*.png")
    _no_leftovers(out)


# ------------------------------------------------------------------ align.eval.best_of_n


def _bon_argv(model: str, out: Path) -> list[str]:
    return ["--model", model, "--reward", "jpeg-compressibility", "--eval_judges", "jpeg-incompressibility",
            "--prompts", "testbed", "--num_prompts", "3", "--n", "4", "--batch_size", "4", "--num_inference_steps", "2",
            "--guidance_scale", "2.0", "--device", "cpu", "--output_dir", str(out)]


def _bon_results(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    results["config"].pop("output_dir")
    return results


@pytest.fixture(scope="module")
def bon_straight(testbed_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bon") / "straight"
    return out, _run("align.eval.best_of_n", _bon_argv(testbed_model, out), out)


@pytest.mark.parametrize("fraction", _moments(1))
def test_best_of_n_killed_at_a_random_moment_finishes_bit_identical(testbed_model, bon_straight, tmp_path, fraction):
    straight, seconds = bon_straight
    out = tmp_path / "bon"
    argv = _bon_argv(testbed_model, out)
    _killed_then_rerun("align.eval.best_of_n", argv, argv, out, seconds, fraction)
    assert _bon_results(out) == _bon_results(straight)
    assert _hashes(out, "candidates/*/*.png") == _hashes(straight, "candidates/*/*.png")
    assert _hashes(out, "chosen/*.png") == _hashes(straight, "chosen/*.png")
    _no_leftovers(out)


def _plant_interrupted_writes(out: Path, finished: list[str]) -> None:
    """What kill -9 leaves when it lands inside an atomic write: the temporary file beside the file it was
    writing, which is then missing (the kill comes before the rename)."""
    for name in finished:
        target = out / name
        target.unlink()
        (target.parent / f".{target.name}.k1ll3d.tmp").write_bytes(b"half a file")


@pytest.mark.slow  # the suite's time budget on the 2-core CI machine
def test_best_of_n_rerun_removes_the_temporary_files_of_a_killed_write(testbed_model, bon_straight, tmp_path):
    """Wherever the kill lands: here inside the writes of a chosen image, a candidate and results.json."""
    straight, _ = bon_straight
    out = tmp_path / "bon"
    shutil.copytree(straight, out)
    candidate = sorted(out.glob("candidates/*/*.png"))[1]
    _plant_interrupted_writes(out, ["chosen/0002.png", str(candidate.relative_to(out)), "results.json"])
    _run("align.eval.best_of_n", _bon_argv(testbed_model, out), out)
    assert _bon_results(out) == _bon_results(straight)
    assert _hashes(out, "candidates/*/*.png") == _hashes(straight, "candidates/*/*.png")
    assert _hashes(out, "chosen/*.png") == _hashes(straight, "chosen/*.png")
    _no_leftovers(out)


# ------------------------------------------------------------------ align.train.reward_model


@pytest.fixture(scope="module")
def reward_inputs(request):
    """A tiny random CLIP and 20 rendered pairs, the fixtures of tests/test_train_reward.py."""
    return request.getfixturevalue("tiny_clip"), request.getfixturevalue("pairs_file")


def _reward_argv(inputs, out: Path) -> list[str]:
    clip, pairs = inputs
    return ["--dataset", str(pairs), "--model", clip, "--output_dir", str(out), "--finetune", "lora", "--lora_rank", "2",
            "--lora_alpha", "4", "--head_hidden", "16", "--train_batch_size", "4", "--eval_fraction", "0.2",
            "--max_steps", "8", "--checkpointing_steps", "2", "--learning_rate", "0.01", "--lr_scheduler", "constant",
            "--seed", "0", "--report_to", "none"]


@pytest.fixture(scope="module")
def reward_straight(reward_inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("reward") / "straight"
    return out, _run("align.train.reward_model", _reward_argv(reward_inputs, out), out / "config.yaml")


@pytest.mark.parametrize("fraction", _moments(2))
def test_train_reward_killed_at_a_random_moment_finishes_bit_identical_with_resume_latest(reward_inputs, reward_straight, tmp_path, fraction):
    straight, seconds = reward_straight
    out = tmp_path / "reward"
    argv = _reward_argv(reward_inputs, out)
    _killed_then_rerun("align.train.reward_model", argv, [*argv, "--resume", "latest"], out / "config.yaml", seconds, fraction)
    weights = _hashes(out, "final/*.safetensors")
    assert weights and weights == _hashes(straight, "final/*.safetensors")  # the trained weights, bit for bit
    meta, expected = (json.loads((run / "final" / "reward_model.json").read_text()) for run in (out, straight))
    assert meta["calibration"] == expected["calibration"] and meta["eval_accuracy"] == expected["eval_accuracy"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # one line per step: none lost, none twice
    assert (out / "report.html").is_file()
    _no_leftovers(out)


# ------------------------------------------------------------------ align.judgebench.benchmark


def _judgebench_argv(out: Path) -> list[str]:
    return ["--config", "configs/testbed_judgebench.yaml", "--judges", "shapes-oracle,shapes-clip,jpeg-compressibility,first-image",
            "--testbed_pairs", "4", "--testbed_bias_groups", "2", "--batch_size", "8", "--output_dir", str(out)]


def _judgebench_summary(out: Path) -> dict:
    """summary.json less the judges' timings (wall clock, never the same twice) and the paths of the folder."""
    def drop_seconds(obj):
        if isinstance(obj, dict):
            return {k: drop_seconds(v) for k, v in obj.items() if k not in ("seconds", "ms_per_pair", "output_dir", "data")}
        if isinstance(obj, list):
            return [drop_seconds(v) for v in obj]
        return obj

    return drop_seconds(json.loads((out / "summary.json").read_text()))


@pytest.fixture(scope="module")
def judgebench_straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("judgebench") / "straight"
    return out, _run("align.judgebench.benchmark", _judgebench_argv(out), out)


@pytest.mark.parametrize("fraction", _moments(3))
def test_judgebench_killed_at_a_random_moment_finishes_bit_identical_with_overwrite(judgebench_straight, tmp_path, fraction):
    straight, seconds = judgebench_straight
    out = tmp_path / "judgebench"
    argv = _judgebench_argv(out)
    _killed_then_rerun("align.judgebench.benchmark", argv, [*argv, "--overwrite", "true"], out, seconds, fraction)
    assert (out / "testbed_benchmark.parquet").read_bytes() == (straight / "testbed_benchmark.parquet").read_bytes()
    assert (out / "verdicts.jsonl").read_text() == (straight / "verdicts.jsonl").read_text()
    assert _judgebench_summary(out) == _judgebench_summary(straight)
    assert (out / "leaderboard.md").is_file() and (out / "report.html").is_file()
    _no_leftovers(out)


@pytest.mark.slow  # the suite's time budget on the 2-core CI machine
def test_train_reward_killed_before_its_first_checkpoint_finishes_with_resume_latest(reward_inputs, reward_straight, tmp_path):
    """The earliest moment: its config written, no checkpoint yet (--resume latest used to refuse this run)."""
    straight, _ = reward_straight
    out = tmp_path / "reward"
    argv = _reward_argv(reward_inputs, out)
    assert _kill_after("align.train.reward_model", argv, out / "config.yaml", 0.0) == "killed"
    assert not list(out.glob("checkpoints/step_*"))  # the case under test: nothing to resume from
    _run("align.train.reward_model", [*argv, "--resume", "latest"], out / "config.yaml")
    assert _hashes(out, "final/*.safetensors") == _hashes(straight, "final/*.safetensors")
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 9))

"""Fault injection: a run interrupted anywhere (an exception injected at each stage, kill -9 at random
moments, a full disk) loses nothing already written, and `--resume latest` finishes it with the final
weights of the uninterrupted run, bit for bit (CPU training here is deterministic)."""

from __future__ import annotations

import errno
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
from safetensors.torch import load_file
from test_ddpo_train import small_config as ddpo_small_config
from test_dpo import small_config as dpo_small_config

import align.data.feedback
import align.pipeline
import align.train.checkpoints
import align.train.report
from align.run_folder import SET_ASIDE
from align.train import ddpo, dpo, dpo_feedback, heldout, lifecycle, online_rollouts

ROOT = Path(__file__).resolve().parent.parent


class Injected(RuntimeError):
    """The failure a test injects (stands for a crash, an OOM, a lost machine)."""


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\na green triangle\n")
    return str(path)


FEEDBACK_PROMPTS = "a red circle\na blue square\na green triangle\na yellow circle\na red square\n"  # two labelling batches


def dpo_config(tiny_model, prompt_file, out, **overrides):
    """Every stage present: AI feedback (labelling, in two batches), 4 steps with checkpoints at 2 and 4,
    before/after evaluation."""
    feedback_prompts = Path(prompt_file).with_name("feedback_prompts.txt")
    if not feedback_prompts.exists():
        feedback_prompts.write_text(FEEDBACK_PROMPTS)
    # the tiny model's own 16 px given explicitly: a command line cannot say None, and the run's latent
    # store (--latent_store run) is refused at another resolution
    return dpo_small_config(tiny_model, out, reward="jpeg-compressibility", prompts=str(feedback_prompts),
                            eval_prompts=prompt_file, eval_judge="jpeg-compressibility", **{"resolution": 16, **overrides})


def ddpo_config(tiny_model, prompt_file, out, **overrides):
    return ddpo_small_config(tiny_model, prompt_file, out, eval_prompts=prompt_file, **overrides)


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "pytorch_lora_weights.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=0)


def assert_finished_like(run: Path, straight: Path, steps: list[int]) -> None:
    """Finished: the straight run's final weights bit for bit, every stage's output present, one metric line per step."""
    assert_same_weights(straight, run)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == steps
    for name in ("eval_before.json", "eval_after.json", "report.html", "final/README.md"):
        assert (run / name).is_file(), name
    assert json.loads((run / "eval_after.json").read_text()) == json.loads((straight / "eval_after.json").read_text())
    leftovers = [p.name for p in run.rglob(".*") if p.name != ".gitignore"]
    assert leftovers == [], leftovers  # no staging folder or temporary file left behind


def file_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dpo_straight(tiny_model, prompt_file, tmp_path_factory):
    return dpo.train(dpo_config(tiny_model, prompt_file, tmp_path_factory.mktemp("dpo") / "straight"))


@pytest.fixture(scope="module")
def ddpo_straight(tiny_model, prompt_file, tmp_path_factory):
    return ddpo.train(ddpo_config(tiny_model, prompt_file, tmp_path_factory.mktemp("ddpo") / "straight"))


# ------------------------------------------------------------------ an exception at every stage


def _fail_when(module, name, should_fail, partial=None):
    """``module.name`` wrapped: raises Injected when should_fail(*args) (after ``partial`` ran, if given)."""
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        if should_fail(*args, **kwargs):
            if partial is not None:
                partial(*args, **kwargs)
            raise Injected(f"injected failure in {name}")
        return real(*args, **kwargs)

    return real, wrapped


def _count(n):
    calls = {"n": 0}

    def nth(*args, **kwargs):
        calls["n"] += 1
        return calls["n"] == n

    return nth


def _labelling_fails_after_one_batch(monkeypatch):
    real = dpo_feedback.generate_feedback

    def generate_feedback(generate_images, *args, **kwargs):
        done = {"n": 0}

        def generate_then_fail(prompts, seeds):
            done["n"] += 1
            if done["n"] > 1:  # the first batch's pairs are written (a shard), the second's are not
                raise Injected("injected failure while labelling")
            return generate_images(prompts, seeds)

        return real(generate_then_fail, *args, **kwargs)

    monkeypatch.setattr(dpo_feedback, "generate_feedback", generate_feedback)


def _half_written_lora(unet, folder, family=None):
    (Path(folder) / "pytorch_lora_weights.safetensors").write_bytes(b"\0" * 100)


DPO_STAGES = {
    "labelling": lambda mp: _labelling_fails_after_one_batch(mp),
    "training": lambda mp: mp.setattr(dpo, "diffusion_dpo_loss", _fail_when(dpo, "diffusion_dpo_loss", _count(3))[1]),
    "last checkpoint": lambda mp: mp.setattr(align.train.checkpoints, "publish_folder", _fail_when(
        align.train.checkpoints, "publish_folder", lambda staged, path: path.name == "step_0000004")[1]),
    "final save": lambda mp: mp.setattr(align.pipeline, "save_lora", _fail_when(
        align.pipeline, "save_lora", lambda *a: True, partial=_half_written_lora)[1]),
    "after-evaluation": lambda mp: mp.setattr(heldout, "evaluate_model", _fail_when(
        heldout, "evaluate_model", lambda *a: a[-1] == "after")[1]),
    "report": lambda mp: mp.setattr(lifecycle, "write_training_report", _fail_when(
        lifecycle, "write_training_report", lambda *a, **k: True)[1]),
}


def _stages(stages: dict, fast: set[str]) -> list:
    """The stages to parametrize over; those outside ``fast`` are marked slow (the file stays ~2 minutes)."""
    return [name if name in fast else pytest.param(name, marks=pytest.mark.slow) for name in stages]


# Fast by default: the stages no other test interrupts (training itself: tests/test_dpo.py's resume tests).
@pytest.mark.parametrize("stage", _stages(DPO_STAGES, {"labelling", "last checkpoint", "final save"}))
def test_dpo_interrupted_at_each_stage_finishes_with_resume_latest(tiny_model, prompt_file, dpo_straight, tmp_path, monkeypatch, stage):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        DPO_STAGES[stage](mp)
        with pytest.raises(Injected):
            dpo.train(dpo_config(tiny_model, prompt_file, out))
    assert (out / "final").exists() == (stage == "report")  # a half-written final/ is never in place
    resumed = dpo.train(dpo_config(tiny_model, prompt_file, out, resume="latest"))
    assert_finished_like(resumed, dpo_straight, [1, 2, 3, 4])


def _decode_fails_in_epoch_two(mp):
    mp.setattr(online_rollouts, "decode_latents", _fail_when(online_rollouts, "decode_latents", _count(3))[1])


DDPO_STAGES = {
    "sampling": _decode_fails_in_epoch_two,
    "last checkpoint": lambda mp: mp.setattr(align.train.checkpoints, "publish_folder", _fail_when(
        align.train.checkpoints, "publish_folder", lambda staged, path: path.name == "step_0000002")[1]),
    "final save": lambda mp: mp.setattr(align.pipeline, "save_lora", _fail_when(
        align.pipeline, "save_lora", lambda *a: True, partial=_half_written_lora)[1]),
    "after-evaluation": lambda mp: mp.setattr(heldout, "evaluate_model", _fail_when(
        heldout, "evaluate_model", lambda *a: a[-1] == "after")[1]),
    "report": lambda mp: mp.setattr(lifecycle, "write_training_report", _fail_when(
        lifecycle, "write_training_report", lambda *a, **k: True)[1]),
}


@pytest.mark.parametrize("stage", _stages(DDPO_STAGES, {"sampling", "final save", "report"}))
def test_ddpo_interrupted_at_each_stage_finishes_with_resume_latest(tiny_model, prompt_file, ddpo_straight, tmp_path, monkeypatch, stage):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        DDPO_STAGES[stage](mp)
        with pytest.raises(Injected):
            ddpo.train(ddpo_config(tiny_model, prompt_file, out))
    assert (out / "final").exists() == (stage == "report")
    resumed = ddpo.train(ddpo_config(tiny_model, prompt_file, out, resume="latest"))
    assert_finished_like(resumed, ddpo_straight, [1, 2])


# ------------------------------------------------------------------ a damaged latest checkpoint


def test_a_truncated_latest_checkpoint_falls_back_to_the_one_before(tiny_model, prompt_file, dpo_straight, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:  # stopped after its last checkpoint, before the final weights
        DPO_STAGES["final save"](mp)
        with pytest.raises(Injected):
            dpo.train(dpo_config(tiny_model, prompt_file, out))
    latest = out / "checkpoints" / "step_0000004"
    weights_file = latest / "trainable_weights.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
    capsys.readouterr()
    resumed = dpo.train(dpo_config(tiny_model, prompt_file, out, resume="latest"))
    printed = capsys.readouterr().out
    damaged = [line for line in printed.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and str(latest) in damaged[0] and "trainable_weights.safetensors" in damaged[0]
    assert "resumed from" in printed and "step_0000002 at step 2" in printed
    assert_finished_like(resumed, dpo_straight, [1, 2, 3, 4])


# ------------------------------------------------------------------ a full disk


def _disk_full_when(dst_name):
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == dst_name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    return replace


def test_a_full_disk_while_saving_leaves_the_previous_files_and_the_run_resumable(tiny_model, prompt_file, dpo_straight, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:  # the disk fills while the last checkpoint is written
        mp.setattr(os, "replace", _disk_full_when("step_0000004"))
        with pytest.raises(OSError, match="No space"):
            dpo.train(dpo_config(tiny_model, prompt_file, out))
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000002"]  # intact, nothing half written
    resumed = dpo.train(dpo_config(tiny_model, prompt_file, out, resume="latest"))
    assert_finished_like(resumed, dpo_straight, [1, 2, 3, 4])

    before = file_hashes(out)  # a finished run; re-finishing it on a full disk changes none of its files
    real_write = Path.write_bytes

    def half_written_then_full(path, data):
        if path.name.startswith(".README.md"):  # the model card of the new final/
            real_write(path, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, data)

    with monkeypatch.context() as mp:
        mp.setattr(Path, "write_bytes", half_written_then_full)
        with pytest.raises(OSError, match="No space"):
            dpo.train(dpo_config(tiny_model, prompt_file, out, resume="latest"))
    after = file_hashes(out)
    for name in ("final/pytorch_lora_weights.safetensors", "final/README.md", "config.yaml",
                 "checkpoints/step_0000004/trainable_weights.safetensors"):
        assert after[name] == before[name], name
    assert [p.name for p in out.rglob(".*")] == []
    again = dpo.train(dpo_config(tiny_model, prompt_file, out, resume="latest"))  # room again: it finishes, unchanged
    assert_finished_like(again, dpo_straight, [1, 2, 3, 4])


# ------------------------------------------------------------------ --overwrite


def _broken_copy(tiny_model: str, folder: Path) -> str:
    """The tiny pipeline with its UNet weights cut short: it passes the cheap checks, then fails to load."""
    shutil.copytree(tiny_model, folder)
    weights_file = next((folder / "unet").glob("*.safetensors"))
    weights_file.write_bytes(weights_file.read_bytes()[:200])
    return str(folder)


def test_overwrite_with_a_model_that_fails_to_load_leaves_the_old_run_byte_for_byte(tiny_model, prompt_file, dpo_straight, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(dpo_straight, old)
    (old / "notes.txt").write_text("mine")
    before = file_hashes(old)
    broken = _broken_copy(tiny_model, tmp_path / "broken")
    argv = _flags(dpo_config(broken, prompt_file, old, overwrite=True))
    with pytest.raises((SystemExit, Exception)) as failed:
        dpo.main(argv)
    assert not (isinstance(failed.value, SystemExit) and failed.value.code == 0)
    assert file_hashes(old) == before and not (old / SET_ASIDE).exists()

    new = dpo.train(dpo_config(tiny_model, prompt_file, old, overwrite=True, max_steps=2))
    assert [p.name for p in (new / "checkpoints").iterdir()] == ["step_0000002"]  # the old step 4 is gone
    assert [json.loads(line)["step"] for line in (new / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (new / "notes.txt").read_text() == "mine" and not (new / SET_ASIDE).exists()


# ------------------------------------------------------------------ kill -9 at random moments


def _flags(config) -> list[str]:
    argv = []
    for key, value in vars(config).items():
        if value is not None:
            argv += [f"--{key}", str(value)]
    return argv


def _kill_after(script: str, config, delay: float) -> str:
    """Start ``script`` on ``config`` in a child process and kill -9 it ``delay`` seconds after its run
    folder gets its config (the work has begun); returns how it ended."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, script, *_flags(config)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = Path(config.output_dir) / "config.yaml"
    deadline = time.monotonic() + 120
    while not started.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    if child.poll() is not None:
        return f"finished (exit {child.returncode}) before the kill"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    return "killed"


# Seeded: the same moments on every run of the suite (a failure reproduces).
_DELAYS = random.Random(40).sample([x / 10 for x in range(0, 60)], 4)


@pytest.mark.parametrize("delay", [_DELAYS[0], pytest.param(_DELAYS[1], marks=pytest.mark.slow),
                                   pytest.param(_DELAYS[2], marks=pytest.mark.slow)])
def test_dpo_killed_at_a_random_moment_finishes_bit_identical(tiny_model, prompt_file, dpo_straight, tmp_path, delay):
    out = tmp_path / "run"
    ended = _kill_after("align/dpo.py", dpo_config(tiny_model, prompt_file, out), delay)
    assert ended == "killed" or ended.startswith("finished (exit 0)"), ended
    resumed = dpo.train(dpo_config(tiny_model, prompt_file, out, resume="latest"))
    assert_finished_like(resumed, dpo_straight, [1, 2, 3, 4])


@pytest.mark.parametrize("delay", [_DELAYS[3], pytest.param(_DELAYS[1], marks=pytest.mark.slow),
                                   pytest.param(_DELAYS[2], marks=pytest.mark.slow)])
def test_ddpo_killed_at_a_random_moment_finishes_bit_identical(tiny_model, prompt_file, ddpo_straight, tmp_path, delay):
    out = tmp_path / "run"
    ended = _kill_after("align/ddpo.py", ddpo_config(tiny_model, prompt_file, out), delay)
    assert ended == "killed" or ended.startswith("finished (exit 0)"), ended
    resumed = ddpo.train(ddpo_config(tiny_model, prompt_file, out, resume="latest"))
    assert_finished_like(resumed, ddpo_straight, [1, 2])

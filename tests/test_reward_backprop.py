"""Reward backpropagation in the online-RL trainer (align/train/reward_backprop.py): DRaFT-K, DRaFT-LV, AlignProp and
ReFL train every kind of family through a differentiable judge; what the trainer guarantees holds for this shape of
epoch too (kill -9 and resume bit-identical, two processes = one with twice the accumulation, the held-out
evaluation with a second judge and its report); what cannot run is refused in one line. The gradients against the
authors' code: tests/test_reward_backprop_reference.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from align.testing.two_processes import ROOT, launch_two_cpu_processes
from align.testing.weights import assert_weights_close
from align.train import ddpo
from align.train.ddpo_config import DDPOConfig

SETTINGS = dict(reward="shapes-clip", prompts="testbed:8", report_to="none", num_inference_steps=4, resolution=32,
                samples_per_epoch=8, sample_batch_size=2, train_batch_size=2, images_per_prompt=1, advantage="batch",
                num_epochs=2, checkpointing_epochs=1, learning_rate=3e-2, guidance_scale=3.0, lora_alpha=8.0)
OWN = {"alignprop": dict(alignprop_truncation_mean=0.5), "refl": dict(refl_last_steps=2)}  # the 4-step chain's share


def config(model, out, algorithm: str, **overrides) -> DDPOConfig:
    return DDPOConfig(**{**SETTINGS, "model": model, "output_dir": str(out), "gradient_accumulation_steps": 2,
                         "algorithm": algorithm, **OWN.get(algorithm, {}), **overrides})


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def lora(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "pytorch_lora_weights.safetensors"))


SLOW = pytest.mark.slow  # the suite's time budget: make test-all runs every pair


@pytest.mark.parametrize("algorithm, kind", [("draft", "sd"), pytest.param("alignprop", "sd", marks=SLOW),
                                             pytest.param("draft-lv", "sd3", marks=SLOW), ("refl", "flux"),
                                             pytest.param("draft", "sdxl", marks=SLOW)])
def test_reward_backpropagation_trains_every_family(family_models, tiny_model, tmp_path, algorithm, kind):
    model = tiny_model if kind == "sd" else family_models(kind)
    run = ddpo.train(config(model, tmp_path / f"{algorithm}-{kind}", algorithm=algorithm))
    logged = records(run)
    assert [r["global_step"] for r in logged] == [2, 4]  # 8 samples an epoch, 2 x 2 per optimiser step
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"], r["reward_mean"]])).all() for r in logged)
    ups = [value for name, value in lora(run).items() if "lora_B" in name or "lora.up" in name]
    assert ups and any(value.abs().sum() > 0 for value in ups)  # B starts at zero: the reward's gradient moved it
    card = (run / "final" / "README.md").read_text()
    assert {"draft": "DRaFT-K", "draft-lv": "DRaFT-LV", "alignprop": "AlignProp", "refl": "ReFL"}[algorithm] in card
    samples = sorted((run / "samples").glob("*.json"))
    assert samples and all("reward" in entry for entry in json.loads(samples[0].read_text()))


def test_the_second_held_out_judge_and_the_distance_from_the_base_reach_the_report(tiny_model, tmp_path):
    run = ddpo.train(config(tiny_model, tmp_path / "run", algorithm="draft", eval_prompts="testbed:3:9",
                            eval_second_judge="shapes-oracle", eval_every_epochs=1, eval_inference_steps=4))
    before, after = (json.loads((run / f"eval_{label}.json").read_text()) for label in ("before", "after"))
    assert before["prediction_change"] == 0.0 and after["prediction_change"] > 0  # the adapter starts at zero
    assert before["second_judge"]["name"] == "shapes-oracle" and len(after["second_judge"]["scores"]) == 3
    during = json.loads((run / "evals" / "step_0000001.json").read_text())
    assert during["seeds"] == before["seeds"] and "second_judge" in during
    report = (run / "report.html").read_text()
    assert 'id="second-judge-table"' in report and "held-out gains of both judges" in report


@pytest.fixture(scope="module")
def alignprop_straight(tiny_model, tmp_path_factory):
    return ddpo.train(config(tiny_model, tmp_path_factory.mktemp("alignprop") / "straight", algorithm="alignprop",
                             num_epochs=2))


def assert_same_run(resumed: Path, straight: Path) -> None:
    for key, value in lora(straight).items():
        assert torch.equal(lora(resumed)[key], value), key
    assert [r["reward_mean"] for r in records(resumed)] == [r["reward_mean"] for r in records(straight)]


def test_a_run_stopped_after_a_checkpoint_resumes_bit_identical(tiny_model, alignprop_straight, tmp_path, monkeypatch):
    """AlignProp draws its truncation, the sampler its noise: all from the epoch's generators, so a run stopped after
    its first checkpoint and resumed from it ends with the uninterrupted run's weights, to the bit."""

    class Crash(Exception):
        pass

    save = ddpo.save_ddpo_checkpoint

    def save_then_crash(*args, **kwargs):
        save(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(ddpo, "save_ddpo_checkpoint", save_then_crash)
    with pytest.raises(Crash):
        ddpo.train(config(tiny_model, tmp_path / "run", algorithm="alignprop", num_epochs=2))
    monkeypatch.undo()
    assert_same_run(ddpo.train(config(tiny_model, tmp_path / "run", algorithm="alignprop", num_epochs=2,
                                      resume="latest")), alignprop_straight)


@pytest.mark.slow  # a child process killed with SIGKILL, then resumed: ~1-2 min on the shared 2-core machine
def test_a_run_killed_at_a_random_moment_resumes_bit_identical(tiny_model, alignprop_straight, tmp_path):
    out = tmp_path / "run"
    argv = [f"--{k}={v}" for k, v in {**SETTINGS, "model": tiny_model, "output_dir": out, "algorithm": "alignprop",
                                         "num_epochs": 2, "gradient_accumulation_steps": 2, **OWN["alignprop"]}.items()]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "align/ddpo.py", *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((out / "checkpoints").glob("step_*")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # killed once its first checkpoint is written, within the second epoch
    if child.poll() is None:
        os.kill(child.pid, signal.SIGKILL)
    child.wait()
    resumed = ddpo.train(config(tiny_model, out, algorithm="alignprop", num_epochs=2, resume="latest"))
    assert_same_run(resumed, alignprop_straight)


@pytest.mark.slow  # one two-process launch: ~1-2 min on the shared 2-core machine; run with -m slow
def test_two_processes_train_as_one_with_doubled_accumulation(tiny_model, tmp_path):
    one = ddpo.train(config(tiny_model, tmp_path / "one", algorithm="alignprop"))
    two = tmp_path / "two"
    flags = {**SETTINGS, "model": tiny_model, "output_dir": two, "algorithm": "alignprop", "gradient_accumulation_steps": 1,
             **OWN["alignprop"]}
    result = launch_two_cpu_processes("align/ddpo.py", [f"--{k}={v}" for k, v in flags.items()], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained weights identical on all 2 processes" in result.stdout
    for a, b in zip(records(one), records(two)):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], rel=1e-5, abs=1e-7)
    assert_weights_close(lora(one), lora(two))


@pytest.mark.parametrize("flags, message", [
    (["--reward", "shapes-oracle"], "has no differentiable scoring path"),
    (["--reward", "shapes-clip:0.5,jpeg-compressibility:0.5"], "has no differentiable scoring path"),
    (["--sample_batch_size", "4"], "must equal --train_batch_size"),
    (["--kl_coef", "0.01"], "has no KL term"),
    (["--draft_k", "9"], "backpropagates through 1 to 4 steps"),
    (["--eval_second_judge", "shapes-oracle"], "--eval_second_judge applies only with --eval_prompts"),
])
def test_what_cannot_run_is_refused_in_one_line(tiny_model, tmp_path, capsys, flags, message):
    argv = ["--model", tiny_model, "--prompts", "testbed:4", "--algorithm", "draft", "--num_inference_steps", "4",
            "--samples_per_epoch", "4", "--sample_batch_size", "2", "--train_batch_size", "2", "--advantage", "batch",
            "--output_dir", str(tmp_path / "run"), "--report_to", "none", "--reward", "shapes-clip", *flags]
    with pytest.raises(SystemExit) as stop:
        ddpo.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_sampler_that_cannot_sample_with_gradients_is_refused(family_models, tmp_path):
    with pytest.raises(Exception, match="samples with gradients: .*use --sampler ode"):
        ddpo.train(config(family_models("sd3"), tmp_path / "run", algorithm="draft", sampler="dpm2"))

"""The checkpoint is the truth (issue 61 item 1): a resumed run keeps to the settings its checkpoint's sealed record
holds, config.yaml is a copy (edited, it changes nothing), a refused or failed resume rewrites nothing of the run, a run
whose checkpoints are all damaged is refused with the way out, and a run stopped before its first checkpoint leaves
nothing, so the corrected command runs as typed (finding 6)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import accelerate
import pytest
import yaml

from align.run_folder import CHECKPOINT_STATE, RunFolder, RunFolderError, read_sealed
from align.train import ddpo, dpo, online_rollouts
from align.train.command import TrainingStopped
from align.train.dpo_config import DPOConfig
from align.train.resume import check_resume_settings

sys.path.insert(0, str(Path(__file__).parent))
from test_ddpo_train import prompt_file  # noqa: F401  (a fixture)
from test_ddpo_train import small_config as ddpo_config
from test_dpo import pair_parquet, small_config  # noqa: F401  (pair_parquet: a fixture)


def _argv(tiny_model, pairs, out, **flags) -> list[str]:
    settings = {"model": tiny_model, "dataset": pairs, "output_dir": str(out), "report_to": "none", "finetune": "lora",
                "lora_rank": 4, "resolution": 16, "train_batch_size": 2, "gradient_accumulation_steps": 1,
                "learning_rate": 1e-3, "scale_lr": False, "lr_warmup_steps": 0, "beta": 100.0,
                "num_inference_steps": 2, "checkpointing_steps": 1, **flags}
    return [part for key, value in settings.items() for part in (f"--{key}", str(value))]


def _fails(capsys, argv, *words, code: int = 2) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        dpo.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == code, err[-2000:]
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    for word in words:
        assert word in line, line
    return line


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".run.lock"}


@pytest.fixture
def interrupted(tiny_model, pair_parquet, tmp_path):  # noqa: F811
    """A two-step run stopped after its first checkpoint (step 2's checkpoint and final/ removed)."""
    out = tmp_path / "run"
    dpo.main(_argv(tiny_model, pair_parquet, out, max_steps=2))
    for leftover in ("checkpoints/step_0000002", "final", "report.html"):
        path = out / leftover
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return out


def test_each_checkpoint_records_the_runs_settings_processes_and_layout(interrupted):
    state = read_sealed(interrupted / "checkpoints" / "step_0000001" / CHECKPOINT_STATE)
    assert state["processes"] == 1 and state["sharded"] is False
    assert state["settings"]["beta"] == 100.0 and state["settings"]["gradient_accumulation_steps"] == 1
    assert (interrupted / "config.yaml").read_text().splitlines()[-1].startswith("# digest: ")


def test_a_hand_edited_config_yaml_changes_nothing(tiny_model, pair_parquet, interrupted, capsys):  # noqa: F811
    """Issue 61 finding 2: an edited config.yaml overrode what the checkpoint trained with (beta 5000 and 1 mixed)."""
    path = interrupted / "config.yaml"
    edited = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**edited, "beta": 7.0, "learning_rate": 0.5}))
    line = _fails(capsys, [*_argv(tiny_model, pair_parquet, interrupted, max_steps=2, beta=7.0), "--resume", "latest"],
                  "read from its checkpoint step_0000001", "--beta 100.0 (now 7.0)",
                  "to continue it, run the same command with --beta 100.0")
    assert "learning_rate" not in line  # the edited copy is not read
    dpo.main([*_argv(tiny_model, pair_parquet, interrupted, max_steps=2), "--resume", "latest"])  # the run's own flags
    assert (interrupted / "final").is_dir()
    assert yaml.safe_load(path.read_text())["beta"] == 100.0  # the copy rewritten from the run's record


def test_a_refused_or_failed_resume_rewrites_nothing_of_the_run(tiny_model, pair_parquet, interrupted, capsys,  # noqa: F811
                                                                 monkeypatch):
    before = _hashes(interrupted)
    _fails(capsys, [*_argv(tiny_model, pair_parquet, interrupted, max_steps=2, gradient_accumulation_steps=2),
                    "--resume", "latest"], "--gradient_accumulation_steps 1 (now 2)",
           "run the same command with --gradient_accumulation_steps 1")
    assert _hashes(interrupted) == before

    def broken_load(self, path):
        raise FileNotFoundError(f"{path}/trainable_weights.safetensors")

    monkeypatch.setattr(accelerate.Accelerator, "load_state", broken_load)
    with pytest.raises(FileNotFoundError):  # a resume that fails while loading: config.yaml, metrics as they were
        dpo.main([*_argv(tiny_model, pair_parquet, interrupted, max_steps=3), "--resume", "latest"])
    assert _hashes(interrupted) == before


def test_a_run_whose_checkpoints_are_all_damaged_is_refused_with_the_way_out(tiny_model, pair_parquet, interrupted,  # noqa: F811
                                                                             capsys):
    state = interrupted / "checkpoints" / "step_0000001" / CHECKPOINT_STATE
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": 5}))
    before = _hashes(interrupted)
    _fails(capsys, [*_argv(tiny_model, pair_parquet, interrupted, max_steps=2), "--resume", "latest"],
           "every checkpoint in", "is damaged", "--overwrite true")
    assert _hashes(interrupted) == before  # never started again from step 0 over what the run trained


def test_an_edited_config_of_a_run_without_checkpoint_is_refused(tmp_path, capsys):
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    config = DPOConfig(model="m", dataset="d", output_dir=str(folder.path))
    folder.save_config(vars(config))
    check_resume_settings(RunFolder(folder.path, resume="latest"), DPOConfig(**{**vars(config), "resume": "latest"}))
    text = (folder.path / "config.yaml").read_text()
    (folder.path / "config.yaml").write_text(text.replace("beta: 5000.0", "beta: 1.0"))
    with pytest.raises(RunFolderError, match="was edited after the run wrote it, and it has no checkpoint yet"):
        check_resume_settings(RunFolder(folder.path, resume="latest"), DPOConfig(**{**vars(config), "beta": 1.0,
                                                                                      "resume": "latest"}))


def test_a_run_stopped_before_its_first_checkpoint_leaves_nothing_and_the_command_runs_again(
        tiny_model, prompt_file, tmp_path, capsys, monkeypatch):  # noqa: F811
    """Issue 61 finding 6: non-finite images at the first epoch ended with "(lower --learning_rate)" and left
    config.yaml, so the corrected command was refused with "already holds a run"."""
    real = online_rollouts.decode_latents
    monkeypatch.setattr(online_rollouts, "decode_latents", lambda pipe, latents: real(pipe, latents) * float("nan"))
    out = tmp_path / "run"
    config = ddpo_config(tiny_model, prompt_file, out, num_epochs=1)
    with pytest.raises(SystemExit) as exit_:
        ddpo.main(["--config", _yaml(tmp_path, config)])
    err = capsys.readouterr().err
    assert exit_.value.code == 3 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "non-finite generated images at epoch 0" in line and "--guidance_scale" in line
    assert "run the command again" in line and "learning_rate" not in line
    assert not (out / "config.yaml").exists()
    monkeypatch.setattr(online_rollouts, "decode_latents", real)
    ddpo.main(["--config", _yaml(tmp_path, config)])  # the same command, once the cause is mended
    assert (out / "final").is_dir()


def test_a_stop_after_a_checkpoint_names_it_and_the_resume(tiny_model, pair_parquet, tmp_path, monkeypatch):  # noqa: F811
    calls = {"n": 0}
    real = dpo.diffusion_dpo_loss

    def nan_at_step_two(*args, **kwargs):
        calls["n"] += 1
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 2 else loss), metrics

    monkeypatch.setattr(dpo, "diffusion_dpo_loss", nan_at_step_two)
    with pytest.raises(TrainingStopped) as stopped:
        dpo.train(small_config(tiny_model, tmp_path / "run", dataset=pair_parquet, max_steps=2, checkpointing_steps=1))
    assert "step_0000001: --resume latest continues from it" in str(stopped.value)
    assert "start a new run (another --output_dir, or --overwrite true)" in str(stopped.value)


def _yaml(tmp_path: Path, config) -> str:
    path = tmp_path / "ddpo.yaml"
    path.write_text(yaml.safe_dump(asdict(config)))
    return str(path)

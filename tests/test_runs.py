"""Run folders: what a resume truncates, what --overwrite sets aside and gives back, atomic writes, damaged
checkpoints, health checks on images and weights."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest
import torch

from align.health import degenerate_reason, weights_finite
from align.run_folder import (
    _SET_ASIDE_HERE,
    EVALS,
    JUDGE_ANSWERS,
    LOCK_FILE,
    SET_ASIDE,
    RunFolder,
    RunFolderError,
    atomic_folder,
    atomic_write_text,
    folder_manifest,
    restores_old_run_on_failure,
    seal,
)


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


# ------------------------------------------------------------------------------ nothing is lost


def _hashes(folder):
    """{relative path: sha256} of every file under ``folder`` (what 'byte for byte' compares)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != LOCK_FILE}  # the lock: whoever writes now


def _old_run(folder):
    _fill(folder)
    (folder / "checkpoints" / "step_0000004").mkdir(parents=True)
    (folder / "checkpoints" / "step_0000004" / "state.json").write_text('{"step": 4}')
    (folder / "final").mkdir()
    (folder / "final" / "pytorch_lora_weights.safetensors").write_bytes(bytes(range(256)) * 8)
    (folder / "notes.txt").write_text("mine")
    return _hashes(folder)


class _Config:
    def __init__(self, output_dir):
        self.output_dir = str(output_dir)


def test_a_failed_overwrite_start_gives_the_old_run_back_byte_for_byte(tmp_path):
    before = _old_run(tmp_path / "run")

    @restores_old_run_on_failure
    def train(config):
        run = RunFolder(config.output_dir, overwrite=True)
        run.prepare()
        assert not (run.path / "final").exists() and (run.path / SET_ASIDE / "final").is_dir()
        run.save_config({"model": "new"})
        run.log(1, {"loss": 1.0})
        raise OSError("the model failed to load")

    with pytest.raises(OSError, match="failed to load"):
        train(_Config(tmp_path / "run"))
    assert _hashes(tmp_path / "run") == before
    assert not (tmp_path / "run" / SET_ASIDE).exists()


def test_an_overwrite_run_lets_go_of_the_old_run_at_its_first_checkpoint(tmp_path):
    _old_run(tmp_path / "run")
    run = RunFolder(tmp_path / "run", overwrite=True)
    run.prepare()
    run.let_go_of_old_run()  # what save_checkpoint does once the first checkpoint is in place
    assert not (tmp_path / "run" / SET_ASIDE).exists() and not (tmp_path / "run" / "final").exists()
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def _as_if_another_process(path):
    """Forget that this process set the old run aside (as after a kill -9 and a new command)."""
    _SET_ASIDE_HERE.discard(path.resolve())


def test_an_overwrite_killed_before_its_first_checkpoint_is_undone_by_the_next_command(tmp_path, capsys):
    before = _old_run(tmp_path / "run")
    run = RunFolder(tmp_path / "run", overwrite=True)
    run.prepare()
    run.save_config({"model": "new"})
    (tmp_path / "run" / "feedback").mkdir()  # the killed run had begun labelling
    _as_if_another_process(tmp_path / "run")
    with pytest.raises(RunFolderError, match="already holds a run"):  # the set-aside run still counts
        RunFolder(tmp_path / "run")
    RunFolder(tmp_path / "run", resume="latest").prepare()
    assert "set aside is back in place" in capsys.readouterr().out
    assert _hashes(tmp_path / "run") == before


def test_an_overwrite_killed_while_setting_the_old_run_aside_is_undone(tmp_path):
    before = _old_run(tmp_path / "run")
    real = os.replace
    calls = {"n": 0}

    def killed_after_two_moves(src, dst):
        calls["n"] += 1
        if calls["n"] > 3:  # the list of what moves, then two outputs
            raise KeyboardInterrupt
        real(src, dst)

    os.replace = killed_after_two_moves
    try:
        with pytest.raises(KeyboardInterrupt):
            RunFolder(tmp_path / "run", overwrite=True).prepare()
    finally:
        os.replace = real
    _as_if_another_process(tmp_path / "run")
    RunFolder(tmp_path / "run", overwrite=True).prepare()  # the next command: old run back, then set aside afresh
    _as_if_another_process(tmp_path / "run")
    RunFolder(tmp_path / "run", resume="latest").prepare()
    assert _hashes(tmp_path / "run") == before


def test_an_overwrite_killed_after_its_first_checkpoint_keeps_the_new_run(tmp_path):
    _old_run(tmp_path / "run")
    run = RunFolder(tmp_path / "run", overwrite=True)
    run.prepare()
    (tmp_path / "run" / "checkpoints" / "step_0000002").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_0000002" / "state.json").write_text('{"step": 2}')
    _as_if_another_process(tmp_path / "run")  # killed between the checkpoint and deleting the old run
    RunFolder(tmp_path / "run", resume="latest").prepare()
    assert not (tmp_path / "run" / SET_ASIDE).exists()
    assert [p.name for p in RunFolder(tmp_path / "run", resume="latest").checkpoints()] == ["step_0000002"]


def _checkpoint(run, step, payload):
    folder = run.checkpoint_dir(step)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(payload)
    (folder / "state.json").write_text(json.dumps(seal({"step": step, "files": folder_manifest(folder)})))
    return folder


@pytest.mark.parametrize("damage", ["truncated", "changed", "missing", "state", "unsealed", "edited"])
def test_a_damaged_latest_checkpoint_is_reported_and_the_one_before_used(tmp_path, capsys, damage):
    run = RunFolder(tmp_path / "run")
    run.prepare()
    earlier = _checkpoint(run, 2, b"a" * 100)
    latest = _checkpoint(run, 4, b"b" * 100)
    if damage == "truncated":
        (latest / "model.safetensors").write_bytes(b"b" * 60)
    elif damage == "changed":
        (latest / "model.safetensors").write_bytes(b"c" * 100)
    elif damage == "missing":
        (latest / "model.safetensors").unlink()
    elif damage == "state":
        (latest / "state.json").write_text('{"step": ')
    else:  # issue 61: a record without its digest, or with a field edited by hand (the processes), is not trusted
        state = json.loads((latest / "state.json").read_text())
        if damage == "unsealed":
            del state["digest"]
        else:
            state["processes"] = 1
        (latest / "state.json").write_text(json.dumps(state))
    resumed = RunFolder(tmp_path / "run", resume="latest")
    assert resumed.resume_checkpoint() == earlier
    lines = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert len(lines) == 1 and str(latest) in lines[0]
    assert resumed.latest_checkpoint() == earlier  # named in "last good checkpoint" messages
    assert latest.is_dir()  # reported and skipped, never deleted
    with pytest.raises(RunFolderError, match="damaged"):  # a checkpoint named explicitly is not swapped
        RunFolder(tmp_path / "run", resume=str(latest)).resume_checkpoint()


def test_pruning_after_a_damaged_checkpoint_keeps_the_intact_ones(tmp_path):
    run = RunFolder(tmp_path / "run")
    run.prepare()
    _checkpoint(run, 1, b"a")
    _checkpoint(run, 2, b"b")
    latest = _checkpoint(run, 3, b"c")
    (latest / "model.safetensors").write_bytes(b"")
    resumed = RunFolder(tmp_path / "run", resume="latest")
    resumed.resume_checkpoint()
    resumed.prune_checkpoints(1)
    assert [p.name for p in resumed.checkpoints()] == ["step_0000002", "step_0000003"]


def test_a_torn_last_metrics_line_is_skipped_and_damage_elsewhere_reported(tmp_path):
    run = RunFolder(tmp_path / "run")
    run.prepare()
    run.log(1, {"loss": 1.0})
    run.log(2, {"loss": 2.0})
    with open(tmp_path / "run" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "lo')  # killed mid-append
    assert [r["step"] for r in run.read_metrics()] == [1, 2]
    run.truncate_metrics(2)  # what a resume does first: the torn line goes
    run.log(3, {"loss": 3.0})
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(RunFolderError, match="line 2"):
        run.read_metrics()


def test_an_atomic_folder_replaces_the_old_one_only_when_complete(tmp_path):
    target = tmp_path / "final"
    target.mkdir()
    (target / "weights").write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_folder(target) as staged:
            (staged / "weights").write_bytes(b"half")
            raise RuntimeError("killed while saving")
    assert (target / "weights").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no staging folder left behind
    with atomic_folder(target) as staged:
        (staged / "weights").write_bytes(b"new")
        (staged / "README.md").write_text("card")
    assert (target / "weights").read_bytes() == b"new" and (target / "README.md").read_text() == "card"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


@pytest.mark.parametrize("writer", ["text", "folder"])
def test_a_full_disk_during_a_write_leaves_the_previous_file(tmp_path, monkeypatch, writer):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "weights").write_bytes(b"old")
    (tmp_path / "config.yaml").write_text("old: 1\n")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        if writer == "text":
            atomic_write_text(tmp_path / "config.yaml", "new: 2\n")
        else:
            with atomic_folder(tmp_path / "final") as staged:
                (staged / "weights").write_bytes(b"new")
    monkeypatch.undo()
    assert (tmp_path / "config.yaml").read_text() == "old: 1\n"
    assert (tmp_path / "final" / "weights").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "final"]


# ---------------------------------------------------------------------------------- health checks


def test_degenerate_images_are_nan_or_mostly_blank():
    g = torch.Generator().manual_seed(0)
    healthy = torch.rand(4, 3, 8, 8, generator=g)
    assert degenerate_reason(healthy) is None
    one_blank = healthy.clone()
    one_blank[0] = 0.3  # one blank image can be a fair answer to its prompt
    assert degenerate_reason(one_blank) is None
    black = torch.zeros(4, 3, 8, 8)  # what NaN images become once written as PNG
    assert "4 of 4 images are blank" in degenerate_reason(black)
    nan = healthy.clone()
    nan[1, 0, 0, 0] = float("nan")
    assert "1 of 4 images hold NaN" in degenerate_reason(nan)
    assert not weights_finite([torch.ones(3), torch.tensor([1.0, float("inf")])])
    assert weights_finite([torch.ones(3)])


def test_opening_a_run_clears_what_killed_writes_left_and_puts_back_a_half_replaced_folder(tmp_path):
    run = RunFolder(tmp_path / "run")
    run.prepare()
    (tmp_path / "run" / ".metrics.jsonl.abc.tmp").write_text("half")
    (tmp_path / "run" / "checkpoints" / ".step_0000004.partial").mkdir(parents=True)
    (tmp_path / "run" / ".final.replaced").mkdir()  # killed between moving the old final/ aside and the new one in
    (tmp_path / "run" / ".final.replaced" / "weights").write_bytes(b"old")
    (tmp_path / "run" / "feedback" / ".pairs.parquet.x.tmp").parent.mkdir()
    (tmp_path / "run" / "feedback" / ".pairs.parquet.x.tmp").write_bytes(b"half")
    RunFolder(tmp_path / "run", resume="latest").prepare()
    assert sorted(str(p.relative_to(tmp_path / "run")) for p in (tmp_path / "run").rglob("*")) == [
        LOCK_FILE, "checkpoints", "feedback", "final", "final/weights"]  # the lock: this process opened the run
    assert (tmp_path / "run" / "final" / "weights").read_bytes() == b"old"

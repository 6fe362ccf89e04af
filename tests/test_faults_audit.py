"""Issue 49's audit, the cases that need a run: a lock on each run folder (a second start refused, a killed run's
lock taken over), a moved run that resumes from its latent store, a resume with other settings refused in one line,
a latent store checked against its manifest, the run's store holding only the pairs the run reads, a start that
fails on a bad input leaving nothing behind, and a key in a variable of any name masked in every file a run writes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import sys
import time
from pathlib import Path

import pytest
import yaml

from align.data.latent_store import MANIFEST, read_manifest, shard_name
from align.judgebench import benchmark as judgebench
from align.run_folder import (
    LOCK_FILE,
    RunFolder,
    RunFolderError,
    check_not_locked,
    process_start,
    read_metrics,
    release_run_lock,
)
from align.train import dpo, dpo_data

sys.path.insert(0, str(Path(__file__).parent))
import errno

from test_dpo import pair_parquet, small_config  # noqa: F401  (pair_parquet: a fixture)
from test_precompute import write_pairs

from align.data import precompute
from align.data.pair_stream import capped_workers
from align.testing.fake_judge_servers import FakeJudgeServer, brightness
from align.testing.locks import hold_run_lock


def _main_fails(capsys, argv: list[str], *words: str, code: int = 2) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        dpo.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == code, err[-2000:]
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err
    for word in words:
        assert word in line, line
    return line


def _lock_for(folder: Path, pid: int) -> None:
    """A lock file naming ``pid`` (this host, its start time), written as a file only: nobody holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_FILE).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "start": process_start(pid),
                                                "launcher": None, "time": time.time()}))


# ------------------------------------------------------------------ the lock


def test_a_live_run_locks_its_folder_and_a_killed_one_does_not(tmp_path, capsys):
    run = tmp_path / "run"
    other = hold_run_lock(run)  # another process "training" into the folder
    try:
        (run / "config.yaml").write_text("model: testbed\n")
        lock = json.loads((run / LOCK_FILE).read_text())
        assert lock["pid"] == other.pid and "align.run_lock" in lock["command"]  # it names its process and command
        for kwargs in ({}, {"overwrite": True}, {"resume": "latest"}):
            with pytest.raises(RunFolderError, match=f"in use by a run that is still going \\(pid {other.pid}.*"
                                                     f"kill {other.pid}"):
                RunFolder(run, **kwargs)
        # two starts into one empty folder: the second finds the first one's lock when it takes its own
        fresh = tmp_path / "fresh"
        first = RunFolder(fresh)
        second = hold_run_lock(fresh)
        try:
            with pytest.raises(RunFolderError, match="in use"):
                first.prepare()
        finally:
            second.kill()
            second.wait()
        assert not (fresh / "config.yaml").exists()
    finally:
        other.kill()  # kill -9: the lock file stays behind, held by nobody
        other.wait()
    capsys.readouterr()
    RunFolder(run, resume="latest").prepare()  # taken over, nothing to clean by hand, and said so
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"named pid {other.pid}" in capsys.readouterr().out
    release_run_lock(run)


def test_a_lock_of_a_reused_pid_is_stale(tmp_path):
    """The lock records its process's start time: another process that got the same pid does not hold it."""
    run = tmp_path / "run"
    _lock_for(run, os.getppid())
    lock = json.loads((run / LOCK_FILE).read_text())
    (run / LOCK_FILE).write_text(json.dumps({**lock, "start": "1"}))  # the pid's earlier owner started at tick 1
    RunFolder(run).prepare()
    release_run_lock(run)


@pytest.mark.parametrize("lock", ["pid 1", "unreadable"])
def test_a_lock_that_names_a_process_not_holding_it_is_taken_over(tmp_path, capsys, lock):
    """Issue 61 finding 6: a .run.lock of this host naming pid 1 (alive for ever) blocked the folder for ever with no way
    out; so did a lock that could not be read. Nobody holds either: the next start takes it over and says so."""
    run = tmp_path / "run"
    _lock_for(run, 1)
    if lock == "unreadable":
        (run / LOCK_FILE).write_bytes(b"\xff{not json")
    check_not_locked(run)  # the commands that only check (evaluation) go on too
    RunFolder(run).prepare()
    said = capsys.readouterr().out
    assert ("named pid 1" if lock == "pid 1" else "could not be read") in said and "taken over" in said
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    release_run_lock(run)
    assert not (run / LOCK_FILE).exists()


def test_a_held_lock_that_names_another_process_is_refused_with_the_way_out(tmp_path):
    """A live process holds the lock, but its record names pid 1: not the run it names. Refused (something holds it),
    with how to find the holder."""
    run = tmp_path / "run"
    holder = hold_run_lock(run)
    try:
        lock = json.loads((run / LOCK_FILE).read_text())
        (run / LOCK_FILE).write_text(json.dumps({**lock, "pid": 1, "start": process_start(1)}))  # the same inode
        with pytest.raises(RunFolderError, match=f"not the run its lock names \\(pid 1\\).*fuser -v {run / LOCK_FILE}"):
            RunFolder(run)
    finally:
        holder.kill()
        holder.wait()


def test_only_the_ranks_of_the_runs_own_launch_share_its_folder(tmp_path, monkeypatch):
    """The processes of one launch share the folder when they are one distributed group of the run (its rendezvous),
    not because they share a parent: a second launch (another port), or a second rank 0, is refused."""
    run = tmp_path / "run"
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}
    holder = hold_run_lock_as(run, {**group, "RANK": "0", "LOCAL_RANK": "0"})
    try:
        for name, value in {**group, "RANK": "1", "LOCAL_RANK": "1"}.items():
            monkeypatch.setenv(name, value)
        check_not_locked(run)  # rank 1 of the run's own launch
        monkeypatch.setenv("MASTER_PORT", "29512")
        with pytest.raises(RunFolderError, match="in use"):
            check_not_locked(run)  # another launch
        monkeypatch.setenv("MASTER_PORT", "29511")
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(RunFolderError, match="in use"):
            check_not_locked(run)  # a second rank 0 is not of this run
    finally:
        holder.kill()
        holder.wait()


def hold_run_lock_as(folder: Path, env: dict):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return hold_run_lock(folder)


def test_a_run_lets_go_of_its_lock_however_it_ends(tiny_model, pair_parquet, tmp_path):  # noqa: F811
    out = dpo.train(small_config(tiny_model, tmp_path / "run", dataset=pair_parquet, max_steps=1))
    assert not (out / LOCK_FILE).exists()


# ------------------------------------------------------------------ a start stopped by a bad input


def test_a_start_stopped_by_a_bad_input_leaves_nothing_so_the_corrected_command_runs(tiny_model, tmp_path, capsys,
                                                                                       monkeypatch):

    monkeypatch.setattr(dpo_data, "UPFRONT_IMAGE_CHECK", 0)  # as in a run reading many pairs: met while encoding

    broken = write_pairs(tmp_path / "broken.parquet", corrupt_row=3)  # found only when its image is read
    out = tmp_path / "run"
    argv = ["--model", tiny_model, "--output_dir", str(out), "--report_to", "none", "--max_steps", "1",
            "--finetune", "lora", "--lora_rank", "4", "--resolution", "16", "--train_batch_size", "5",
            "--gradient_accumulation_steps", "1", "--latent_store", "run"]
    _main_fails(capsys, [*argv, "--dataset", broken], "row 3", "unreadable image")
    assert not out.exists()  # no config.yaml: the corrected command is not refused with "already holds a run"
    fixed = write_pairs(tmp_path / "fixed.parquet")
    dpo.main([*argv, "--dataset", fixed])
    assert (out / "final").is_dir()


# ------------------------------------------------------------------ resume: moved, other settings


def test_a_moved_run_with_a_touched_dataset_resumes_from_its_store(tiny_model, pair_parquet, tmp_path):  # noqa: F811
    data = tmp_path / "pairs.parquet"
    shutil.copy(pair_parquet, data)
    settings = dict(dataset=str(data), max_steps=2, checkpointing_steps=1)
    first = dpo.train(small_config(tiny_model, tmp_path / "run", **settings))
    shutil.rmtree(first / "checkpoints" / "step_0000002")
    shutil.rmtree(first / "final")
    moved = tmp_path / "renamed"
    os.rename(first, moved)
    os.utime(data, (time.time() + 60, time.time() + 60))  # touched: same bytes, another time
    resumed = dpo.train(small_config(tiny_model, moved, resume="latest", **settings))
    assert (resumed / "final").is_dir() and [r["step"] for r in read_metrics(resumed)] == [1, 2]


def test_a_resume_with_other_settings_is_refused_naming_them(tiny_model, pair_parquet, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    dpo.train(small_config(tiny_model, out, dataset=pair_parquet, max_steps=1))
    config = (out / "config.yaml").read_text()
    argv = ["--model", tiny_model, "--dataset", pair_parquet, "--output_dir", str(out), "--resume", "latest",
            "--report_to", "none", "--finetune", "lora", "--resolution", "16"]
    line = _main_fails(capsys, [*argv, "--learning_rate", "0.5", "--beta", "7", "--lora_rank", "64"],
                       "--learning_rate 0.001 (now 0.5)", "--beta 100.0 (now 7.0)", "--lora_rank 4 (now 64)")
    assert "other settings" in line
    assert (out / "config.yaml").read_text() == config  # nothing claims settings the run does not use


def test_a_resume_that_extends_the_run_says_so_and_records_it(tiny_model, pair_parquet, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    dpo.train(small_config(tiny_model, out, dataset=pair_parquet, max_steps=1))
    capsys.readouterr()
    dpo.train(small_config(tiny_model, out, dataset=pair_parquet, max_steps=2, resume="latest"))
    assert "--resume applies --max_steps 2 (was 1)" in capsys.readouterr().out
    assert yaml.safe_load((out / "config.yaml").read_text())["max_steps"] == 2


# ------------------------------------------------------------------ the latent store


def test_the_runs_store_holds_the_pairs_the_run_reads_and_a_longer_run_adds_the_rest(tiny_model, pair_parquet, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    dpo.train(small_config(tiny_model, out, dataset=pair_parquet, max_steps=1, train_batch_size=2))
    printed = capsys.readouterr().out
    assert "this run reads 2 of the 6 pairs" in printed and "--latent_store none skips this" in printed
    assert "1 of 2 pairs encoded in" in printed and "left" in printed  # the duration, said early (once)
    manifest = read_manifest(out / "latents")
    assert manifest["num_pairs"] == 6 and not manifest["complete"]
    assert sum(r["pairs"] for r in manifest["shards"].values()) == 2  # a short run encodes its own pairs only
    dpo.train(small_config(tiny_model, out, dataset=pair_parquet, max_steps=4, train_batch_size=2, resume="latest"))
    manifest = read_manifest(out / "latents")
    assert manifest["complete"] and sum(r["pairs"] for r in manifest["shards"].values()) == 6
    assert len(manifest["shards"]) == 2  # the first run's shard kept, the missing pairs added beside it


@pytest.fixture(scope="module")
def store(tiny_model, pair_parquet, tmp_path_factory):  # noqa: F811

    folder = tmp_path_factory.mktemp("store") / "store"
    precompute.precompute(precompute.parse_args(["--model", tiny_model, "--dataset", pair_parquet, "--output",
                                                 str(folder), "--shard_size", "4", "--dtype", "float32"]))
    return folder


@pytest.mark.parametrize("damage,says", [
    ("resolution", "was changed after the store was written"),
    ("num_pairs", "was changed after the store was written"),
    ("truncate", "bytes, "),
    ("flip", "hash mismatch"),
    ("no digest", "carries no digest"),  # issue 61 finding 3: a 16 px store claiming 32 px, its digest deleted
])
def test_a_damaged_store_is_refused_before_the_run_folder_is_written(tiny_model, store, tmp_path, capsys, damage, says):
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    shard = copy / shard_name(1)
    resolution = 16
    if damage in ("resolution", "num_pairs"):
        manifest[damage] = manifest[damage] * 2 if damage == "resolution" else manifest[damage] - 1
        (copy / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "no digest":
        resolution = manifest["resolution"] = 32
        del manifest["digest"]
        (copy / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    out = tmp_path / "run"
    _main_fails(capsys, ["--model", tiny_model, "--latent_store", str(copy), "--output_dir", str(out), "--report_to",
                         "none", "--max_steps", "1", "--resolution", str(resolution)], "latent store", says)
    assert not out.exists()


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_latent_store_path_that_cannot_be_a_folder_is_one_line(tiny_model, pair_parquet, tmp_path, capsys, where):  # noqa: F811
    """Issue 61 finding 7: --latent_store naming a file ended in a NotADirectoryError traceback (with --dataset, when
    the store was about to be built), leaving the run folder behind."""
    afile = tmp_path / "notes.txt"
    afile.write_text("not a store\n")
    store = afile if where == "a file" else afile / "store"
    out = tmp_path / "run"
    _main_fails(capsys, ["--model", tiny_model, "--dataset", pair_parquet, "--latent_store", str(store), "--output_dir",
                         str(out), "--report_to", "none", "--max_steps", "1", "--resolution", "16"],
                "--latent_store", "folder")
    assert not out.exists()
    with pytest.raises(SystemExit) as exit_:
        precompute.main(["--model", tiny_model, "--dataset", pair_parquet, "--output", str(store)])
    assert exit_.value.code == 2 and "folder" in capsys.readouterr().err


# ------------------------------------------------------------------ a key in a variable of any name


def test_a_key_in_a_variable_named_by_api_key_env_is_masked_in_the_benchmarks_files(tmp_path, monkeypatch):
    key = "plain-words-credential-value-4417"  # no key shape, in a variable whose name says nothing of keys
    monkeypatch.setenv("MY_JUDGE_CRED", key)

    def echoing(prompt, images):
        first, second = (round(brightness(image), 4) for image in images)
        return json.dumps({"analysis": f"key {key} accepted", "better_image": 1 if first >= second else 2})

    with FakeJudgeServer("openai", answer=echoing, api_key=key) as server:
        spec = (f"gpt4o[model=fake-model,base_url={server.base_url},timeout=10,api_key_env=MY_JUDGE_CRED,"
                f"cache_path={tmp_path / 'cache' / 'answers.sqlite'}]")
        out = tmp_path / "bench"
        judgebench.main(["--judges", spec, "--testbed_pairs", "2", "--testbed_bias_groups", "0", "--output_dir", str(out)])
        assert server.calls
    written = [p for p in [*out.rglob("*"), *(tmp_path / "cache").rglob("*")] if p.is_file()]
    assert (out / "verdicts.jsonl") in written and "***" in (out / "verdicts.jsonl").read_text()
    assert [str(p) for p in written if key.encode() in p.read_bytes()] == []
    for db in (p for p in written if p.suffix == ".sqlite"):
        rows = sqlite3.connect(db).execute("SELECT raw FROM answers").fetchall()
        assert rows and all(key not in raw for (raw,) in rows)


# ------------------------------------------------------------------ a full disk, through the command


def test_a_full_disk_while_writing_a_checkpoint_ends_in_one_line(tiny_model, pair_parquet, tmp_path, monkeypatch, capsys):  # noqa: F811

    real = os.replace

    def full_at_the_checkpoint(src, dst):
        if Path(dst).name == "step_0000001":
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", full_at_the_checkpoint)
    out = tmp_path / "run"
    line = _main_fails(capsys, ["--model", tiny_model, "--dataset", pair_parquet, "--output_dir", str(out),
                                "--report_to", "none", "--max_steps", "1", "--finetune", "lora", "--lora_rank", "4",
                                "--resolution", "16", "--train_batch_size", "2", "--gradient_accumulation_steps", "1"],
                       "no space left", "--resume latest", code=3)
    assert "step_0000001" in line
    assert not (out / "checkpoints" / "step_0000001").exists()


def test_dataloader_workers_are_capped_at_the_cpus_in_one_line(capsys):
    assert capped_workers(0) == 0 and capped_workers(1) == 1
    assert capped_workers(100_000) == os.cpu_count()
    assert capsys.readouterr().out.strip() == (f"[data] --dataloader_num_workers 100000 is more than this machine's "
                                               f"{os.cpu_count()} CPUs; using {os.cpu_count()}")


def test_a_full_disk_ends_the_evaluation_commands_in_one_line_too(tmp_path, monkeypatch, capsys):
    real = os.replace

    def full(src, dst):
        if Path(dst).name == "leaderboard.csv":
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(SystemExit) as exit_:
        judgebench.main(["--judges", "random", "--testbed_pairs", "2", "--testbed_bias_groups", "0",
                         "--output_dir", str(tmp_path / "bench")])
    err = capsys.readouterr().err
    assert exit_.value.code == 3 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "no space left" in line and "leaderboard.csv" in line

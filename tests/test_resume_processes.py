"""--resume on another number of processes: allowed when processes x accumulation stays the run's (the same
micro-batches per optimiser step; the learning-rate schedule continues at the same step), and then exact; refused in
one line otherwise, naming the accumulation that would keep the step."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from align.run_folder import CHECKPOINT_STATE, RunFolder, RunFolderError, read_sealed, seal
from align.testing.noise_pairs import write_noise_pairs
from align.testing.two_processes import FSDP2, launch_two_cpu_processes
from align.testing.weights import assert_weights_close
from align.train import dpo
from align.train.dpo import DPOConfig
from align.train.resume import check_resume_settings, run_settings

# A warm-up longer than the run (the learning rate grows each step, whatever max_steps is): a schedule that continued
# at the wrong step on another number of processes would show in the learning rates and the weights.
SETTINGS = dict(finetune="lora", lora_rank=4, resolution=16, train_batch_size=1, learning_rate=1e-3, scale_lr=False,
                lr_scheduler="constant_with_warmup", lr_warmup_steps=4, beta=100.0, num_inference_steps=2, checkpointing_steps=1,
                report_to="none")


def saved_run(tmp_path: Path, processes: int, accumulation: int, sharded: bool = False) -> RunFolder:
    """A run folder with its config and a checkpoint written by ``processes`` processes (sharded by FSDP2 or not),
    recording the run's settings as the trainers' checkpoints do."""
    folder = tmp_path / "run"
    checkpoint = folder / "checkpoints" / "step_0000002"
    checkpoint.mkdir(parents=True)
    config = DPOConfig(model="m", dataset="d", output_dir=str(folder), gradient_accumulation_steps=accumulation)
    (folder / "config.yaml").write_text(yaml.safe_dump(asdict(config)))
    (checkpoint / CHECKPOINT_STATE).write_text(json.dumps(seal({
        "step": 2, "processes": processes, "sharded": sharded, "settings": run_settings(config), "files": {}})))
    return RunFolder(folder, resume="latest")


def resumed(run, accumulation: int) -> DPOConfig:
    return DPOConfig(model="m", dataset="d", output_dir=str(run.path), gradient_accumulation_steps=accumulation,
                     resume="latest")


def test_another_number_of_processes_resumes_only_with_the_runs_micro_batches_per_step(tmp_path, capsys):
    run = saved_run(tmp_path, processes=2, accumulation=2)
    check_resume_settings(run, resumed(run, 2), processes=2)  # the same launch
    check_resume_settings(run, resumed(run, 4), processes=1)  # 1 x 4 = 2 x 2
    check_resume_settings(run, resumed(run, 1), processes=4)
    assert "the same 4 micro-batches per optimiser step" in capsys.readouterr().out
    with pytest.raises(RunFolderError, match=r"launched on 2 processes x accumulation 2 .* run the same command with "
                                             r"--gradient_accumulation_steps 4, or as launched: on 2 processes"):
        check_resume_settings(run, resumed(run, 2), processes=1)  # would train half the pairs per step
    with pytest.raises(RunFolderError, match=r"3 processes x 1; to continue it, run the same command with "
                                             r"--gradient_accumulation_steps 2, on 2 processes \(accelerate launch"):
        check_resume_settings(run, resumed(run, 1), processes=3)
    with pytest.raises(RunFolderError, match="--gradient_accumulation_steps 2 \\(now 3\\)"):
        check_resume_settings(run, resumed(run, 3), processes=2)  # the same processes: the run's own accumulation


def test_an_edited_processes_record_is_not_believed(tmp_path):
    """Issue 61 finding 2: "processes": 1 written into a 2-process run's state.json resumed another run silently.
    The record's digest no longer matches: nothing is read from it, and a run whose checkpoints are all damaged is refused."""
    run = saved_run(tmp_path, processes=2, accumulation=1)
    state = run.checkpoints()[-1] / CHECKPOINT_STATE
    state.write_text(json.dumps({**json.loads(state.read_text()), "processes": 1}))
    with pytest.raises(RunFolderError, match="every checkpoint in .* is damaged .*changed after it was written"):
        check_resume_settings(run, resumed(run, 2), processes=1)  # the only checkpoint is not trusted, nor read


def test_a_sealed_checkpoint_from_before_the_settings_record_keeps_to_config_yaml(tmp_path):
    run = saved_run(tmp_path, processes=2, accumulation=1)
    (run.checkpoints()[-1] / CHECKPOINT_STATE).write_text(json.dumps(seal({"step": 2, "files": {}})))  # before both
    check_resume_settings(run, resumed(run, 1), processes=1)
    with pytest.raises(RunFolderError, match="--gradient_accumulation_steps 1 \\(now 2\\)"):
        check_resume_settings(run, resumed(run, 2), processes=1)


def test_a_sharded_checkpoint_on_another_layout_is_refused_naming_the_launch_that_reads_it(tmp_path):
    """Issue 61 finding 1: a 2-process FSDP2 checkpoint resumed on one process with --gradient_accumulation_steps 2
    ended in a FileNotFoundError traceback. The layout is refused first, with the launch that continues the run."""
    run = saved_run(tmp_path, processes=2, accumulation=1, sharded=True)
    with pytest.raises(RunFolderError) as refused:
        check_resume_settings(run, resumed(run, 2), processes=1, sharded=False)
    line = str(refused.value)
    assert "\n" not in line and "only an FSDP2 launch of 2 or more processes reads" in line
    assert "--gradient_accumulation_steps 1, on 2 processes under FSDP2 (accelerate launch --use_fsdp --fsdp_version 2 " \
           "--num_processes 2" in line
    check_resume_settings(run, resumed(run, 1), processes=2, sharded=True)  # what the line says
    unsharded = saved_run(tmp_path / "plain", processes=2, accumulation=1)
    with pytest.raises(RunFolderError, match="holds whole tensors, which an FSDP2 launch does not read"):
        check_resume_settings(unsharded, resumed(unsharded, 1), processes=2, sharded=True)


def test_the_checkpoints_record_is_the_truth_and_config_yaml_a_copy(tmp_path):
    """Issue 61 finding 2: a hand-edited config.yaml overrode what the checkpoint trained with."""
    run = saved_run(tmp_path, processes=1, accumulation=2)
    edited = yaml.safe_load((run.path / "config.yaml").read_text())
    (run.path / "config.yaml").write_text(yaml.safe_dump({**edited, "beta": 1.0, "gradient_accumulation_steps": 4}))
    check_resume_settings(run, resumed(run, 2), processes=1)  # the run's own flags still continue it
    with pytest.raises(RunFolderError, match=r"read from its checkpoint step_0000002\): --beta 5000.0 \(now 1.0\).* run "
                                             r"the same command with --beta 5000.0"):
        check_resume_settings(run, DPOConfig(model="m", dataset="d", output_dir=str(run.path), beta=1.0,
                                             gradient_accumulation_steps=2, resume="latest"), processes=1)


def launch(tiny_model, pairs, out: Path, processes: int, accumulation: int, max_steps: int, *extra: str,
           launcher_args=()):
    flags = {**SETTINGS, "gradient_accumulation_steps": accumulation, "max_steps": max_steps}
    argv = ["--model", tiny_model, "--dataset", pairs, "--output_dir", str(out),
            *[part for key, value in flags.items() for part in (f"--{key}", str(value))], *extra]
    return launch_two_cpu_processes("align/dpo.py", argv, timeout=400, launcher_args=launcher_args,
                                    num_processes=processes)


@pytest.mark.slow  # two two-process launches: ~40 s on the shared 2-core machine
def test_two_processes_resumed_on_one_with_doubled_accumulation_are_the_one_process_run(tiny_model, tmp_path, capsys):
    pairs = write_noise_pairs(tmp_path, 5, loser_seed_offset=50, alternate_labels=True)
    one = dpo.train(DPOConfig(model=tiny_model, dataset=pairs, output_dir=str(tmp_path / "one"),
                              gradient_accumulation_steps=2, max_steps=3, **SETTINGS))
    out = tmp_path / "moved"
    assert launch(tiny_model, pairs, out, 2, 1, 2).returncode == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # one process, the run's accumulation: half the pairs per step
        dpo.main(["--model", tiny_model, "--dataset", pairs, "--output_dir", str(out), "--max_steps", "3",
                  "--resume", "latest", *[part for key, value in SETTINGS.items() for part in (f"--{key}", str(value))]])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "resume with --gradient_accumulation_steps 2" in err
    done = dpo.train(DPOConfig(model=tiny_model, dataset=pairs, output_dir=str(out), gradient_accumulation_steps=2,
                               max_steps=3, resume="latest", **SETTINGS))
    a = load_file(str(one / "final" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(done / "final" / "pytorch_lora_weights.safetensors"))
    for key in a:  # DDP's all-reduce of 2 and accumulation of 2 add the same two terms: equal, measured bitwise
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-9)
    lrs = [json.loads(line)["lr"] for line in (done / "metrics.jsonl").read_text().splitlines()]
    assert lrs == [json.loads(line)["lr"] for line in (one / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # three launches, one of four processes: ~60 s
def test_fsdp2_resumed_on_four_processes_continues_the_two_process_run(tiny_model, tmp_path):
    pairs = write_noise_pairs(tmp_path, 5, loser_seed_offset=50, alternate_labels=True)
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    assert launch(tiny_model, pairs, straight, 2, 2, 3, launcher_args=FSDP2).returncode == 0
    assert launch(tiny_model, pairs, moved, 2, 2, 2, launcher_args=FSDP2).returncode == 0
    result = launch(tiny_model, pairs, moved, 4, 1, 3, "--resume", "latest", launcher_args=FSDP2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharded over 4 processes" in result.stdout  # torch.distributed.checkpoint re-sharded 2 -> 4
    a = load_file(str(straight / "final" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(moved / "final" / "pytorch_lora_weights.safetensors"))
    assert_weights_close(a, b)  # four processes reduce in another order than two with accumulation


@pytest.mark.slow  # two two-process FSDP2 launches: ~60 s on the shared 2-core machine
def test_an_fsdp2_run_resumed_on_one_process_is_refused_and_the_line_it_prints_continues_it(tiny_model, tmp_path, capsys):
    """Issue 61 finding 1: a 2 x 1 FSDP2 run resumed on one process with --gradient_accumulation_steps 2 ended in a
    FileNotFoundError traceback after rewriting config.yaml, and the advice of the next refusal trained 2 x 2."""
    pairs = write_noise_pairs(tmp_path, 5, loser_seed_offset=50, alternate_labels=True)
    out = tmp_path / "run"
    assert launch(tiny_model, pairs, out, 2, 1, 1, launcher_args=FSDP2).returncode == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".run.lock"}
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        dpo.main(["--model", tiny_model, "--dataset", pairs, "--output_dir", str(out), "--max_steps", "2", "--resume",
                  "latest", *[part for key, value in {**SETTINGS, "gradient_accumulation_steps": 2}.items()
                              for part in (f"--{key}", str(value))]])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "--gradient_accumulation_steps 1, on 2 processes under FSDP2 (accelerate launch --use_fsdp --fsdp_version 2 " \
           "--num_processes 2" in err
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".run.lock"} == before
    result = launch(tiny_model, pairs, out, 2, 1, 2, "--resume", "latest", launcher_args=FSDP2)  # what the line says
    assert result.returncode == 0, result.stderr[-3000:]
    state = read_sealed(out / "checkpoints" / "step_0000002" / CHECKPOINT_STATE)
    assert (state["processes"], state["sharded"], state["settings"]["gradient_accumulation_steps"]) == (2, True, 1)
    assert yaml.safe_load((out / "config.yaml").read_text())["gradient_accumulation_steps"] == 1

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

from align.run_folder import CHECKPOINT_STATE, RunFolder, RunFolderError, seal
from align.testing.noise_pairs import write_noise_pairs
from align.testing.two_processes import FSDP2, launch_two_cpu_processes
from align.testing.weights import assert_weights_close
from align.train import dpo
from align.train.checkpoints import check_resume_settings
from align.train.dpo import DPOConfig

# A warm-up longer than the run (the learning rate grows each step, whatever max_steps is): a schedule that continued
# at the wrong step on another number of processes would show in the learning rates and the weights.
SETTINGS = dict(finetune="lora", lora_rank=4, resolution=16, train_batch_size=1, learning_rate=1e-3, scale_lr=False,
                lr_scheduler="constant_with_warmup", lr_warmup_steps=4, beta=100.0, num_inference_steps=2, checkpointing_steps=1,
                report_to="none")


def saved_run(tmp_path: Path, processes: int, accumulation: int) -> RunFolder:
    """A run folder with its config and a checkpoint written by ``processes`` processes."""
    folder = tmp_path / "run"
    checkpoint = folder / "checkpoints" / "step_0000002"
    checkpoint.mkdir(parents=True)
    config = DPOConfig(model="m", dataset="d", output_dir=str(folder), gradient_accumulation_steps=accumulation)
    (folder / "config.yaml").write_text(yaml.safe_dump(asdict(config)))
    (checkpoint / CHECKPOINT_STATE).write_text(json.dumps(seal({"step": 2, "processes": processes, "files": {}})))
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
    with pytest.raises(RunFolderError, match=r"launched on 2 processes x accumulation 2 .* resume with "
                                             r"--gradient_accumulation_steps 4 \(or on 2 processes\)"):
        check_resume_settings(run, resumed(run, 2), processes=1)  # would train half the pairs per step
    with pytest.raises(RunFolderError, match="a number of processes that divides 4"):
        check_resume_settings(run, resumed(run, 1), processes=3)
    with pytest.raises(RunFolderError, match="--gradient_accumulation_steps 2 \\(now 3\\)"):
        check_resume_settings(run, resumed(run, 3), processes=2)  # the same processes: the run's own accumulation


def test_an_edited_processes_record_is_not_believed(tmp_path):
    """Issue 61 finding 2: "processes": 1 written into a 2-process run's state.json resumed another run silently.
    The record's digest no longer matches: the count is not read from it (and resume skips that checkpoint)."""
    run = saved_run(tmp_path, processes=2, accumulation=1)
    state = run.checkpoints()[-1] / CHECKPOINT_STATE
    state.write_text(json.dumps({**json.loads(state.read_text()), "processes": 1}))
    with pytest.raises(RunFolderError, match="--gradient_accumulation_steps 1 \\(now 2\\)"):
        check_resume_settings(run, resumed(run, 2), processes=1)  # 1 x 2 is not this run's 2 x 1 as far as it knows
    assert run.resume_checkpoint() is None  # the only checkpoint is not trusted: resume does not read it


def test_a_run_from_before_the_processes_record_resumes_as_before(tmp_path):
    run = saved_run(tmp_path, processes=2, accumulation=1)
    (run.checkpoints()[-1] / CHECKPOINT_STATE).write_text(json.dumps({"step": 2, "files": {}}))  # before the record
    check_resume_settings(run, resumed(run, 1), processes=1)
    with pytest.raises(RunFolderError, match="--gradient_accumulation_steps 1 \\(now 2\\)"):
        check_resume_settings(run, resumed(run, 2), processes=1)


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

"""Mixed precision as the launcher says, and the reference / behaviour policy computed exactly as the policy."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
from safetensors.torch import load_file

from align.cli import ConfigError
from align.families.sd import StableDiffusion
from align.pipeline import cast_frozen, load_pipeline
from align.testing.noise_pairs import write_noise_pairs
from align.train import ddpo, dpo, trained_model
from align.train.accelerator import (
    cpu_launch_lost_its_processes,
    refuse_unsupported_distribution,
    refuse_unsupported_launch,
    resolve_mixed_precision,
)
from align.train.ddpo import DDPOConfig
from align.train.dpo import DPOConfig


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_noise_pairs(tmp_path_factory.mktemp("pairs"), 8)


def first_step(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


# ------------------------------------------------------------------ which precision


def test_flag_beats_the_launcher_which_beats_the_default():
    launched = {"ACCELERATE_MIXED_PRECISION": "fp16"}
    assert resolve_mixed_precision("bf16", launched) == "bf16"
    assert resolve_mixed_precision("no", launched) == "no"
    assert resolve_mixed_precision(None, launched) == "fp16"
    assert resolve_mixed_precision(None, {"ACCELERATE_MIXED_PRECISION": "BF16"}) == "bf16"
    assert resolve_mixed_precision(None, {}) == "no"
    with pytest.raises(ConfigError, match="ACCELERATE_MIXED_PRECISION.*'fp8'"):
        resolve_mixed_precision(None, {"ACCELERATE_MIXED_PRECISION": "fp8"})


def test_deepspeed_and_fsdp1_are_refused_with_what_works(monkeypatch, tmp_path, capsys, tiny_model, pairs):
    with pytest.raises(ConfigError, match="not supported.*multi-process data parallel.*FSDP2"):
        refuse_unsupported_launch({"ACCELERATE_USE_DEEPSPEED": "true"})
    refuse_unsupported_launch({"ACCELERATE_USE_DEEPSPEED": "false"})
    with pytest.raises(ConfigError, match="FSDP version 1 .* fsdp_version: 2"):
        refuse_unsupported_launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})
    with pytest.raises(ConfigError, match="--gradient_checkpointing"):
        refuse_unsupported_launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                                   "FSDP_ACTIVATION_CHECKPOINTING": "true"})
    refuse_unsupported_launch({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})  # FSDP2: tests/test_sharding.py

    class Launched:
        distributed_type = "DEEPSPEED"
        is_main_process = True

    with pytest.raises(ConfigError, match="DEEPSPEED is not supported"):
        refuse_unsupported_distribution(Launched())

    # through the command line: one line, exit 2, nothing written
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    out = tmp_path / "fsdp"
    with pytest.raises(SystemExit) as exit_:
        dpo.main(["--model", tiny_model, "--dataset", pairs, "--output-dir", str(out), "--report_to", "none"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "FSDP version 1 " in err
    assert not out.exists()


@pytest.mark.slow  # the suite's time budget on the 2-core CI machine
def test_a_cpu_launch_of_several_processes_that_runs_one_is_refused(tiny_model, pairs, tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts the script once (accelerate's simple launcher): a run that
    silently trains one process with half the pairs per step was issue 49's "two processes != one process"."""
    alone = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert cpu_launch_lost_its_processes(alone)
    assert not cpu_launch_lost_its_processes({**alone, "WORLD_SIZE": "2", "RANK": "0"})  # torch's launcher: really N
    assert not cpu_launch_lost_its_processes({**alone, "PMI_SIZE": "2"})  # mpirun
    assert not cpu_launch_lost_its_processes({"ACCELERATE_USE_CPU": "True"})  # --cpu, one process asked for
    assert not cpu_launch_lost_its_processes({"MASTER_ADDR": "127.0.0.1"})

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(root / "align" / "dpo.py"),
           "--model", tiny_model, "--dataset", pairs, "--output-dir", str(out), "--report_to", "none"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode != 0 and "error: `accelerate launch --cpu --num_processes N` starts one process" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("trainer", ["ddpo", "train_reward"])
def test_the_other_trainers_refuse_a_cpu_launch_that_runs_alone(trainer, tiny_model, tmp_path, monkeypatch, capsys):
    """The online-RL trainer and the reward-model trainer build their Accelerator the same way: the same line."""
    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    out = tmp_path / trainer
    argv = (["--model", tiny_model, "--reward", "jpeg-compressibility", "--prompts", "testbed:4"] if trainer == "ddpo"
            else ["--dataset", write_noise_pairs(tmp_path, 4)])
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module({"ddpo": "align.train.ddpo", "train_reward": "align.train.reward_model"}[trainer]).main([*argv, "--output-dir", str(out), "--report_to", "none"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "starts one process whatever N says" in err
    assert not out.exists()


# ------------------------------------------------------------------ DPO: the first step is ln 2


def dpo_config(tiny_model, pairs, out, **overrides) -> DPOConfig:
    settings = dict(model=tiny_model, dataset=pairs, output_dir=str(out), resolution=None, train_batch_size=4,
                    gradient_accumulation_steps=1, max_steps=1, learning_rate=1e-3, scale_lr=False, lr_warmup_steps=0,
                    beta=5000.0, caption_dropout=0.0, num_inference_steps=2, checkpointing_steps=10,
                    report_to="none", lora_rank=4)
    return DPOConfig(**{**settings, **overrides})


@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_bf16_dpo_first_loss_is_ln2_with_the_reference_run_as_the_policy(tiny_model, pairs, tmp_path, finetune, monkeypatch, capsys):
    # bf16 from the launcher's setting (what `accelerate launch --mixed_precision bf16` exports), no flag
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    run = dpo.train(dpo_config(tiny_model, pairs, tmp_path / finetune, finetune=finetune))
    assert "[dpo] mixed precision: bf16 (from accelerate's setting)" in capsys.readouterr().out
    assert yaml.safe_load((run / "config.yaml").read_text())["mixed_precision"] == "bf16"  # recorded as resolved
    step = first_step(run)
    assert abs(step["loss"] - math.log(2)) < 1e-3 and step["implicit_acc"] != 1.0
    assert step["model_mse"] == step["ref_mse"]
    # and bf16 really ran: the policy's error differs from a float32 run's
    fp32 = first_step(dpo.train(dpo_config(tiny_model, pairs, tmp_path / f"{finetune}-fp32", finetune=finetune,
                                           mixed_precision="no")))
    assert fp32["model_mse"] != step["model_mse"]


def test_accelerate_launch_mixed_precision_reaches_the_trainer(tiny_model, pairs, tmp_path):
    """The issue's command: `accelerate launch --mixed_precision bf16 align/dpo.py ...` without the trainer's flag."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "launched"
    argv = ["--model", tiny_model, "--dataset", pairs, "--output-dir", str(out), "--finetune", "full", "--resolution", "16",
            "--train_batch_size", "4", "--gradient_accumulation_steps", "1", "--max_steps", "1", "--learning_rate", "1e-3",
            "--scale_lr", "false", "--lr_warmup_steps", "0", "--caption_dropout", "0", "--checkpointing_steps", "10",
            "--report_to", "none"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "bf16", "--dynamo_backend", "no", str(root / "align" / "dpo.py"), *argv]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[dpo] mixed precision: bf16 (from accelerate's setting)" in result.stdout
    step = first_step(out)
    assert abs(step["loss"] - math.log(2)) < 1e-3 and step["implicit_acc"] != 1.0


# ------------------------------------------------------------------ DDPO: each round's first minibatch is on-policy


def ddpo_config(tiny_model, out, **overrides) -> DDPOConfig:
    # one optimiser step per epoch: every logged PPO statistic is that of the round's first minibatch
    settings = dict(model=tiny_model, reward="jpeg-compressibility", prompts="testbed:4", output_dir=str(out),
                    report_to="none", num_inference_steps=4, samples_per_epoch=4, sample_batch_size=2, train_batch_size=4,
                    gradient_accumulation_steps=1, num_epochs=3, checkpointing_epochs=3, learning_rate=1e-2, clip_range=1e-4, guidance_scale=5.0, mixed_precision="bf16")
    return DDPOConfig(**{**settings, **overrides})


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_bf16_ddpo_rounds_start_exactly_on_policy(tiny_model, tmp_path, finetune):
    run = ddpo.train(ddpo_config(tiny_model, tmp_path / finetune, finetune=finetune, kl_coef=0.1))
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(epochs) == 3
    # rounds 2 and 3 sample from a trained LoRA: a sampler that folds it into bf16 weights would be off-policy there
    assert [e["clipfrac"] for e in epochs] == [0.0, 0.0, 0.0]
    assert [e["approx_kl"] for e in epochs] == [0.0, 0.0, 0.0]
    assert epochs[-1]["kl_to_reference"] > 0  # and it trained (the PPO term of zero-mean advantages at ratio 1 is 0)


def test_ddpo_gradient_checkpointing_trains_the_same_weights(tiny_model, tmp_path):
    plain = ddpo.train(ddpo_config(tiny_model, tmp_path / "plain", num_epochs=1, checkpointing_epochs=1, mixed_precision="no"))
    saved = ddpo.train(ddpo_config(tiny_model, tmp_path / "ckpt", num_epochs=1, checkpointing_epochs=1, mixed_precision="no",
                                   gradient_checkpointing=True))
    a, b = (load_file(str(r / "final" / "pytorch_lora_weights.safetensors")) for r in (plain, saved))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ switches


def test_8bit_adam_without_bitsandbytes_is_refused_before_loading(tiny_model, pairs, tmp_path, capsys):
    try:

        pytest.skip("bitsandbytes is installed here")
    except ImportError:
        pass
    with pytest.raises(SystemExit) as exit_:
        ddpo.main(["--model", tiny_model, "--prompts", "testbed:4", "--reward", "jpeg-compressibility", "--use_8bit_adam",
                   "true", "--output-dir", str(tmp_path / "o"), "--report_to", "none"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--use_8bit_adam needs bitsandbytes" in err and not (tmp_path / "o").exists()


def test_another_attention_processor_is_put_back_to_sdpa(tiny_model):
    unet = UNet2DConditionModel.from_pretrained(Path(tiny_model) / "unet")
    assert all(isinstance(p, AttnProcessor2_0) for p in unet.attn_processors.values())  # diffusers' default
    unet.set_attn_processor(AttnProcessor())
    StableDiffusion().set_training_attention(unet)
    assert unet.attn_processors and all(isinstance(p, AttnProcessor2_0) for p in unet.attn_processors.values())


def test_ddpo_full_fine_tuning_keeps_the_frozen_parts_in_the_compute_dtype(tiny_model, tmp_path, monkeypatch):
    """Full fine-tuning loads the pipeline in fp32 for its denoiser; the text encoder and VAE then run in bf16, as
    under LoRA (for SD3.5 Large and FLUX that is ~10 GiB per process: docs/scale.md)."""
    loaded = []

    def recording(*args, **kwargs):
        loaded.append(load_pipeline(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(trained_model, "load_pipeline", recording)
    ddpo.train(ddpo_config(tiny_model, tmp_path / "full", finetune="full", num_epochs=1, checkpointing_epochs=1))
    pipe = loaded[0]
    assert {p.dtype for p in pipe.text_encoder.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in pipe.vae.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in pipe.unet.parameters()} == {torch.float32}  # trained in fp32


def test_a_frozen_part_is_cast_as_from_pretrained_would_load_it():
    class Block(torch.nn.Module):
        _keep_in_fp32_modules = ["wo"]  # as T5 keeps its feed-forward output in fp32

        def __init__(self):
            super().__init__()
            self.wi, self.wo = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2))

    block = Block()
    cast_frozen(block, torch.float32)  # nothing to do
    assert {p.dtype for p in block.parameters()} == {torch.float32}
    cast_frozen(block, torch.bfloat16)
    assert block.wi.weight.dtype == block.scale.dtype == torch.bfloat16
    assert block.wo.weight.dtype == block.wo.bias.dtype == torch.float32

"""FSDP2 (align/train/sharding.py) as two CPU processes over gloo: full fine-tuning with both trainers equals one
process with doubled accumulation; the consolidated final weights load in diffusers and equal the trained (sharded)
state; a kill -9 of every process plus --resume latest finishes bit-identical to the uninterrupted run; the frozen
reference and the old policy are sharded, not held whole."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from align.testing.nodes import kill_with_its_workers
from align.testing.noise_pairs import write_noise_pairs
from align.testing.two_processes import FSDP2, ROOT, launch_two_cpu_processes, two_cpu_processes_command
from align.testing.weights import assert_weights_close
from align.train import ddpo, dpo
from align.train.ddpo import DDPOConfig
from align.train.dpo import DPOConfig

DPO_SETTINGS = dict(finetune="full", resolution=16, train_batch_size=1, learning_rate=1e-3, scale_lr=False,
                    lr_warmup_steps=0, beta=100.0, num_inference_steps=2, checkpointing_steps=1, report_to="none")
DDPO_SETTINGS = dict(finetune="full", reward="jpeg-compressibility", report_to="none", num_inference_steps=4,
                     samples_per_epoch=8, sample_batch_size=2, train_batch_size=2, timestep_fraction=0.5,
                     learning_rate=1e-3, clip_range=0.2, checkpointing_epochs=1)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_noise_pairs(tmp_path_factory.mktemp("pairs"), 5, loser_seed_offset=50, alternate_labels=True)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\na green triangle\n")
    return str(path)


def argv_of(flags: dict) -> list[str]:
    return [part for key, value in flags.items() for part in (f"--{key}", str(value))]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def unet_state(folder: Path) -> dict[str, torch.Tensor]:
    return UNet2DConditionModel.from_pretrained(folder).state_dict()


def sharded_checkpoint_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model shards a checkpoint holds, put together offline (torch.distributed.checkpoint's own converter)."""
    whole = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(str(checkpoint / "pytorch_model_fsdp_0"), str(whole))
    return torch.load(whole, weights_only=False)["model"]


def launch_sharded(script: str, inputs: list[str], out: Path, flags: dict, *extra: str) -> subprocess.CompletedProcess:
    """Two processes under FSDP2, accumulation 1."""
    argv = [*inputs, "--output_dir", str(out), *argv_of({**flags, "gradient_accumulation_steps": 1}), *extra]
    result = launch_two_cpu_processes(script, argv, timeout=400, launcher_args=FSDP2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FSDP2: the trained model, its gradients and optimiser states sharded over 2 processes" in result.stdout
    return result


def launch_dpo(tiny_model, pairs, out: Path, max_steps: int, *extra: str) -> subprocess.CompletedProcess:
    return launch_sharded("align/dpo.py", ["--model", tiny_model, "--dataset", pairs], out,
                          {**DPO_SETTINGS, "max_steps": max_steps}, *extra)


@pytest.fixture(scope="module")
def fsdp_dpo_run(tiny_model, pairs, tmp_path_factory):
    """Three steps of full-fine-tuning DPO, two processes, FSDP2, uninterrupted."""
    out = tmp_path_factory.mktemp("fsdp_dpo") / "run"
    launch_dpo(tiny_model, pairs, out, 3)
    return out


def test_fsdp2_full_dpo_equals_one_process_and_its_final_weights_are_the_trained_state(tiny_model, pairs,
                                                                                       fsdp_dpo_run, tmp_path):
    one = dpo.train(DPOConfig(model=tiny_model, dataset=pairs, output_dir=str(tmp_path / "one"),
                              gradient_accumulation_steps=2, max_steps=3, **DPO_SETTINGS))
    single, sharded = metrics(one), metrics(fsdp_dpo_run)
    assert [m["step"] for m in sharded] == [1, 2, 3]
    for a, b in zip(single, sharded):  # the same pairs, noise and timesteps at every step
        for key in ("loss", "model_mse_w", "model_mse_l", "ref_mse_w", "ref_mse_l"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)

    # Checkpoints hold each process's shard (torch.distributed.checkpoint), sealed like any other checkpoint.
    last = fsdp_dpo_run / "checkpoints" / "step_0000003"
    assert (last / "pytorch_model_fsdp_0").is_dir() and len(list((last / "pytorch_model_fsdp_0").glob("*.distcp"))) == 2
    # The final unet/ is the diffusers folder of the whole model: it loads, equals the sharded trained state
    # exactly, and the one-process run's weights within float tolerance.
    final = unet_state(fsdp_dpo_run / "final" / "unet")
    trained = sharded_checkpoint_state(last)
    assert final.keys() == trained.keys()
    assert all(torch.equal(final[k], trained[k]) for k in final)
    base = unet_state(Path(tiny_model) / "unet")
    assert any(not torch.equal(final[k], base[k]) for k in final)  # it trained
    assert_weights_close(unet_state(one / "final" / "unet"), final)


def kill_when(launch: subprocess.Popen, ready: Path, timeout: float = 300) -> str:
    """kill -9 the launcher and both workers once ``ready`` exists; returns how the run ended (a fast machine may
    finish it first: the resume then has nothing left to train, and must still end as the straight run)."""
    deadline = time.monotonic() + timeout
    while not ready.exists() and launch.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if launch.poll() is not None:
        return f"finished (exit {launch.returncode}) before the kill"
    kill_with_its_workers(launch)
    return "killed"


@pytest.mark.slow  # two two-process launches after the module's run: ~40 s on the shared 2-core machine
def test_fsdp2_dpo_killed_and_resumed_finishes_bit_identical(tiny_model, pairs, fsdp_dpo_run, tmp_path):
    out = tmp_path / "run"
    argv = ["--model", tiny_model, "--dataset", pairs, "--output-dir", str(out),
            *argv_of({**DPO_SETTINGS, "gradient_accumulation_steps": 1, "max_steps": 3})]
    cmd, env = two_cpu_processes_command("align/dpo.py", argv, FSDP2)
    launch = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended = kill_when(launch, out / "checkpoints" / "step_0000001" / "state.json")
    assert ended == "killed" or ended.startswith("finished (exit 0)"), ended
    launch_dpo(tiny_model, pairs, out, 3, "--resume", "latest")

    straight = unet_state(fsdp_dpo_run / "final" / "unet")
    resumed = unet_state(out / "final" / "unet")
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    assert metrics(out) == [{**m, "pairs_per_second": r["pairs_per_second"]}
                            for m, r in zip(metrics(fsdp_dpo_run), metrics(out))]


def launch_ddpo(tiny_model, prompt_file, out: Path, num_epochs: int, *extra: str) -> subprocess.CompletedProcess:
    return launch_sharded("align/ddpo.py", ["--model", tiny_model, "--prompts", prompt_file], out,
                          {**DDPO_SETTINGS, "num_epochs": num_epochs}, *extra)


def final_denoiser(run: Path) -> dict[str, torch.Tensor]:
    folder = next(f for f in (run / "final" / "unet", run / "final" / "transformer") if f.is_dir())
    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


@pytest.mark.parametrize("family, algorithm, extra", [
    ("sd", "ppo", {"kl_coef": 0.1}),  # DDPO with the frozen KL reference, sharded
    # the old policy, sharded and checkpointed: stopped after epoch 1 and resumed
    pytest.param("sd", "nft", {"sampler": "ddim"}, marks=pytest.mark.slow),
    # Flow-GRPO on SD3's joint-attention blocks as units (a process left with fewer micro-batches by the zero-advantage
    # rule runs weight-0 ones: tests/test_ddpo_train.py::test_under_fsdp2_a_process_with_fewer_micro_batches_...)
    pytest.param("sd3", "ppo", {"advantage": "group-mean", "images_per_prompt": 2}, marks=pytest.mark.slow),
])
def test_fsdp2_full_online_rl_equals_one_process(tiny_model, family_models, prompt_file, tmp_path, family, algorithm,
                                                 extra):
    model = tiny_model if family == "sd" else family_models(family)
    one = ddpo.train(DDPOConfig(model=model, prompts=prompt_file, output_dir=str(tmp_path / "one"),
                                gradient_accumulation_steps=2, num_epochs=2, algorithm=algorithm, **extra,
                                **DDPO_SETTINGS))
    two = tmp_path / "two"
    flags = ["--algorithm", algorithm, *argv_of(extra)]
    if algorithm == "nft":
        launch_ddpo(model, prompt_file, two, 1, *flags)
        launch_ddpo(model, prompt_file, two, 2, *flags, "--resume", "latest")
    else:
        launch_ddpo(model, prompt_file, two, 2, *flags)
    for a, b in zip(metrics(one), metrics(two), strict=True):  # the same samples, rewards and updates
        for key in ("reward_mean", "reward_std", "trained_sample_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["epoch"], key)
    assert_weights_close(final_denoiser(one), final_denoiser(two))


@pytest.mark.slow  # one two-process launch: ~20 s
def test_fsdp2_lora_dpo_saves_a_lora_that_loads(tiny_model, pairs, tmp_path):
    out = tmp_path / "lora"
    launch_dpo(tiny_model, pairs, out, 2, "--finetune", "lora", "--lora_rank", "4")
    one = dpo.train(DPOConfig(model=tiny_model, dataset=pairs, output_dir=str(tmp_path / "one"),
                              gradient_accumulation_steps=2, max_steps=2, **{**DPO_SETTINGS, "finetune": "lora",
                                                                              "lora_rank": 4}))
    sharded = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    single = load_file(str(one / "final" / "pytorch_lora_weights.safetensors"))
    assert sharded.keys() == single.keys() and all("lora" in k for k in sharded)
    for key in single:
        torch.testing.assert_close(sharded[key], single[key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # one two-process launch and one run in this process: ~30 s
def test_fsdp2_ai_feedback_and_held_out_scores_come_from_the_gathered_model(tiny_model, prompt_file, tmp_path):
    """The main process generates alone on the weights every process gathered for it: the first round's feedback
    and the score before training are the one-process run's; later rounds and evaluations run too."""
    flags = {**DPO_SETTINGS, "reward": "jpeg-compressibility", "prompts": prompt_file, "images_per_prompt": 2,
             "feedback_rounds": 2, "max_steps": 2, "eval_prompts": prompt_file, "eval_every_steps": 1}
    one = dpo.train(DPOConfig(model=tiny_model, output_dir=str(tmp_path / "one"), gradient_accumulation_steps=2, **flags))
    two = tmp_path / "two"
    launch_sharded("align/dpo.py", ["--model", tiny_model], two, flags)

    def first_round(run: Path) -> list[dict]:
        return pq.read_table(run / "feedback" / "round_1" / "pairs.parquet").drop_columns(["jpg_0", "jpg_1"]).to_pylist()

    assert first_round(two) == first_round(one)
    before = [json.loads((run / "eval_before.json").read_text())["scores"] for run in (one, two)]
    assert before[1] == pytest.approx(before[0], rel=1e-6)
    assert (two / "feedback" / "round_2" / "pairs.parquet").is_file() and (two / "eval_after.json").is_file()
    assert [m["step"] for m in metrics(two)] == [1, 2] and "heldout_score" in metrics(two)[0]

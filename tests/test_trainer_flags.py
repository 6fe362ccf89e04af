"""Behaviour of trainer flags no other test exercises: weight decay, sample logging, checkpoint rotation,
latent caching, the held-out judge."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from align.train import ddpo, dpo
from align.train.ddpo_config import DDPOConfig
from align.train.dpo_config import DPOConfig


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\na green triangle\n")
    return str(path)


def ddpo_config(tiny_model, prompt_file, out, **overrides) -> DDPOConfig:
    base = dict(model=tiny_model, reward="jpeg-compressibility", prompts=prompt_file, output_dir=str(out),
                report_to="none", num_inference_steps=4, samples_per_epoch=4, sample_batch_size=2, train_batch_size=2,
                gradient_accumulation_steps=2, timestep_fraction=0.5, num_epochs=1, checkpointing_epochs=1,
                learning_rate=1e-3, clip_range=0.2)
    base.update(overrides)
    return DDPOConfig(**base)


def dpo_config(tiny_model, prompt_file, out, **overrides) -> DPOConfig:
    base = dict(model=tiny_model, reward="jpeg-compressibility", prompts=prompt_file, output_dir=str(out),
                finetune="lora", lora_rank=4, resolution=None, train_batch_size=2, gradient_accumulation_steps=1,
                max_steps=1, learning_rate=1e-3, scale_lr=False, lr_warmup_steps=0, beta=100.0, num_inference_steps=2,
                guidance_scale=2.0, checkpointing_steps=1, report_to="none")
    base.update(overrides)
    return DPOConfig(**base)


def lora_weights(run):
    return load_file(str(run / "final" / "pytorch_lora_weights.safetensors"))


@pytest.mark.parametrize("trainer", ["ddpo", "dpo"])
def test_weight_decay_shrinks_the_lora_A_matrices_on_the_first_step(trainer, tiny_model, prompt_file, tmp_path):
    # LoRA's B starts at 0, so A's gradient on the first step is exactly 0: without decay A stays at its
    # initial value, with AdamW's decoupled decay it is that value times (1 - lr x decay); B gets the same step.
    make, train = (ddpo_config, ddpo.train) if trainer == "ddpo" else (dpo_config, dpo.train)
    plain = lora_weights(train(make(tiny_model, prompt_file, tmp_path / "plain", adam_weight_decay=0.0)))
    decayed = lora_weights(train(make(tiny_model, prompt_file, tmp_path / "decay", adam_weight_decay=50.0)))
    a_keys = [k for k in plain if ".lora.down." in k]  # diffusers' file names A "down" and B "up"
    assert a_keys and len(a_keys) * 2 == len(plain)
    for key in plain:
        if key in a_keys:
            torch.testing.assert_close(decayed[key], plain[key] * (1 - 1e-3 * 50.0), rtol=1e-5, atol=1e-8)
        else:
            torch.testing.assert_close(decayed[key], plain[key], rtol=0, atol=0)
    assert any(float(plain[k].abs().max()) > 0 for k in plain if k not in a_keys)  # B did move


def test_ddpo_logs_samples_at_checkpoint_epochs_and_keeps_checkpoints_total_limit(tiny_model, prompt_file, tmp_path):
    run = ddpo.train(ddpo_config(tiny_model, prompt_file, tmp_path / "run", num_epochs=5, gradient_accumulation_steps=1,
                                 checkpointing_epochs=2, checkpoints_total_limit=2))
    # The first epoch (a baseline), every checkpoint epoch, and the last; this process's images, at most 8.
    assert sorted(p.name for p in (run / "samples").glob("*.png")) == ["epoch_00001.png", "epoch_00002.png",
                                                                         "epoch_00004.png", "epoch_00005.png"]
    assert len(json.loads((run / "samples" / "epoch_00002.json").read_text())) == 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000004", "step_0000005"]


def test_dpo_keeps_checkpoints_total_limit(tiny_model, prompt_file, tmp_path):
    run = dpo.train(dpo_config(tiny_model, prompt_file, tmp_path / "run", max_steps=3, checkpoints_total_limit=1))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_0000003"]


def test_ddpo_eval_judge_scores_the_held_out_images_instead_of_the_reward(tiny_model, prompt_file, tmp_path):
    # Before training both runs hold the base model and draw the same held-out images (eval_seed): the
    # incompressibility judge's scores are exactly minus the compressibility reward's.
    settings = dict(eval_prompts=prompt_file, num_epochs=1)
    by_reward = ddpo.train(ddpo_config(tiny_model, prompt_file, tmp_path / "reward", **settings))
    by_judge = ddpo.train(ddpo_config(tiny_model, prompt_file, tmp_path / "judge", eval_judge="jpeg-incompressibility",
                                      **settings))
    before = [json.loads((run / "eval_before.json").read_text())["scores"] for run in (by_reward, by_judge)]
    assert len(before[0]) == 3 and before[1] == pytest.approx([-s for s in before[0]], abs=0)

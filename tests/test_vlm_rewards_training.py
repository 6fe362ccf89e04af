"""The flow-RL papers' VLM rewards train: DDPO on the bundled testbed pipeline for one epoch with a tiny
VQAScore (P("Yes") from a Qwen2.5-VL), a tiny UnifiedReward (pointwise "Final Score") and a tiny HPSv3 (mu) as
the reward, each loaded by its registered name, as a user would pass it to --reward. Their scores against the
authors' code are pinned in test_vqascore.py, test_unifiedreward.py and test_hpsv3.py."""

from __future__ import annotations

import json

import pytest

from align.testing.tiny_hpsv3 import build_hpsv3
from align.testing.tiny_vlms import build_qwen25_vl, build_vqascore_qwen
from align.train import ddpo
from align.train.ddpo import DDPOConfig


def _reward_spec(kind: str, folder) -> str:
    if kind == "vqascore":
        build_vqascore_qwen(folder)
        return f"vqascore-hf:{folder}"
    if kind == "unifiedreward":
        build_qwen25_vl(folder, constant_answer=True)  # greedy answer "7": every image scores 7
        return f"unifiedreward-hf:{folder}[max_tokens=2]"
    base, checkpoint = build_hpsv3(folder)
    return f"hpsv3[model={checkpoint},base={base}]"


@pytest.mark.parametrize("kind", ["vqascore", "unifiedreward", "hpsv3"])
def test_ddpo_trains_one_epoch_on_the_reward(kind, tmp_path):
    reward = _reward_spec(kind, tmp_path / kind)
    config = DDPOConfig(model="testbed", reward=reward, prompts="testbed:4", output_dir=str(tmp_path / "run"),
                        report_to="none", num_inference_steps=3, samples_per_epoch=4, sample_batch_size=4,
                        train_batch_size=2, gradient_accumulation_steps=1, timestep_fraction=0.34, num_epochs=1,
                        checkpointing_epochs=1, learning_rate=1e-3, advantage="batch")
    run = ddpo.train(config)
    record = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    if kind == "unifiedreward":
        assert record["reward_mean"] == 7.0
    elif kind == "vqascore":
        assert 0.0 <= record["reward_mean"] <= 1.0
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()

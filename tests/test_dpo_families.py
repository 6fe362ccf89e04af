"""Diffusion-DPO on tiny SDXL-, SD3- and FLUX-architecture pipelines (random weights, built in the test):
LoRA and full fine-tuning end to end from offline pairs, AI feedback and the held-out evaluation on SD3, the
first loss ln 2 under bf16, and each LoRA loading into a fresh diffusers pipeline of its family and changing
its output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import diffusers
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_dpo import _png, small_config

from align.pipeline import generate_images, load_pipeline, load_trained
from align.train import dpo

PIPELINE_CLASSES = {"sdxl": "StableDiffusionXLPipeline", "sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}
RESOLUTION = 32  # every tiny pipeline's 4 x 16 x 16 latents (FLUX's own default would be 256 px)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    rows = [{"caption": f"shape number {i}", "jpg_0": _png((200, 30 * i, 40), size=RESOLUTION),
             "jpg_1": _png((0, 0, 0), size=RESOLUTION, noise_seed=i),
             "label_0": float(i % 2 == 0), "label_1": float(i % 2)} for i in range(4)]
    path = tmp_path_factory.mktemp("pairs") / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _images(pipe) -> torch.Tensor:
    return generate_images(pipe, ["shape number 1"], [0], num_inference_steps=2, guidance_scale=2.0)


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_lora_dpo_starts_at_ln2_under_bf16_and_its_lora_loads_in_the_familys_pipeline(family, family_models, pairs, tmp_path):
    model = family_models(family)
    run = dpo.train(small_config(model, tmp_path / "run", dataset=pairs, resolution=RESOLUTION, max_steps=2,
                                 mixed_precision="bf16", caption_dropout=0.5))
    records = _metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    # The adapter starts at zero: policy and reference agree bit for bit, under bf16 too.
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert records[0]["model_mse"] == records[0]["ref_mse"]
    assert records[1]["model_mse"] != records[1]["ref_mse"]  # step 1 trained the adapter

    no_t5 = {"text_encoder_3": None, "tokenizer_3": None} if family == "sd3" else {}  # the tiny SD3 has no T5
    pipe = getattr(diffusers, PIPELINE_CLASSES[family]).from_pretrained(model, **no_t5)
    pipe.set_progress_bar_config(disable=True)
    before = _images(pipe)
    pipe.load_lora_weights(str(run / "final"))
    assert (before - _images(pipe)).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_full_dpo_saves_a_denoiser_that_loads_with_its_base(family, family_models, pairs, tmp_path):
    model = family_models(family)
    run = dpo.train(small_config(model, tmp_path / "run", dataset=pairs, resolution=RESOLUTION, max_steps=1,
                                 finetune="full", latent_store="none"))
    # The frozen copy equals the policy (a no-grad forward may round differently from the training one).
    assert _metrics(run)[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    denoiser = "unet" if family == "sdxl" else "transformer"
    assert (run / "final" / denoiser / "config.json").is_file()
    trained, base = load_trained(str(run)), load_pipeline(model)
    changed = [not torch.equal(a, b) for a, b in zip(getattr(trained, denoiser).parameters(),
                                                      getattr(base, denoiser).parameters(), strict=True)]
    assert any(changed)


def test_ai_feedback_dpo_on_sd3_labels_its_own_generations(family_models, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green triangle\n")
    run = dpo.train(small_config(family_models("sd3"), tmp_path / "run", reward="jpeg-compressibility",
                                 prompts=str(prompts), eval_prompts=str(prompts), max_steps=1))  # the pipeline's own 32 px
    feedback = pq.read_table(run / "feedback" / "pairs.parquet").to_pylist()
    assert len(feedback) == 3 and {r["judge"] for r in feedback} == {"jpeg-compressibility"}
    assert _metrics(run)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()
    # Held-out images before and after, scored (the transformer's LoRA folded in for the evaluation).
    before, after = (json.loads((run / f"eval_{when}.json").read_text()) for when in ("before", "after"))
    assert len(before["scores"]) == len(after["scores"]) == 3 and before["scores"] != after["scores"]

"""Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509/2511's QwenImageEditPlusPipeline) against its diffusers pipeline on a
tiny pipeline of the real classes (align/testing/tiny_qwen.py), and the trainers on it: Diffusion-DPO from AI feedback
on edits, online RL with the edit oracle, evaluation and best-of-N, end to end. The pipeline takes one prompt per call: "the pipeline's own"
below is diffusers' ``QwenImageEditPlusPipeline.__call__`` run prompt by prompt. ``small_sources`` scales its source
sizes (~1024 px for the VAE, ~384 px for the text encoder) to 64 and 32 px for the pipeline and the family alike."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE
from test_dpo import small_config
from test_family_kontext import (  # the same edits, the same ODE, the same LoRA round trip
    PROMPTS,
    RES,
    assert_lora_loads_with_the_pipelines_own_loader,
    assert_online_rl_edits_end_to_end,
    family_images,
    latents_of,
)
from test_family_qwen_edit import predict  # the family's prediction at t = 500
from test_memory_plan import assert_close

from align.eval import best_of_n as bon
from align.eval import evaluate as ev
from align.families import check_pipeline_folder, family_of, family_of_pipeline
from align.pipeline import generate_images, load_pipeline, load_trained
from align.testbed.edit_world import sample_edit_prompts
from align.testing.tiny_qwen import build_tiny_qwen_edit, build_tiny_qwen_edit_plus, small_sources
from align.train import dpo
from align.train.memory_model import SavedStorages, plan_run
from align.train.objectives import ALGORITHMS
from rewards.edit_prompts import parse_edit_prompt, without_instruction

ROLLOUT_ALGORITHMS = [a.name for a in ALGORITHMS if not a.samples_with_gradients]


@pytest.fixture(scope="module", autouse=True)
def asked_areas():
    with small_sources() as asked:
        yield asked


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return str(build_tiny_qwen_edit_plus(tmp_path_factory.mktemp("qwen_edit_plus")))


@pytest.fixture()
def pipe(built):
    return load_pipeline(built)


def pipeline_images(pipe, latents, guidance_scale, steps=3):
    """diffusers' own QwenImageEditPlusPipeline.__call__, one prompt (and its one source) per call."""
    family = family_of_pipeline(pipe)
    arguments, packed = family.call_arguments(pipe, PROMPTS, guidance_scale, RES), family.pipeline_latents(pipe, latents)
    rows = []
    for i in range(len(PROMPTS)):
        row = {key: value[i : i + 1] if key in ("prompt", "image", "negative_prompt") and value else value
               for key, value in arguments.items()}
        rows.append(QwenImageEditPlusPipeline.__call__(pipe, latents=packed[i : i + 1], num_inference_steps=steps,
                                                       output_type="pt", height=RES, width=RES, **row).images)
    return torch.cat(rows)


def test_detected_from_the_model_index(built, pipe, tmp_path):
    check_pipeline_folder(Path(built))
    assert json.loads(open(f"{built}/model_index.json").read())["_class_name"] == "QwenImageEditPlusPipeline"
    family = family_of(built)
    assert family.name == "qwenimage-edit-plus" and family.edits and family_of_pipeline(pipe) is family
    assert isinstance(pipe, QwenImageEditPlusPipeline) and family.latent_shape(pipe, RES) == (4, 8, 8)
    plain = build_tiny_qwen_edit(tmp_path)  # the older pipeline class keeps its own family
    assert family_of(str(plain)).name == "qwenimage-edit"
    assert isinstance(load_pipeline(str(plain)), QwenImageEditPipeline)


def test_the_instruction_and_the_source_are_encoded_as_the_pipeline_does(pipe, asked_areas):
    family = family_of_pipeline(pipe)
    asked_areas.clear()
    cond = family.encode_prompts(pipe, PROMPTS, RES)
    assert set(asked_areas) == {CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE}  # each size with the pipeline's own area
    arguments = family.call_arguments(pipe, PROMPTS, 1.0, RES)
    assert cond["source_latents"].shape == (2, 4, 16, 16)  # the pipeline's VAE size (64 px here), not the run's
    with torch.no_grad():
        pixels = pipe.image_processor.preprocess(arguments["image"], 64, 64)
        torch.testing.assert_close(cond["source_latents"], pipe._encode_vae_image(pixels[:, :, None], None)[:, :, 0],
                                   rtol=0, atol=1e-6)
        for row, (prompt, image) in enumerate(zip(arguments["prompt"], arguments["image"])):
            shown = pipe.image_processor.resize(image, 32, 32)  # the text encoder's size (~384 px; 32 px here)
            embeds, mask = pipe.encode_prompt([prompt], image=[shown])  # "Picture 1: <|vision_start|>..."
            length = embeds.shape[1]
            assert mask is None and int(cond["prompt_embeds_mask"][row].sum()) == length
            torch.testing.assert_close(cond["prompt_embeds"][row : row + 1, :length], embeds, rtol=0, atol=1e-5)
            assert not cond["prompt_embeds"][row, length:].any()  # the batch's zero padding
            negative, _ = pipe.encode_prompt([" "], image=[shown])
            torch.testing.assert_close(cond["negative_prompt_embeds"][row : row + 1, : negative.shape[1]], negative,
                                       rtol=0, atol=1e-5)
    # the text encoder sees the source: the same instruction on another source is another text conditioning
    swapped = [f"[source: {parse_edit_prompt(PROMPTS[1]).source}] {parse_edit_prompt(PROMPTS[0]).instruction}"] * 2
    other = family.encode_prompts(pipe, swapped, RES)
    length = min(cond["prompt_embeds"].shape[1], other["prompt_embeds"].shape[1])
    assert (cond["prompt_embeds"][0, :length] - other["prompt_embeds"][0, :length]).abs().max() > 1e-4


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_editing_through_the_family_equals_the_pipelines(pipe, guidance_scale, asked_areas):
    latents = latents_of(pipe)
    asked_areas.clear()
    expected = pipeline_images(pipe, latents, guidance_scale)
    assert set(asked_areas) == {CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE}
    torch.testing.assert_close(family_images(pipe, latents, guidance_scale), expected, rtol=0, atol=1e-5)
    # the loaded pipeline takes a batch (one prompt at a time), as the trainers' feedback and evaluation call it
    family = family_of_pipeline(pipe)
    batched = pipe(latents=family.pipeline_latents(pipe, latents), num_inference_steps=3, output_type="pt", height=RES,
                   width=RES, **family.call_arguments(pipe, PROMPTS, guidance_scale, RES)).images
    torch.testing.assert_close(batched, expected, rtol=0, atol=0)


def test_a_plain_prompt_is_refused_in_one_line(pipe):
    family = family_of_pipeline(pipe)
    for call in (lambda: family.encode_prompts(pipe, ["a red circle"], RES),
                 lambda: family.call_arguments(pipe, ["a red circle"], 2.0, RES),
                 lambda: family.encode_prompts(pipe, [PROMPTS[0], "a red circle"], RES)):
        with pytest.raises(ValueError, match=r"Qwen-Image-Edit-Plus edits: .*'\[source: <image>\] <instruction>'") as err:
            call()
        assert "\n" not in str(err.value)


def test_a_dropped_instruction_is_the_negative_prompt_on_its_own_source(pipe):
    family = family_of_pipeline(pipe)
    dropped = family.encode_prompts(pipe, [without_instruction(p) for p in PROMPTS], RES)
    captions = family.encode_prompts(pipe, PROMPTS, RES)
    stored = {**captions, **family.encode_prompts(pipe, [""], RES)}
    stored["unconditional"] = stored["unconditional"].expand(2)
    torch.testing.assert_close(predict(pipe, stored), predict(pipe, dropped), rtol=0, atol=1e-5)
    assert (predict(pipe, captions) - predict(pipe, dropped)).abs().max() > 1e-4


def test_lora_loads_with_the_pipelines_own_loader(built, pipe, tmp_path):
    fresh, latents, in_memory = assert_lora_loads_with_the_pipelines_own_loader(pipe, built, pipeline_images, tmp_path)
    assert isinstance(fresh, QwenImageEditPlusPipeline)  # QwenImageEditPlusPipeline.load_lora_weights loaded it
    torch.testing.assert_close(pipeline_images(load_trained(str(tmp_path / "lora"), base=built), latents, 2.0, steps=2),
                               in_memory, rtol=0, atol=1e-5)


def test_seeded_edits_depend_on_their_prompt_and_seed_only(pipe):
    together = generate_images(pipe, PROMPTS, [3, 4], num_inference_steps=2, guidance_scale=2.0)
    alone = generate_images(pipe, PROMPTS[1:], [4], num_inference_steps=2, guidance_scale=2.0)
    assert together.shape == (2, 3, RES, RES)
    torch.testing.assert_close(alone[0], together[1], rtol=0, atol=1e-5)


def test_planned_activations_count_the_source_tokens(built):
    """The planner's training forward (the prompt with the ~384 px source's image tokens, the source latents at the
    VAE's ~1024 px) keeps what one real forward keeps."""
    settings = types.SimpleNamespace(model=built, finetune="full", lora_rank=4, lora_alpha=None, mixed_precision="no",
                                     use_8bit_adam=False, gradient_checkpointing=False, train_batch_size=2, resolution=RES)
    planned = plan_run(settings)
    pipe = load_pipeline(built)
    family = family_of_pipeline(pipe)
    config, samples = dict(pipe.transformer.config), planned.forward_batch
    tokens = family.text_tokens(built)
    assert tokens == 256 + 4  # the planned prompt and the 32 px source's image tokens (56 px in the processor, 2x2 merged)
    cond = {key: torch.randn(shape) for key, shape in family.conditioning_shapes(config, samples, tokens).items()}
    cond["source_latents"] = torch.randn(samples, *family.source_latent_shape_of(config, dict(pipe.vae.config), RES))
    assert cond["source_latents"].shape[1:] == (4, 16, 16)
    kept = SavedStorages(list(pipe.transformer.parameters()))
    with kept.hooks():
        out = family.predict(pipe.transformer, torch.randn(samples, 4, 8, 8), torch.rand(samples) * 1000, cond)
    out.square().mean().backward()
    assert_close(planned.shape.activation_bytes, kept.total, "activations")


@pytest.fixture(scope="module")
def edit_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "edits.txt"
    path.write_text("\n".join(sample_edit_prompts(4, seed=5)) + "\n")
    return str(path)


@pytest.mark.parametrize("latent_store", ["run", "none"])
def test_dpo_from_ai_feedback_on_edits_with_dropped_instructions(built, edit_prompts, tmp_path, latent_store):
    """AI feedback generates the pairs through the pipeline (a batch of edit prompts per call); the random tiny model's
    edits all score 0 with the oracle, so a rule judge labels them, as in test_family_qwen_edit.py. With the run's
    latent store (dropped captions: the empty prompt's flag over the caption's conditioning) and without one."""
    run = dpo.train(small_config(built, tmp_path / "run", reward="jpeg-compressibility", prompts=edit_prompts,
                                 eval_prompts=edit_prompts, max_steps=2, caption_dropout=0.5, guidance_scale=2.0,
                                 latent_store=latent_store))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-4) and records[1]["model_mse"] != records[1]["ref_mse"]
    before, after = (json.loads((run / f"eval_{when}.json").read_text()) for when in ("before", "after"))
    assert len(before["scores"]) == 4 and before["scores"] != after["scores"]
    assert isinstance(load_trained(str(run / "final"), base=built), QwenImageEditPlusPipeline)


@pytest.mark.parametrize("name", ["ppo", *(pytest.param(n, marks=pytest.mark.slow) for n in ROLLOUT_ALGORITHMS if n != "ppo")])
def test_online_rl_edits_end_to_end(built, edit_prompts, tmp_path, name):
    """Flow-GRPO with the edit oracle by default; the other rollout objectives among the slow tests."""
    assert_online_rl_edits_end_to_end(built, edit_prompts, tmp_path / name, name)



def test_evaluate_and_best_of_n_judge_edits(built, tmp_path):
    """align.evaluate and best-of-N (explicit noises: the pipeline's ``latents``, split by prompt) generate edits
    through the pipeline in batches and judge them with the edit oracle."""
    out = tmp_path / "eval"
    ev.main(["--models", f"base={built}", "--judges", "shapes-edit-oracle,jpeg-compressibility", "--prompts",
             "testbed-edit:3:2", "--num_inference_steps", "2", "--resolution", "32", "--device", "cpu",
             "--output_dir", str(out), "--quiet"])
    assert 0 < json.loads((out / "results.json").read_text())["change_outside_edit"]["base"]["mean"] <= 1
    bon_out = tmp_path / "bon"
    bon.main(["--model", built, "--reward", "shapes-edit-oracle", "--eval_judges", "jpeg-compressibility",
              "--prompts", "testbed-edit:2:2", "--n", "2", "--num_inference_steps", "2", "--resolution", "32",
              "--device", "cpu", "--output_dir", str(bon_out), "--quiet"])
    results = json.loads((bon_out / "results.json").read_text())
    assert np.array(results["scores"]["shapes-edit-oracle"]).shape == (2, 2)

"""FLUX.1 Kontext (instruction editing) against its diffusers pipeline on tiny pipelines of the real classes
(align/testing/tiny_kontext.py), and the trainers on it: Diffusion-DPO from AI feedback on edits (with the
latent store and dropped instructions) and every online-RL objective with the edit oracle, end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from test_dpo import small_config

from align.eval import best_of_n as bon
from align.eval import evaluate as ev
from align.families import family_of_pipeline
from align.families.base import guided_prediction
from align.pipeline import add_lora, generate_images, load_pipeline, load_trained
from align.sampling.flow import ode_step
from align.testbed.edit_world import sample_edit_prompts
from align.testing.tiny_kontext import build_tiny_kontext
from align.train import ddpo, dpo
from align.train.ddpo_config import DDPOConfig
from align.train.objectives import ALGORITHMS
from rewards.edit_prompts import parse_edit_prompt

# reward backpropagation's objectives need a differentiable judge: tests/test_reward_backprop.py runs them per family
ROLLOUT_ALGORITHMS = [a.name for a in ALGORITHMS if not a.samples_with_gradients]
RES = 32
PROMPTS = sample_edit_prompts(2, seed=11)


@pytest.fixture(scope="module", params=["dev", "no_guidance_embedding"])
def built(request, tmp_path_factory):
    return request.param, str(build_tiny_kontext(tmp_path_factory.mktemp(request.param),
                                                 guidance_embeds=request.param == "dev"))


@pytest.fixture()
def pipe(built):
    return load_pipeline(built[1])


def latents_of(pipe, seed=0):
    shape = family_of_pipeline(pipe).latent_shape(pipe, RES)
    return torch.randn(len(PROMPTS), *shape, generator=torch.Generator().manual_seed(seed))


def pipeline_images(pipe, latents, guidance_scale, steps=3):
    family = family_of_pipeline(pipe)
    return pipe(latents=family.pipeline_latents(pipe, latents), num_inference_steps=steps, output_type="pt",
                **family.call_arguments(pipe, PROMPTS, guidance_scale, RES)).images


def family_images(pipe, latents, guidance_scale, steps=3):
    family = family_of_pipeline(pipe)
    cond, uncond = family.encode_prompts(pipe, PROMPTS, RES), family.unconditional(pipe, len(PROMPTS), RES)
    sigmas = family.flow_sigmas(pipe, steps, RES)
    x = latents
    with torch.no_grad():
        for i in range(steps):
            v = guided_prediction(family, pipe.transformer, x, (sigmas[i] * 1000).expand(len(x)), cond, uncond,
                                  guidance_scale)
            x = ode_step(x, v, sigmas[i], sigmas[i + 1])
    return family.decode_latents(pipe, x)


def test_no_guidance_value_leaves_the_pipelines_default(pipe):
    """guidance_scale None (align.evaluate without --guidance_scale): the pipeline's own default, with or without the
    guidance embedding, and the pipeline generates with it."""
    arguments = family_of_pipeline(pipe).call_arguments(pipe, PROMPTS, None, RES)
    assert "guidance_scale" not in arguments and "true_cfg_scale" not in arguments
    images = pipe(latents=family_of_pipeline(pipe).pipeline_latents(pipe, latents_of(pipe)), num_inference_steps=2,
                  output_type="pt", **arguments).images
    assert images.shape == (len(PROMPTS), 3, RES, RES) and torch.isfinite(images).all()


def test_detected_as_an_editing_family(pipe):
    family = family_of_pipeline(pipe)
    assert family.name == "flux-kontext" and family.edits and family.native_resolution(pipe) == RES


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_editing_through_the_family_equals_the_pipelines(pipe, guidance_scale):
    latents = latents_of(pipe)
    expected = pipeline_images(pipe, latents, guidance_scale)
    torch.testing.assert_close(family_images(pipe, latents, guidance_scale), expected, rtol=0, atol=1e-5)


def test_the_source_is_conditioning_and_changes_the_edit(pipe):
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, PROMPTS, RES)
    assert cond["source_latents"].shape == (2, *family.latent_shape(pipe, RES))
    with torch.no_grad():  # the pipeline's own source encoding
        pixels = pipe.image_processor.preprocess(family.call_arguments(pipe, PROMPTS, 1.0, RES)["image"], RES, RES)
        torch.testing.assert_close(cond["source_latents"], pipe._encode_vae_image(pixels, None), rtol=0, atol=1e-6)
    swapped = [f"[source: {parse_edit_prompt(PROMPTS[1]).source}] {parse_edit_prompt(PROMPTS[0]).instruction}"] * 2
    other = family.encode_prompts(pipe, swapped, RES)
    latents, t = latents_of(pipe), torch.tensor([500.0, 500.0])
    with torch.no_grad():
        a = family.predict(pipe.transformer, latents, t, cond)[0]
        b = family.predict(pipe.transformer, latents, t, other)[0]
    assert (a - b).abs().max() > 1e-4
    with pytest.raises(ValueError, match="every prompt of a batch"):
        family.encode_prompts(pipe, [PROMPTS[0], "a red circle"], RES)


def assert_lora_loads_with_the_pipelines_own_loader(pipe, model: str, images, tmp_path, latents=None, guidance=2.0):
    """A random LoRA on ``pipe``'s transformer, saved by the family and loaded into a fresh pipeline of ``model`` with
    its own ``load_lora_weights``, gives the in-memory images (``images(pipe, latents, guidance)``; latents: this
    file's by default), which differ from the base's. Returns the fresh pipeline, the latents and the in-memory images."""
    family = family_of_pipeline(pipe)
    latents = latents_of(pipe) if latents is None else latents
    base = images(pipe, latents, guidance, steps=2)
    add_lora(pipe.transformer, rank=4, target_modules=family.lora_targets)
    with torch.no_grad():
        for name, param in pipe.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.3)
    in_memory = images(pipe, latents, guidance, steps=2)
    family.save_lora(pipe.transformer, tmp_path / "lora")
    fresh = load_pipeline(model)
    fresh.load_lora_weights(str(tmp_path / "lora"))  # the pipeline's own loader
    torch.testing.assert_close(images(fresh, latents, guidance, steps=2), in_memory, rtol=0, atol=1e-5)
    assert (in_memory - base).abs().max() > 1e-3
    return fresh, latents, in_memory


def test_lora_loads_with_the_pipelines_own_loader(built, pipe, tmp_path):
    fresh, latents, in_memory = assert_lora_loads_with_the_pipelines_own_loader(pipe, built[1], pipeline_images, tmp_path)
    assert isinstance(fresh, FluxKontextPipeline)  # with the tiny model's stored T5 length
    torch.testing.assert_close(pipeline_images(load_trained(str(tmp_path / "lora"), base=built[1]), latents, 2.0, steps=2),
                               in_memory, rtol=0, atol=1e-5)


def test_seeded_edits_depend_on_their_prompt_and_seed_only(pipe):
    together = generate_images(pipe, PROMPTS, [3, 4], num_inference_steps=2, guidance_scale=2.0, height=RES, width=RES)
    alone = generate_images(pipe, PROMPTS[1:], [4], num_inference_steps=2, guidance_scale=2.0, height=RES, width=RES)
    torch.testing.assert_close(alone[0], together[1], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def edit_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "edits.txt"
    path.write_text("\n".join(sample_edit_prompts(4, seed=5)) + "\n")
    return str(path)


@pytest.mark.parametrize("built", ["no_guidance_embedding"], indirect=True)
def test_dpo_from_ai_feedback_on_edits_with_dropped_instructions(built, edit_prompts, tmp_path):
    """The random tiny model's edits all score 0 with the oracle (only ties): a rule judge labels them here; the
    editing testbed's config trains on the oracle's labels."""
    run = dpo.train(small_config(built[1], tmp_path / "run", reward="jpeg-compressibility", prompts=edit_prompts,
                                 eval_prompts=edit_prompts, max_steps=2, caption_dropout=0.5, guidance_scale=2.0))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-4) and records[1]["model_mse"] != records[1]["ref_mse"]
    before, after = (json.loads((run / f"eval_{when}.json").read_text()) for when in ("before", "after"))
    assert len(before["scores"]) == 4 and before["scores"] != after["scores"]


def assert_online_rl_edits_end_to_end(model: str, edit_prompts: str, output_dir, name: str) -> None:
    """Two epochs of ``--algorithm name`` with the edit oracle: finite losses, a final LoRA."""
    config = DDPOConfig(model=model, reward="shapes-edit-oracle", prompts=edit_prompts, output_dir=str(output_dir),
                        report_to="none", algorithm=name, num_inference_steps=3, samples_per_epoch=4, sample_batch_size=4,
                        images_per_prompt=2, advantage="group", train_batch_size=4, gradient_accumulation_steps=1,
                        timestep_fraction=0.67, num_epochs=2, checkpointing_epochs=2, learning_rate=3e-2,
                        guidance_scale=2.0)
    run = ddpo.train(config)
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(epochs) == 2 and all(math.isfinite(e["loss"]) for e in epochs)
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("built", ["no_guidance_embedding"], indirect=True)
@pytest.mark.parametrize("name", ["ppo", *(pytest.param(n, marks=pytest.mark.slow) for n in ROLLOUT_ALGORITHMS if n != "ppo")])
def test_every_online_rl_objective_edits_end_to_end(built, edit_prompts, tmp_path, name):
    """DDPO / Flow-GRPO by default; the other objectives among the slow tests."""
    assert_online_rl_edits_end_to_end(built[1], edit_prompts, tmp_path / name, name)


@pytest.mark.slow  # about 20 s
@pytest.mark.parametrize("built", ["dev"], indirect=True)
def test_evaluate_and_best_of_n_judge_edits_and_report_the_change_outside_them(built, tmp_path):
    """align.evaluate scores the edits with the edit oracle and reports the change outside the edit; best-of-N picks
    edits with a judge that sees the source (the same seeds give the same candidates as the pipeline)."""
    out = tmp_path / "eval"
    ev.main(["--models", f"base={built[1]}", "--judges", "shapes-edit-oracle,jpeg-compressibility", "--prompts",
             "testbed-edit:3:2", "--num_inference_steps", "2", "--resolution", "32", "--device", "cpu",
             "--output_dir", str(out), "--quiet"])
    saved = json.loads((out / "results.json").read_text())
    change = saved["change_outside_edit"]["base"]
    assert 0 < change["mean"] <= 1 and change["region"] == "outside the instruction's cells"
    assert "change outside the edit" in saved["table"][0]
    bon_out = tmp_path / "bon"
    bon.main(["--model", built[1], "--reward", "shapes-edit-oracle", "--eval_judges", "jpeg-compressibility",
              "--prompts", "testbed-edit:2:2", "--n", "2", "--num_inference_steps", "2", "--resolution", "32",
              "--device", "cpu", "--output_dir", str(bon_out), "--quiet"])
    results = json.loads((bon_out / "results.json").read_text())
    assert np.array(results["scores"]["shapes-edit-oracle"]).shape == (2, 2)

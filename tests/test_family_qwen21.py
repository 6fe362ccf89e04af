"""Qwen-Image 2.1 (QwenImage21Pipeline) against its own diffusers pipeline, on a tiny pipeline of the real classes
(align/testing/tiny_qwen21.py) saved and loaded back: detection, encoding, sampling guided and not (with and without
the pipeline's KV cache), the LoRA in the pipeline's own loader, Diffusion-DPO and every online-RL objective end to
end, and the memory plan."""

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
from test_family_2026 import PROMPTS, assert_training_draw_is_uniform_and_the_target_the_velocity
from test_family_2026 import family_images as family_images_at
from test_family_kontext import assert_lora_loads_with_the_pipelines_own_loader
from test_trainers_2026 import ROLLOUT_ALGORITHMS

from align.families import family_of, family_of_pipeline
from align.families.base import cat_conditioning, expand_conditioning
from align.pipeline import generate_images, load_pipeline, load_trained
from align.testing.tiny_qwen import build_tiny_qwenimage
from align.testing.tiny_qwen21 import RESOLUTION as RES
from align.testing.tiny_qwen21 import build_tiny_qwen21
from align.train import ddpo, dpo
from align.train.ddpo_config import DDPOConfig
from align.train.memory_model import class_units, fsdp_unit_counts


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return str(build_tiny_qwen21(tmp_path_factory.mktemp("qwen21")))


@pytest.fixture()
def pipe(built):
    return load_pipeline(built)


def initial_latents(pipe, batch=2, seed=0):
    shape = family_of_pipeline(pipe).latent_shape(pipe, RES)
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def pipeline_images(pipe, latents, guidance_scale, steps=3, prompts=PROMPTS, **extra):
    family = family_of_pipeline(pipe)
    return pipe(latents=family.pipeline_latents(pipe, latents), height=RES, width=RES, num_inference_steps=steps,
                output_type="pt", **family.call_arguments(pipe, prompts[: len(latents)], guidance_scale),
                **extra).images[:, :3]  # the pipeline's RGBA without alpha, as the family decodes


def family_images(pipe, latents, guidance_scale, steps=3, prompts=PROMPTS):
    return family_images_at(pipe, latents, guidance_scale, steps, prompts, resolution=RES)


def test_detected_from_model_index_and_loaded_with_its_frozen_parts(built, pipe, tmp_path):
    family = family_of(built)
    assert family.name == "qwenimage21" and family_of_pipeline(pipe) is family
    assert type(pipe).__name__ == "QwenImage21Pipeline"
    assert family.is_flow and family.denoiser(pipe) is pipe.transformer
    assert set(map(id, family.frozen_modules(pipe))) == {id(pipe.vae), id(pipe.text_encoder)}
    assert family.native_resolution(pipe) == RES
    assert type(pipe.transformer).__name__ == "QwenImage21Transformer2DModel"
    assert type(pipe.processor).__name__ == "Qwen3VLProcessor"
    assert family_of(str(build_tiny_qwenimage(tmp_path))).name == "qwenimage"  # Qwen-Image keeps its own family


def test_encode_prompts_is_the_pipelines(pipe):
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, PROMPTS, RES)
    embeds, mask, image_slots = pipe.encode_prompt(PROMPTS)
    torch.testing.assert_close(cond["prompt_embeds"], embeds, rtol=0, atol=1e-5)
    torch.testing.assert_close(cond["prompt_embeds_mask"], mask, rtol=0, atol=0)
    assert not image_slots.any() and cond["prompt_embeds_mask"].sum(1).unique().numel() == 2


@pytest.mark.parametrize("guided", [False, True])
def test_sampling_through_the_family_equals_the_pipelines_with_and_without_its_kv_cache(pipe, guided):
    """The family never caches; the pipeline's cached (its default) and uncached sampling both equal it."""
    assert pipe.transformer.config.causal_condition
    scale = (1.0, 3.0)[guided]
    latents = initial_latents(pipe)
    uncached = pipeline_images(pipe, latents, scale, use_kv_cache=False)
    cached = pipeline_images(pipe, latents, scale, use_kv_cache=True)
    ours = family_images(pipe, latents, scale)
    torch.testing.assert_close(ours, uncached, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=1e-5)
    if guided:  # guidance changed the images
        assert (pipeline_images(pipe, latents, 1.0) - uncached).abs().max() > 1e-4


def test_guidance_is_the_pipelines_and_handles_halves_of_different_lengths(pipe):
    family = family_of_pipeline(pipe)
    latents = initial_latents(pipe, batch=1)
    cond, uncond = family.encode_prompts(pipe, PROMPTS[1:], RES), family.unconditional(pipe, 1, RES)
    assert uncond["prompt_embeds"].shape[1] != cond["prompt_embeds"].shape[1]
    expected = pipeline_images(pipe, latents, 3.0, steps=2, prompts=PROMPTS[1:])
    torch.testing.assert_close(family_images(pipe, latents, 3.0, steps=2, prompts=PROMPTS[1:]), expected, rtol=0,
                               atol=1e-5)


def test_images_encode_to_the_latents_the_pipelines_use(pipe):
    family = family_of_pipeline(pipe)
    pixels = torch.rand(2, 3, RES, RES, generator=torch.Generator().manual_seed(0)) * 2 - 1
    encoded = family.encode_images(pipe, pixels)
    assert encoded.shape[1:] == family.latent_shape(pipe, RES)
    opaque = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)  # the pipeline's RGBA of an RGB image
    with torch.no_grad():
        expected = pipe._encode_vae_image(opaque[:, :, None], generator=None)[:, :, 0]  # condition images' encoding
    torch.testing.assert_close(encoded, expected, rtol=0, atol=1e-6)


def test_training_draw_is_uniform_and_the_target_the_velocity(pipe):
    assert_training_draw_is_uniform_and_the_target_the_velocity(pipe, RES)


def test_lora_saved_by_the_family_loads_with_the_pipelines_own_loader(built, pipe, tmp_path):
    _, latents, in_memory = assert_lora_loads_with_the_pipelines_own_loader(pipe, built, pipeline_images, tmp_path,
                                                                            latents=initial_latents(pipe), guidance=3.0)
    again = pipeline_images(load_trained(str(tmp_path / "lora"), base=built), latents, 3.0, steps=2)
    torch.testing.assert_close(again, in_memory, rtol=0, atol=1e-5)


def test_seeded_generation_and_best_of_n_noise_agree(pipe):
    family = family_of_pipeline(pipe)
    seeded = generate_images(pipe, PROMPTS, [3, 4], num_inference_steps=2, guidance_scale=3.0, height=RES, width=RES)
    assert seeded.shape == (2, 3, RES, RES)  # the pipeline's RGBA images come back RGB, as every judge reads them
    noise = torch.stack([torch.randn((1, *family.latent_shape(pipe, RES)), generator=torch.Generator().manual_seed(s))[0]
                         for s in (3, 4)])
    torch.testing.assert_close(pipeline_images(pipe, noise, 3.0, steps=2), seeded, rtol=0, atol=1e-5)


def test_conditioning_shapes_and_fsdp_units(pipe):
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, PROMPTS, RES)
    shapes = family.conditioning_shapes(dict(pipe.transformer.config), 2, cond["prompt_embeds"].shape[1])
    assert shapes == {"prompt_embeds": tuple(cond["prompt_embeds"].shape)}
    assert expand_conditioning(family.unconditional(pipe, 1, RES), 3)["prompt_embeds"].shape[0] == 3
    largest, root = fsdp_unit_counts(pipe.transformer, class_units(family.shard_blocks))
    assert largest > 0 and root < sum(p.numel() for p in pipe.transformer.parameters())


def test_a_padded_batch_predicts_as_the_pipelines_padded_batch_not_as_each_row_alone(pipe):
    """Rows of different prompt lengths concatenate (zero-padded, with a mask) to what ``encode_prompt`` gives the
    batch, which the sampling test shows predicts as the pipeline's batch. The transformer places the image after the
    batch's longest prompt (its RoPE frame index is the joint sequence's text length, shared by the batch), so the
    padded row differs from itself alone, as it does in the pipeline; the longest row does not."""
    family = family_of_pipeline(pipe)
    latents = initial_latents(pipe)
    timesteps = torch.tensor([700.0, 300.0])
    alone = [family.encode_prompts(pipe, [p], RES) for p in PROMPTS]
    together = cat_conditioning(alone)
    torch.testing.assert_close(together["prompt_embeds"], family.encode_prompts(pipe, PROMPTS, RES)["prompt_embeds"],
                               rtol=0, atol=1e-5)
    with torch.no_grad():
        batched = family.predict(pipe.transformer, latents, timesteps, together)
        single = [family.predict(pipe.transformer, latents[r : r + 1], timesteps[r : r + 1], alone[r]) for r in (0, 1)]
    torch.testing.assert_close(batched[1:], single[1], rtol=0, atol=1e-5)  # the longest prompt: no padding
    assert (batched[:1] - single[0]).abs().max() > 1e-4  # the padded row moved (about 5e-3 here)


# --- trainers end to end ------------------------------------------------------------------------------------------
def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def diffusers_images(model: str, lora: Path | None, guidance: float) -> torch.Tensor:
    index = json.loads((Path(model) / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline"
    pipe = family_of(model).load_pipeline(model, torch.float32, "cpu")  # from_pretrained (its processor without video)
    assert type(pipe) is diffusers.QwenImage21Pipeline
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    return pipe(prompt="a red circle", num_inference_steps=2, height=RES, width=RES, output_type="pt",
                true_cfg_scale=guidance, negative_prompt=" ", generator=torch.Generator().manual_seed(0)).images[:, :3]


def pairs_file(folder: Path) -> str:
    """Four preference pairs of RES-px images (a colour against black noise, alternately first and second)."""
    rows = [{"caption": f"shape number {i}", "jpg_0": _png((200, 30 * i, 40), size=RES),
             "jpg_1": _png((0, 0, 0), size=RES, noise_seed=i), "label_0": float(i % 2 == 0), "label_1": float(i % 2)}
            for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), folder / "pairs.parquet")
    return str(folder / "pairs.parquet")


def test_lora_dpo_starts_at_ln2_and_its_lora_loads_in_the_pipeline(built, tmp_path):
    run = dpo.train(small_config(built, tmp_path / "run", dataset=pairs_file(tmp_path), resolution=RES, max_steps=2,
                                 guidance_scale=2.0, caption_dropout=0.5))
    first, second = records(run)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4) and first["model_mse"] == first["ref_mse"]
    assert second["model_mse"] != second["ref_mse"]
    assert (diffusers_images(built, None, 2.0) - diffusers_images(built, run / "final", 2.0)).abs().max() > 1e-4


def online_run(built: str, out: Path, algorithm: str, **settings) -> list[dict]:
    """Two epochs of an online-RL objective on two prompts (4 samples, 3 steps); the epochs' records."""
    prompts = out.parent / "prompts.txt"
    prompts.write_text("a red circle\na large blue square to the left of a green triangle\n")
    config = DDPOConfig(model=built, reward="jpeg-compressibility", prompts=str(prompts), output_dir=str(out),
                        report_to="none", algorithm=algorithm, num_inference_steps=3, resolution=RES, samples_per_epoch=4,
                        sample_batch_size=4, images_per_prompt=2, advantage="group", train_batch_size=4,
                        gradient_accumulation_steps=1, timestep_fraction=0.67, num_epochs=2, checkpointing_epochs=2,
                        learning_rate=3e-2, **settings)
    epochs = records(ddpo.train(config))
    assert len(epochs) == 2 and all(math.isfinite(e["loss"]) for e in epochs), algorithm
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file(), algorithm
    return epochs


@pytest.mark.parametrize("name", [n if n == "ppo" else pytest.param(n, marks=pytest.mark.slow)  # the suite's budget
                                  for n in ROLLOUT_ALGORITHMS])
def test_every_online_rl_objective_runs_and_its_lora_changes_the_pipelines_images(built, tmp_path, name):
    """Each rollout objective of the registry (reward backpropagation's: tests/test_trainers_2026.py) two epochs."""
    epochs = online_run(built, tmp_path / name, name, guidance_scale=3.0)
    if name == "ppo":  # sampled and re-scored steps agree exactly on the first round
        assert epochs[0]["approx_kl"] == 0.0 and epochs[0]["clipfrac"] == 0.0
    assert (diffusers_images(built, None, 3.0) - diffusers_images(built, tmp_path / name / "final", 3.0)).abs().max() > 1e-4


def test_full_parameter_dpo_starts_at_ln2_and_moves(built, tmp_path):
    run = dpo.train(small_config(built, tmp_path / "full", dataset=pairs_file(tmp_path), resolution=RES, max_steps=2,
                                 finetune="full", learning_rate=1e-3))
    first, second = records(run)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4) and second["model_mse"] != second["ref_mse"]


def test_the_pipelines_sample_sigmas_are_sampled_as_it_samples_them(pipe):
    """A model whose pipeline config sets ``sample_sigmas``: the family samples them for their number of steps."""
    pipe.register_to_config(sample_sigmas=[1.0, 0.8, 0.45])
    latents = initial_latents(pipe)
    family = family_of_pipeline(pipe)
    assert family.base_sigmas(pipe, 3).tolist() == [1.0, 0.8, 0.45]
    torch.testing.assert_close(family_images(pipe, latents, 3.0), pipeline_images(pipe, latents, 3.0, use_kv_cache=False),
                               rtol=0, atol=1e-5)


def test_a_transformer_without_causal_condition_samples_as_its_pipeline(tmp_path):
    """Without ``causal_condition`` the prompt's tokens are modulated at the sampled timestep and the pipeline keeps no
    cache: the family's prediction is the same call."""
    pipe = load_pipeline(str(build_tiny_qwen21(tmp_path, causal_condition=False)))
    assert not pipe.transformer.config.causal_condition
    latents = initial_latents(pipe)
    for scale in (1.0, 3.0):
        torch.testing.assert_close(family_images(pipe, latents, scale), pipeline_images(pipe, latents, scale), rtol=0,
                                   atol=1e-5)


def test_dry_run_plans_the_tiny_pipeline_and_writes_nothing(built, tmp_path, capsys):
    """--dry_run counts this transformer's activations on the meta device (its image-slot mask on the CPU, where the
    transformer reads its values); within 15% of the measured: tests/test_memory_plan_2026.py."""
    ddpo.main(["--model", str(built), "--reward", "shapes-oracle", "--prompts", "testbed-train:8", "--dry_run", "true",
               "--output_dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "[dry run] --algorithm" in out and "qwenimage21 (" in out and "[dry run] this launch" in out
    assert not (tmp_path / "run").exists()


def test_the_24gb_recipes_settings_run_on_the_tiny_pipeline(built, tmp_path):
    """configs/qwenimage21_grpo_lora_24gb.yaml's memory settings (int8 transformer and Qwen3-VL, offloading, cached
    prompt embeddings, bf16, checkpointing) through two Flow-GRPO epochs; the LoRA loads in the pipeline."""
    online_run(built, tmp_path / "q", "ppo", quantize_base="int8", quantize_text_encoders="int8", offload=True,
               cache_prompt_embeddings=True, mixed_precision="bf16", gradient_checkpointing=True)
    assert (diffusers_images(built, None, 1.0) - diffusers_images(built, tmp_path / "q" / "final", 1.0)).abs().max() > 1e-4

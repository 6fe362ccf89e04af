"""Qwen-Image, FLUX.2 ([klein] base and step-distilled, [dev]) and Z-Image against their own diffusers pipelines, on tiny
pipelines of the real classes (align/testing/tiny_qwen.py, tiny_flux2.py, tiny_zimage.py) saved and loaded back."""

from __future__ import annotations

import pytest
import torch

from align.families import family_of, family_of_pipeline
from align.families.base import cat_conditioning, expand_conditioning, guided_prediction
from align.pipeline import add_lora, generate_images, load_pipeline, load_trained
from align.sampling.flow import ode_step
from align.testing.tiny_flux2 import build_tiny_flux2_dev, build_tiny_flux2_klein
from align.testing.tiny_qwen import build_tiny_qwenimage
from align.testing.tiny_zimage import build_tiny_zimage
from align.train.memory_model import class_units, fsdp_unit_counts

RES = 32
PROMPTS = ["a red circle", "two blue squares to the left of a large green triangle"]  # token counts differ
BUILDERS = {
    "qwenimage": build_tiny_qwenimage,
    "flux2_klein": build_tiny_flux2_klein,
    "flux2_dev": build_tiny_flux2_dev,
    "zimage": build_tiny_zimage,
}
FAMILY_NAMES = {"qwenimage": "qwenimage", "flux2_klein": "flux2", "flux2_dev": "flux2", "zimage": "zimage"}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def built(request, tmp_path_factory):
    return request.param, str(BUILDERS[request.param](tmp_path_factory.mktemp(request.param)))


@pytest.fixture()
def pipe(built):
    return load_pipeline(built[1])


def initial_latents(pipe, batch=2, seed=0):
    shape = family_of_pipeline(pipe).latent_shape(pipe, RES)
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def pipeline_images(pipe, latents, guidance_scale, steps=3, prompts=PROMPTS):
    """The diffusers pipeline's own images from the family's initial latents, at the family's call arguments."""
    family = family_of_pipeline(pipe)
    return pipe(latents=family.pipeline_latents(pipe, latents), height=RES, width=RES, num_inference_steps=steps,
                output_type="pt", **family.call_arguments(pipe, prompts[: len(latents)], guidance_scale)).images


def family_images(pipe, latents, guidance_scale, steps=3, prompts=PROMPTS, resolution=RES):
    """Euler over the family's σ with its guided prediction, decoded by the family."""
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, prompts[: len(latents)], resolution)
    uncond = family.unconditional(pipe, len(latents), resolution)
    sigmas = family.flow_sigmas(pipe, steps, resolution)
    x = latents
    with torch.no_grad():
        for i in range(steps):
            v = guided_prediction(family, family.denoiser(pipe), x, (sigmas[i] * 1000).expand(len(x)), cond, uncond,
                                  guidance_scale)
            x = ode_step(x, v, sigmas[i], sigmas[i + 1])
    return family.decode_latents(pipe, x)


def test_detected_from_model_index_and_loaded_with_its_frozen_parts(built, pipe):
    kind, folder = built
    family = family_of(folder)
    assert family.name == FAMILY_NAMES[kind] and family_of_pipeline(pipe) is family
    assert family.is_flow and family.denoiser(pipe) is pipe.transformer
    assert set(map(id, family.frozen_modules(pipe))) == {id(pipe.vae), id(pipe.text_encoder)}
    assert family.native_resolution(pipe) == RES  # stored beside the tiny model; the pipelines' own is 512 here
    assert type(pipe.transformer).__name__ in {"QwenImageTransformer2DModel", "Flux2Transformer2DModel",
                                                "ZImageTransformer2DModel"}


@pytest.mark.parametrize("guided", [False, True])
def test_sampling_through_the_family_equals_the_pipelines(pipe, guided):
    scale = (1.0, 3.0)[guided]
    latents = initial_latents(pipe)
    expected = pipeline_images(pipe, latents, scale)
    torch.testing.assert_close(family_images(pipe, latents, scale), expected, rtol=0, atol=1e-5)
    if guided:  # guidance changed the images
        assert (pipeline_images(pipe, latents, 1.0) - expected).abs().max() > 1e-4


def test_encode_prompts_is_the_pipelines(built, pipe):
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, PROMPTS, RES)
    length = family.max_sequence_length(pipe)
    if family.name == "qwenimage":
        embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=length)
        torch.testing.assert_close(cond["prompt_embeds"], embeds, rtol=0, atol=0)
        torch.testing.assert_close(cond["prompt_embeds_mask"], mask, rtol=0, atol=0)
        assert cond["prompt_embeds_mask"].sum(1).unique().numel() == 2  # the prompts' lengths differ
    elif family.name == "zimage":
        embeddings, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=length)
        for row, real in enumerate(embeddings):
            n = real.shape[0]
            torch.testing.assert_close(cond["prompt_embeds"][row, :n], real, rtol=0, atol=0)
            assert cond["prompt_embeds_mask"][row].sum() == n and not cond["prompt_embeds"][row, n:].any()
    else:
        embeds, _ = pipe.encode_prompt(PROMPTS, max_sequence_length=length)
        torch.testing.assert_close(cond["prompt_embeds"], embeds, rtol=0, atol=0)


def test_a_batch_of_prompts_of_different_lengths_predicts_as_each_alone(built, pipe):
    """Qwen-Image and Z-Image pad a batch's prompts to its longest with a mask: each row predicts as if alone."""
    family = family_of_pipeline(pipe)
    latents = initial_latents(pipe)
    timesteps = torch.tensor([700.0, 300.0])
    alone = [family.encode_prompts(pipe, [p], RES) for p in PROMPTS]
    together = cat_conditioning(alone)
    with torch.no_grad():
        batched = family.predict(pipe.transformer, latents, timesteps, together)
        for row, cond in enumerate(alone):
            single = family.predict(pipe.transformer, latents[row : row + 1], timesteps[row : row + 1], cond)
            torch.testing.assert_close(batched[row : row + 1], single, rtol=0, atol=1e-5)


def test_guidance_is_the_pipelines_and_handles_halves_of_different_lengths(pipe):
    """The unconditional side (Qwen-Image's " ", the others' "") is encoded to its own length; one prompt guided
    equals the pipeline. (Qwen-Image's scheduler cannot take 1 step: its terminal stretch divides by zero.)"""
    family = family_of_pipeline(pipe)
    scale = 3.0
    latents = initial_latents(pipe, batch=1)
    cond, uncond = family.encode_prompts(pipe, PROMPTS[1:], RES), family.unconditional(pipe, 1, RES)
    if "prompt_embeds_mask" in cond:
        assert uncond["prompt_embeds"].shape[1] != cond["prompt_embeds"].shape[1]
    expected = pipeline_images(pipe, latents, scale, steps=2, prompts=PROMPTS[1:])
    torch.testing.assert_close(family_images(pipe, latents, scale, steps=2, prompts=PROMPTS[1:]), expected, rtol=0, atol=1e-5)


def test_images_encode_to_the_latents_the_pipelines_use(pipe):
    """Decoding is checked by the sampling test (the family decodes what the pipeline decodes); encoding scales the
    posterior mean as the pipelines' own reference-image encoders do."""
    family = family_of_pipeline(pipe)
    pixels = torch.rand(2, 3, RES, RES, generator=torch.Generator().manual_seed(0)) * 2 - 1
    encoded = family.encode_images(pipe, pixels)
    assert encoded.shape[1:] == family.latent_shape(pipe, RES)
    vae = pipe.vae
    with torch.no_grad():
        if family.name == "flux2":
            expected = pipe._encode_vae_image(pixels, generator=None)
        elif family.name == "qwenimage":
            mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
            std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
            expected = ((vae.encode(pixels[:, :, None]).latent_dist.mean - mean) / std)[:, :, 0]
        else:
            expected = (vae.encode(pixels).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    torch.testing.assert_close(encoded, expected, rtol=0, atol=1e-6)


def test_training_draw_is_uniform_and_the_target_the_velocity(pipe):
    assert_training_draw_is_uniform_and_the_target_the_velocity(pipe)


def assert_training_draw_is_uniform_and_the_target_the_velocity(pipe, resolution=RES):
    """The training draw as the diffusers LoRA scripts (uniform over the scheduler's table) and the flow target."""
    family = family_of_pipeline(pipe)
    draw = family.draw_training_timesteps(pipe.scheduler, 64, torch.Generator().manual_seed(3))
    table = type(pipe.scheduler).from_config(pipe.scheduler.config)
    u = torch.rand(64, generator=torch.Generator().manual_seed(3))  # the scripts' weighting_scheme "none"
    torch.testing.assert_close(draw, table.timesteps[(u * 1000).long()], rtol=0, atol=0)
    x0, noise = torch.randn(2, 4, *family.latent_shape(pipe, resolution)).unbind(0)
    noisy, target = family.noisy_and_target(pipe.scheduler, x0, noise, draw[:4])
    sigma = (draw[:4] / 1000).reshape(-1, 1, 1, 1)
    torch.testing.assert_close(noisy, (1 - sigma) * x0 + sigma * noise, rtol=0, atol=1e-6)
    torch.testing.assert_close(target, noise - x0, rtol=0, atol=0)


def test_lora_saved_by_the_family_loads_with_the_pipelines_own_loader(built, pipe, tmp_path):
    family = family_of_pipeline(pipe)
    scale = 3.0
    latents = initial_latents(pipe)
    base = pipeline_images(pipe, latents, scale, steps=2)
    add_lora(pipe.transformer, rank=4, target_modules=family.lora_targets)
    with torch.no_grad():
        for name, param in pipe.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.3)
    in_memory = pipeline_images(pipe, latents, scale, steps=2)
    family.save_lora(pipe.transformer, tmp_path / "lora")
    fresh = load_pipeline(built[1])
    fresh.load_lora_weights(str(tmp_path / "lora"))  # the pipeline's own loader
    loaded = pipeline_images(fresh, latents, scale, steps=2)
    torch.testing.assert_close(loaded, in_memory, rtol=0, atol=1e-5)
    assert (loaded - base).abs().max() > 1e-3
    again = pipeline_images(load_trained(str(tmp_path / "lora"), base=built[1]), latents, scale, steps=2)
    torch.testing.assert_close(again, in_memory, rtol=0, atol=1e-5)


def test_seeded_generation_and_best_of_n_noise_agree(pipe):
    """generate_images (evaluation, feedback) draws what the pipeline draws for a seed; best-of-N hands the same noise
    through ``pipeline_latents``: image i depends on its prompt and seed only."""
    family = family_of_pipeline(pipe)
    scale = 3.0
    seeded = generate_images(pipe, PROMPTS, [3, 4], num_inference_steps=2, guidance_scale=scale, height=RES, width=RES)
    alone = generate_images(pipe, PROMPTS[1:], [4], num_inference_steps=2, guidance_scale=scale, height=RES, width=RES)
    torch.testing.assert_close(alone[0], seeded[1], rtol=0, atol=1e-5)
    noise = torch.stack([torch.randn((1, *family.latent_shape(pipe, RES)), generator=torch.Generator().manual_seed(s))[0]
                         for s in (3, 4)])
    torch.testing.assert_close(pipeline_images(pipe, noise, scale, steps=2), seeded, rtol=0, atol=1e-5)


def test_conditioning_shapes_are_what_encoding_gives(pipe):
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, PROMPTS, RES)
    tokens = cond["prompt_embeds"].shape[1]
    shapes = family.conditioning_shapes(dict(pipe.transformer.config), 2, tokens)
    for key, shape in shapes.items():  # the masks of real tokens are left out: the planner counts every token real
        assert key == "guidance" or tuple(cond[key].shape) == shape
    assert set(cond) - set(shapes) <= {"prompt_embeds_mask"}
    assert expand_conditioning(family.unconditional(pipe, 1, RES), 3)["prompt_embeds"].shape[0] == 3


def test_a_step_distilled_klein_never_guides_as_its_pipeline(tmp_path):
    pipe = load_pipeline(str(build_tiny_flux2_klein(tmp_path, is_distilled=True)))
    latents = initial_latents(pipe)
    expected = pipeline_images(pipe, latents, 3.0)
    torch.testing.assert_close(family_images(pipe, latents, 3.0), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(pipeline_images(pipe, latents, 1.0), expected, rtol=0, atol=0)


def test_fsdp2_units_are_the_familys_transformer_blocks(pipe):
    """The family's shard_blocks name its transformer's block classes: FSDP2 wraps each block (the planner counts the
    same units)."""
    family = family_of_pipeline(pipe)
    largest, root = fsdp_unit_counts(pipe.transformer, class_units(family.shard_blocks))
    blocks = {type(m).__name__ for m in pipe.transformer.modules()}
    assert set(family.shard_blocks) <= blocks and largest > 0 and root < sum(p.numel() for p in pipe.transformer.parameters())

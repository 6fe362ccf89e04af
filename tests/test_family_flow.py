"""The flow-matching families (SD3 with and without T5, FLUX) against their diffusers pipelines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

from align.families import family_of_pipeline
from align.families.base import (
    ModelLoadError,
    cat_conditioning,
    expand_conditioning,
    guided_prediction,
)
from align.families.flux import latent_image_ids, pack_latents, unpack_latents
from align.pipeline import add_lora, generate_images, load_pipeline, load_trained, save_full_unet
from align.sampling.flow import ode_step, sample_flow_with_logprob
from align.testing.tiny_flow import (
    T5_MAX_SEQUENCE_LENGTH,
    VAE_SCALE,
    VAE_SHIFT,
    build_tiny_flux,
    build_tiny_sd3,
)

RES = 32
PROMPTS = ["a red circle", "two blue squares"]
BUILDERS = {
    "sd3": lambda folder: build_tiny_sd3(folder, t5=False),
    "sd3_t5": lambda folder: build_tiny_sd3(folder, t5=True),
    "flux_dev": lambda folder: build_tiny_flux(folder, guidance_embeds=True),
    "flux_schnell": lambda folder: build_tiny_flux(folder, guidance_embeds=False),
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def built(request, tmp_path_factory):
    """(kind, pipeline folder) of each tiny flow model, built once per module."""
    return request.param, str(BUILDERS[request.param](tmp_path_factory.mktemp(request.param)))


@pytest.fixture()
def pipe(built):
    return load_pipeline(built[1])


def pipeline_call(pipe, latents, guidance_scale=1.0, **kwargs):
    """``pipe(...)`` from [B, C, H, W] latents, returning [B, C, H, W] latents (or images).

    FLUX takes and returns packed tokens; FLUX.1-schnell (no guidance embedding) guides only through
    ``true_cfg_scale`` with a negative prompt, the empty one here as in ``guided_prediction``."""
    family = family_of_pipeline(pipe)
    batch, _, height, width = latents.shape
    prompts = PROMPTS[:batch]
    if family.name == "flux":
        latents = pack_latents(latents)
        if not family.uses_guidance_embedding(pipe.transformer) and guidance_scale != 1.0:
            kwargs.update(negative_prompt=[""] * batch, true_cfg_scale=guidance_scale)
    out = pipe(prompts, latents=latents.clone(), height=RES, width=RES, guidance_scale=guidance_scale,
               **family.generation_kwargs(pipe), **kwargs).images
    if family.name == "flux" and kwargs.get("output_type") == "latent":
        out = unpack_latents(out, height, width)
    return out


def initial_latents(pipe, batch=2, seed=0):
    shape = family_of_pipeline(pipe).latent_shape(pipe, RES)
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def test_loaded_with_its_family_trained_t5_length_and_frozen_modules(built, pipe):
    kind, _ = built
    family = family_of_pipeline(pipe)
    assert family.is_flow and family.denoiser(pipe) is pipe.transformer
    assert pipe.scheduler.__class__.__name__ == "FlowMatchEulerDiscreteScheduler"
    assert family.generation_kwargs(pipe) == {"max_sequence_length": T5_MAX_SEQUENCE_LENGTH}
    frozen = family.frozen_modules(pipe)
    assert pipe.transformer not in frozen and pipe.vae in frozen and pipe.text_encoder in frozen
    if kind == "sd3":
        assert pipe.text_encoder_3 is None and len(frozen) == 3
    if kind == "sd3_t5":
        assert pipe.text_encoder_3 in frozen and len(frozen) == 4
    if kind.startswith("flux"):
        assert pipe.text_encoder_2 in frozen and len(frozen) == 3
        assert family.uses_guidance_embedding(pipe.transformer) == (kind == "flux_dev")


def test_without_a_settings_file_the_pipeline_default_t5_length_applies(tmp_path):
    pipe = load_pipeline(str(build_tiny_sd3(tmp_path, settings_file=False)))
    family = family_of_pipeline(pipe)
    assert family.generation_kwargs(pipe) == {"max_sequence_length": 256}
    cond = family.encode_prompts(pipe, ["a"], RES)
    assert cond["prompt_embeds"].shape[1] == pipe.tokenizer_max_length + 256


def test_encode_prompts_is_the_pipelines_encode_prompt(pipe):
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, PROMPTS, RES)
    uncond = expand_conditioning(family.encode_prompts(pipe, [""], RES), 2)
    if family.name == "sd3":
        embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
            PROMPTS, None, None, do_classifier_free_guidance=True, max_sequence_length=T5_MAX_SEQUENCE_LENGTH
        )
    else:  # FluxPipeline encodes a negative prompt ("" here) with the same encode_prompt
        embeds, pooled, text_ids = pipe.encode_prompt(PROMPTS, None, max_sequence_length=T5_MAX_SEQUENCE_LENGTH)
        negative, negative_pooled, _ = pipe.encode_prompt(["", ""], None, max_sequence_length=T5_MAX_SEQUENCE_LENGTH)
        assert not text_ids.any() and text_ids.shape == (T5_MAX_SEQUENCE_LENGTH, 3)  # rebuilt in predict
    assert set(cond) == {"prompt_embeds", "pooled_embeds"}
    torch.testing.assert_close(cond["prompt_embeds"], embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(cond["pooled_embeds"], pooled, rtol=0, atol=1e-6)
    # the pipeline's unconditional side for an empty / missing negative prompt is the empty prompt's encoding
    torch.testing.assert_close(uncond["prompt_embeds"], negative, rtol=0, atol=1e-6)
    torch.testing.assert_close(uncond["pooled_embeds"], negative_pooled, rtol=0, atol=1e-6)


def euler_latents(pipe, latents, steps, guidance_scale):
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, PROMPTS[: latents.shape[0]], RES)
    uncond = expand_conditioning(family.encode_prompts(pipe, [""], RES), latents.shape[0])
    sigmas = family.flow_sigmas(pipe, steps, RES)
    x = latents
    with torch.no_grad():
        for i in range(steps):
            t = (sigmas[i] * 1000).expand(x.shape[0])
            v = guided_prediction(family, family.denoiser(pipe), x, t, cond, uncond, guidance_scale)
            x = ode_step(x, v, sigmas[i], sigmas[i + 1])
    return x


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_euler_loop_over_flow_sigmas_reproduces_the_pipeline(pipe, guidance_scale):
    latents = initial_latents(pipe)
    expected = pipeline_call(pipe, latents, num_inference_steps=4, guidance_scale=guidance_scale, output_type="latent")
    sigmas = family_of_pipeline(pipe).flow_sigmas(pipe, 4, RES)
    assert pipe.scheduler.sigmas.numel() == 5
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.cpu(), rtol=0, atol=1e-7)  # what the pipeline sampled with
    assert sigmas.numel() == 5 and sigmas[-1] == 0 and sigmas[0] == 1
    torch.testing.assert_close(euler_latents(pipe, latents, 4, guidance_scale), expected, rtol=0, atol=1e-5)


def test_flow_grpo_sampler_without_noise_reproduces_the_pipeline(pipe):
    """sample_flow_with_logprob refuses noise level 0 (its window steps are stochastic); at 1e-7 the SDE
    steps are the Euler steps to ~1e-7, so the trajectory matches the pipeline's ODE."""
    family = family_of_pipeline(pipe)
    latents = initial_latents(pipe)
    expected = pipeline_call(pipe, latents, num_inference_steps=4, guidance_scale=3.0, output_type="latent")
    cond = family.encode_prompts(pipe, PROMPTS, RES)
    uncond = expand_conditioning(family.encode_prompts(pipe, [""], RES), 2)
    with torch.no_grad():
        traj = sample_flow_with_logprob(
            lambda x, t: guided_prediction(family, pipe.transformer, x, t, cond, uncond, 3.0),
            latents, family.flow_sigmas(pipe, 4, RES), window=(1, 3), noise_level=1e-7,
            generator=torch.Generator().manual_seed(1),
        )
    torch.testing.assert_close(traj.final_latents, expected, rtol=0, atol=1e-5)


def test_training_timesteps_and_target_follow_the_dreambooth_script(pipe):
    family = family_of_pipeline(pipe)
    scheduler = pipe.scheduler
    scheduler.set_timesteps(4, mu=0.6 if family.name == "flux" else None)  # a pipeline that has sampled: the training table must not change with it
    draw = family.draw_training_timesteps(scheduler, 64, torch.Generator().manual_seed(3))
    again = family.draw_training_timesteps(scheduler, 64, torch.Generator().manual_seed(3))
    torch.testing.assert_close(draw, again, rtol=0, atol=0)
    # the scripts: u = sigmoid(N(0, 1)) (SD3's logit_normal) or U(0, 1) (FLUX's "none"),
    # timesteps = table.timesteps[floor(1000 u)] in the scheduler's 1000-step training table
    table = type(scheduler).from_config(scheduler.config)
    if family.name == "sd3":
        u = torch.sigmoid(torch.normal(0.0, 1.0, (64,), generator=torch.Generator().manual_seed(3)))
    else:
        u = torch.rand(64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(draw, table.timesteps[(u * 1000).long()], rtol=0, atol=0)

    # FLUX's dynamic shifting leaves the training table unshifted; SD3's static shift 3 shifts it
    assert (table.sigmas[500] > 0.51) == (family.name == "sd3")
    x0, noise = torch.randn(2, 64, 4, 16, 16).unbind(0)
    noisy, target = family.noisy_and_target(scheduler, x0, noise, draw)
    sigma = table.sigmas[[int((table.timesteps == t).nonzero()) for t in draw]].reshape(-1, 1, 1, 1)  # get_sigmas
    torch.testing.assert_close(noisy, (1 - sigma) * x0 + sigma * noise, rtol=0, atol=1e-6)
    torch.testing.assert_close(target, noise - x0, rtol=0, atol=0)


def test_vae_latents_are_shifted_then_scaled(pipe):
    family = family_of_pipeline(pipe)
    assert (pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor) == (VAE_SHIFT, VAE_SCALE)
    pixels = torch.rand(2, 3, RES, RES, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = family.encode_images(pipe, pixels)
    with torch.no_grad():
        mean = pipe.vae.encode(pixels).latent_dist.mean
        torch.testing.assert_close(latents, (mean - VAE_SHIFT) * VAE_SCALE)
        round_trip = (pipe.vae.decode(mean).sample / 2 + 0.5).clamp(0, 1)
    torch.testing.assert_close(family.decode_latents(pipe, latents), round_trip, rtol=0, atol=1e-5)
    assert latents.shape[1:] == family.latent_shape(pipe, RES)


def test_decode_latents_is_how_the_pipeline_makes_images(pipe):
    latents = initial_latents(pipe)
    final = pipeline_call(pipe, latents, num_inference_steps=2, guidance_scale=1.0, output_type="latent")
    images = pipeline_call(pipe, latents, num_inference_steps=2, guidance_scale=1.0, output_type="pt")
    torch.testing.assert_close(family_of_pipeline(pipe).decode_latents(pipe, final), images, rtol=0, atol=1e-5)


def with_trained_looking_lora(pipe):
    family = family_of_pipeline(pipe)
    add_lora(family.denoiser(pipe), rank=4, target_modules=family.lora_targets)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in family.denoiser(pipe).named_parameters():
            if "lora_B" in name:  # B starts at zero: give the adapter an effect
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return family


def test_lora_saved_by_the_family_loads_with_the_diffusers_pipeline(built, pipe, tmp_path):
    base_out = pipeline_call(pipe, initial_latents(pipe), num_inference_steps=2, guidance_scale=2.0, output_type="latent")
    family = with_trained_looking_lora(pipe)
    adapted = {n for n, _ in family.denoiser(pipe).named_modules() if n.endswith("lora_A")}
    assert any(".attn.add_q_proj." in n for n in adapted) and any(".attn.to_q." in n for n in adapted)
    assert any(".ff.net.0.proj." in n for n in adapted) == (family.name == "flux")
    in_memory = pipeline_call(pipe, initial_latents(pipe), num_inference_steps=2, guidance_scale=2.0, output_type="latent")
    saved = family.save_lora(family.denoiser(pipe), tmp_path / "lora")
    assert saved.name == "pytorch_lora_weights.safetensors" and saved.is_file()

    fresh = load_pipeline(built[1])  # the pipeline's own loader, on a fresh pipeline
    fresh.load_lora_weights(str(tmp_path / "lora"))
    loaded = pipeline_call(fresh, initial_latents(pipe), num_inference_steps=2, guidance_scale=2.0, output_type="latent")
    torch.testing.assert_close(loaded, in_memory, rtol=0, atol=1e-5)
    assert (loaded - base_out).abs().max() > 1e-3

    trained = load_trained(str(tmp_path / "lora"), base=built[1])
    again = pipeline_call(trained, initial_latents(pipe), num_inference_steps=2, guidance_scale=2.0, output_type="latent")
    torch.testing.assert_close(again, in_memory, rtol=0, atol=1e-5)


def test_full_transformer_folder_loads_with_load_trained(built, pipe, tmp_path):
    family = family_of_pipeline(pipe)
    with torch.no_grad():
        for param in pipe.transformer.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    expected = pipeline_call(pipe, initial_latents(pipe), num_inference_steps=2, guidance_scale=2.0, output_type="latent")
    folder = save_full_unet(pipe.transformer, tmp_path / "final", family=family)
    assert folder.name == "transformer"
    trained = load_trained(str(tmp_path / "final"), base=built[1])
    got = pipeline_call(trained, initial_latents(pipe), num_inference_steps=2, guidance_scale=2.0, output_type="latent")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("part", ["transformer", "text_encoder"])
def test_a_truncated_weights_file_is_one_clear_error(built, tmp_path, part):
    broken = tmp_path / "broken"
    shutil.copytree(built[1], broken)
    weights = next((broken / part).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError) as err:
        load_pipeline(str(broken))
    assert "\n" not in str(err.value) and str(broken) in str(err.value)


def test_generate_images_samples_each_family(pipe):
    """align.pipeline.generate_images (evaluation, best-of-N) with the family's generation arguments: image i
    depends on its prompt and seed only."""
    together = generate_images(pipe, PROMPTS, [3, 4], num_inference_steps=2, guidance_scale=2.0, height=RES, width=RES)
    alone = generate_images(pipe, PROMPTS[1:], [4], num_inference_steps=2, guidance_scale=2.0, height=RES, width=RES)
    assert together.shape == (2, 3, RES, RES) and 0 <= together.min() and together.max() <= 1
    torch.testing.assert_close(alone[0], together[1], rtol=0, atol=1e-5)


def test_lora_training_step_reaches_only_the_adapter(pipe):
    family = with_trained_looking_lora(pipe)
    denoiser = family.denoiser(pipe)
    x0 = torch.randn(2, *family.latent_shape(pipe, RES), generator=torch.Generator().manual_seed(0))
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    timesteps = family.draw_training_timesteps(pipe.scheduler, 2, torch.Generator().manual_seed(2))
    noisy, target = family.noisy_and_target(pipe.scheduler, x0, noise, timesteps)
    loss = torch.nn.functional.mse_loss(family.predict(denoiser, noisy, timesteps, family.encode_prompts(pipe, PROMPTS, RES)), target)
    loss.backward()
    grads = {name: p.grad for name, p in denoiser.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in name for name in grads)
    assert all(g is not None for g in grads.values()) and any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("built", ["sd3"], indirect=True)
def test_sd3_with_dynamic_shifting_samples_as_the_pipeline(built, pipe):
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, use_dynamic_shifting=True)
    latents = initial_latents(pipe)
    expected = pipeline_call(pipe, latents, num_inference_steps=3, guidance_scale=2.0, output_type="latent")
    sigmas = family_of_pipeline(pipe).flow_sigmas(pipe, 3, RES)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas.cpu(), rtol=0, atol=1e-7)
    torch.testing.assert_close(euler_latents(pipe, latents, 3, 2.0), expected, rtol=0, atol=1e-5)


def test_conditioning_batches_concatenate(pipe):
    family = family_of_pipeline(pipe)
    both = family.encode_prompts(pipe, PROMPTS, RES)
    parts = cat_conditioning([family.encode_prompts(pipe, [p], RES) for p in PROMPTS])
    for key in both:
        torch.testing.assert_close(parts[key], both[key], rtol=0, atol=1e-6)


def test_model_index_of_the_t5_less_folder_has_null_t5(built):
    kind, folder = built
    index = json.loads((Path(folder) / "model_index.json").read_text())
    assert (index.get("text_encoder_3") == [None, None]) == (kind == "sd3")


def test_flux_packing_is_the_pipelines():
    latents = torch.randn(2, 4, 6, 10)
    packed = pack_latents(latents)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(latents, 2, 4, 6, 10), rtol=0, atol=0)
    torch.testing.assert_close(unpack_latents(packed, 6, 10), latents, rtol=0, atol=0)
    torch.testing.assert_close(unpack_latents(packed, 6, 10), FluxPipeline._unpack_latents(packed, 6 * 8, 10 * 8, 8),
                               rtol=0, atol=0)
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32)
    torch.testing.assert_close(latent_image_ids(6, 10, "cpu", torch.float32), ids, rtol=0, atol=0)


@pytest.mark.parametrize("built", ["flux_dev"], indirect=True)
def test_flux_sigmas_shift_with_the_resolution(built, pipe):
    family = family_of_pipeline(pipe)
    latents = torch.randn(1, *family.latent_shape(pipe, 2 * RES), generator=torch.Generator().manual_seed(0))
    pipe(PROMPTS[:1], latents=pack_latents(latents), height=2 * RES, width=2 * RES, num_inference_steps=3,
         output_type="latent", **family.generation_kwargs(pipe))
    torch.testing.assert_close(family.flow_sigmas(pipe, 3, 2 * RES), pipe.scheduler.sigmas.cpu(), rtol=0, atol=1e-7)
    assert (family.flow_sigmas(pipe, 3, 2 * RES)[1:3] > family.flow_sigmas(pipe, 3, RES)[1:3]).all()  # more tokens, more shift


@pytest.mark.parametrize("built", ["sd3"], indirect=True)
def test_sd3_schedule_at_shift_3_is_sd35s(built, pipe):
    """SD3.5-M's published 10-step timesteps (shift 3, docs reference facts) from flow_sigmas."""
    published = [1000, 960.1, 913.3, 857.7, 790.4, 707.3, 602.2, 464.9, 278.0, 8.9, 0]
    got = family_of_pipeline(pipe).flow_sigmas(pipe, 10, RES) * 1000
    torch.testing.assert_close(got, torch.tensor(published), rtol=0, atol=0.06)


@pytest.mark.parametrize("built", ["flux_dev"], indirect=True)
def test_flux_shift_for_1024_image_tokens_is_mu_063(built, pipe):
    """FLUX at 512 px has 1024 packed tokens and mu = 0.5 + 0.65 (1024 - 256) / 3840 = 0.63; the tiny VAE
    downsamples by 2 instead of 8, so 128 px gives the same token count."""
    family = family_of_pipeline(pipe)
    assert family.latent_shape(pipe, 128)[1:] == (64, 64)
    base = torch.linspace(1.0, 1 / 8, 8, dtype=torch.float64)
    mu = torch.tensor(0.63, dtype=torch.float64)
    expected = torch.cat([mu.exp() / (mu.exp() + (1 / base - 1)), torch.zeros(1, dtype=torch.float64)]).float()
    torch.testing.assert_close(family.flow_sigmas(pipe, 8, 128), expected, rtol=0, atol=1e-6)

"""The SDXL family (align/families/sdxl.py) against StableDiffusionXLPipeline itself, on a tiny random SDXL."""

import json
import shutil

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, StableDiffusionXLPipeline
from safetensors.torch import load_file

from align.families import family_of_pipeline
from align.families.base import LORA_WEIGHTS, ModelLoadError, guided_prediction
from align.families.sdxl import StableDiffusionXL
from align.pipeline import add_lora, generate_images, load_pipeline, load_trained, save_full_unet

PROMPTS = ["a red circle", "two blue squares on the left"]
SEEDS = [3, 4]


@pytest.fixture(scope="module")
def pipe(tiny_sdxl_model):
    return load_pipeline(tiny_sdxl_model)


def fresh_diffusers_pipeline(folder):
    """Plain diffusers, nothing of ours, with the DDIM scheduler our family samples with."""
    plain = StableDiffusionXLPipeline.from_pretrained(folder)
    plain.scheduler = DDIMScheduler.from_config(plain.scheduler.config)
    plain.set_progress_bar_config(disable=True)
    return plain


def images(pipe):
    return generate_images(pipe, PROMPTS, SEEDS, num_inference_steps=3, guidance_scale=5.0, height=32, width=32)


def test_the_family_is_detected_and_loads_with_ddim_and_its_frozen_modules(pipe):
    family = family_of_pipeline(pipe)
    assert isinstance(family, StableDiffusionXL)
    assert type(pipe.scheduler).__name__ == "DDIMScheduler" and pipe.scheduler.config.clip_sample is False
    frozen = family.frozen_modules(pipe)
    assert [id(m) for m in frozen] == [id(pipe.vae), id(pipe.text_encoder), id(pipe.text_encoder_2)]
    assert family.denoiser(pipe) is pipe.unet


def test_a_broken_folder_is_one_model_load_error_line(tiny_sdxl_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_sdxl_model, broken)
    shutil.rmtree(broken / "unet")
    with pytest.raises(ModelLoadError) as err:
        load_pipeline(str(broken))
    assert "Stable Diffusion XL" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("resolution", [32, 48])
def test_encode_prompts_is_the_pipelines_encoding_and_time_ids(pipe, resolution):
    family = family_of_pipeline(pipe)
    cond = family.encode_prompts(pipe, PROMPTS, resolution)
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(PROMPTS, device="cpu", do_classifier_free_guidance=False)
        time_ids = pipe._get_add_time_ids((resolution, resolution), (0, 0), (resolution, resolution), embeds.dtype,
                                          text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim)
    assert torch.equal(cond["prompt_embeds"], embeds) and cond["prompt_embeds"].shape == (2, 77, 40)
    assert torch.equal(cond["pooled_embeds"], pooled) and cond["pooled_embeds"].shape == (2, 12)
    assert torch.equal(cond["time_ids"], time_ids.repeat(2, 1))
    assert cond["time_ids"][0].tolist() == [resolution, resolution, 0, 0, resolution, resolution]


def test_encode_prompts_without_a_resolution_uses_the_pipelines_default_side(pipe):
    cond = family_of_pipeline(pipe).encode_prompts(pipe, PROMPTS)
    assert cond["time_ids"][0].tolist() == [32, 32, 0, 0, 32, 32]


@pytest.mark.parametrize("force_zeros", [True, False])
def test_unconditional_is_what_the_pipeline_uses_without_a_negative_prompt(pipe, force_zeros):
    family = family_of_pipeline(pipe)
    saved = pipe.config.force_zeros_for_empty_prompt
    pipe.register_to_config(force_zeros_for_empty_prompt=force_zeros)
    try:
        uncond = family.unconditional(pipe, 2, 32)
        with torch.no_grad():
            _, negative, _, negative_pooled = pipe.encode_prompt(PROMPTS, device="cpu", do_classifier_free_guidance=True)
    finally:
        pipe.register_to_config(force_zeros_for_empty_prompt=saved)
    # encoded alone vs in a batch of two: equal up to float rounding
    assert torch.allclose(uncond["prompt_embeds"], negative, atol=1e-6)
    assert torch.allclose(uncond["pooled_embeds"], negative_pooled, atol=1e-6)
    assert bool((negative == 0).all()) == force_zeros
    assert torch.equal(uncond["time_ids"], family.encode_prompts(pipe, PROMPTS, 32)["time_ids"])
    # encode_prompts([""]) is the text "" (what the authors' training feeds for a dropped caption), never zeros
    assert not bool((family.encode_prompts(pipe, [""], 32)["prompt_embeds"] == 0).all())


@pytest.mark.parametrize("resolution", [32, 48])
def test_ddim_through_guided_prediction_reproduces_the_pipeline(pipe, resolution):
    family = family_of_pipeline(pipe)
    side = resolution // pipe.vae_scale_factor
    start = torch.randn(2, 4, side, side, generator=torch.Generator().manual_seed(0))
    expected = pipe(PROMPTS, num_inference_steps=4, guidance_scale=5.0, latents=start.clone(), height=resolution,
                    width=resolution, output_type="latent").images
    cond, uncond = family.encode_prompts(pipe, PROMPTS, resolution), family.unconditional(pipe, 2, resolution)
    scheduler = pipe.scheduler
    scheduler.set_timesteps(4)
    x = start * scheduler.init_noise_sigma
    with torch.no_grad():
        for t in scheduler.timesteps:
            eps = guided_prediction(family, pipe.unet, scheduler.scale_model_input(x, t), t.expand(2), cond, uncond, 5.0)
            x = scheduler.step(eps, t, x, eta=0.0).prev_sample
    assert family.latent_shape(pipe, resolution) == tuple(start.shape[1:])
    assert torch.allclose(x, expected, atol=1e-5), (x - expected).abs().max()
    # the micro-conditioning reaches the UNet: other time ids, other output
    wrong = {**cond, "time_ids": family.encode_prompts(pipe, PROMPTS, 2 * resolution)["time_ids"]}
    with torch.no_grad():
        t = scheduler.timesteps[:1].expand(2)
        assert not torch.allclose(family.predict(pipe.unet, start, t, wrong), family.predict(pipe.unet, start, t, cond))


def test_images_encode_and_decode_as_the_pipeline_does(pipe):
    family = family_of_pipeline(pipe)
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        mean = pipe.vae.encode(pixels).latent_dist.mean
    assert torch.allclose(family.encode_images(pipe, pixels), mean * 0.13025)
    start = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    kwargs = dict(num_inference_steps=2, guidance_scale=5.0, height=32, width=32)
    latents = pipe(PROMPTS[:1], latents=start.clone(), output_type="latent", **kwargs).images
    shown = pipe(PROMPTS[:1], latents=start.clone(), output_type="pt", **kwargs).images
    assert torch.allclose(family.decode_latents(pipe, latents), shown, atol=1e-6)


def test_a_vae_with_latent_statistics_is_normalised_as_the_pipeline_does(tiny_sdxl_model):
    pipe = load_pipeline(tiny_sdxl_model)
    family = family_of_pipeline(pipe)
    mean, std = [0.1, -0.2, 0.3, 0.0], [1.5, 0.5, 2.0, 1.0]
    pipe.vae.register_to_config(latents_mean=mean, latents_std=std)
    start = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    kwargs = dict(num_inference_steps=2, guidance_scale=5.0, height=32, width=32)
    latents = pipe(PROMPTS[:1], latents=start.clone(), output_type="latent", **kwargs).images
    shown = pipe(PROMPTS[:1], latents=start.clone(), output_type="pt", **kwargs).images
    assert torch.allclose(family.decode_latents(pipe, latents), shown, atol=1e-6)
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        raw = pipe.vae.encode(pixels).latent_dist.mean
    m, s = torch.tensor(mean).view(1, 4, 1, 1), torch.tensor(std).view(1, 4, 1, 1)
    assert torch.allclose(family.encode_images(pipe, pixels), (raw - m) * 0.13025 / s, atol=1e-6)


def test_a_float16_vae_with_force_upcast_runs_in_float32_and_stays_float16(tiny_sdxl_model):
    pipe = load_pipeline(tiny_sdxl_model)
    family = family_of_pipeline(pipe)
    pipe.vae.to(torch.float16)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype)) for m in (pipe.vae.encoder, pipe.vae.decoder)]
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = family.encode_images(pipe, pixels)
    family.decode_latents(pipe, latents)
    for hook in hooks:
        hook.remove()
    assert seen == [torch.float32, torch.float32] and pipe.vae.dtype == torch.float16 and latents.dtype == torch.float16
    pipe.vae.register_to_config(force_upcast=False)  # the fp16-fix VAE: runs in its own dtype
    seen.clear()
    pipe.vae.decoder.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    family.decode_latents(pipe, latents)
    assert seen == [torch.float16]


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_training_target_follows_the_prediction_type(pipe, prediction_type):
    family = family_of_pipeline(pipe)
    scheduler = DDPMScheduler.from_config(pipe.scheduler.config, prediction_type=prediction_type)
    timesteps = family.draw_training_timesteps(scheduler, 64, torch.Generator().manual_seed(0))
    assert timesteps.min() >= 0 and timesteps.max() < 1000 and len(set(timesteps.tolist())) > 32
    x0, noise = torch.randn(64, 4, 4, 4), torch.randn(64, 4, 4, 4)
    noisy, target = family.noisy_and_target(scheduler, x0, noise, timesteps)
    alpha = scheduler.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    assert torch.allclose(noisy, alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise, atol=1e-6)
    expected = noise if prediction_type == "epsilon" else alpha.sqrt() * noise - (1 - alpha).sqrt() * x0
    assert torch.allclose(target, expected, atol=1e-6)


@pytest.fixture(scope="module")
def adapted(tiny_sdxl_model, tmp_path_factory):
    """The tiny SDXL with a LoRA whose B matrices are non-zero, its images and the saved LoRA folder."""
    pipe = load_pipeline(tiny_sdxl_model)
    family = family_of_pipeline(pipe)
    base_images = images(pipe)
    add_lora(pipe.unet, rank=2, target_modules=family.lora_targets)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in pipe.unet.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    folder = tmp_path_factory.mktemp("sdxl_lora")
    written = family.save_lora(pipe.unet, folder)
    return pipe, base_images, images(pipe), folder, written


def test_lora_targets_are_the_dreambooth_sdxl_scripts(adapted):
    pipe = adapted[0]
    adapted_names = {name.rsplit(".", 1)[0].split(".lora_A")[0] for name, _ in pipe.unet.named_parameters() if "lora_A" in name}
    assert adapted_names and all(name.endswith(("to_q", "to_k", "to_v", "to_out.0")) for name in adapted_names)
    assert StableDiffusionXL.lora_targets == ("to_q", "to_k", "to_v", "to_out.0")


def test_the_saved_lora_loads_in_a_fresh_diffusers_sdxl_pipeline(adapted, tiny_sdxl_model):
    _, base_images, adapted_images, folder, written = adapted
    assert written == folder / LORA_WEIGHTS
    keys = list(load_file(str(written)))
    assert keys and all(key.startswith("unet.") for key in keys)
    assert not torch.allclose(adapted_images, base_images, atol=1e-3)
    plain = fresh_diffusers_pipeline(tiny_sdxl_model)
    plain.load_lora_weights(str(folder))
    assert torch.allclose(images(plain), adapted_images, atol=1e-5)


def test_load_trained_applies_the_lora_folder_on_its_base(adapted, tiny_sdxl_model):
    _, _, adapted_images, folder, _ = adapted
    trained = load_trained(str(folder), base=tiny_sdxl_model)
    assert isinstance(family_of_pipeline(trained), StableDiffusionXL)
    assert torch.allclose(images(trained), adapted_images, atol=1e-5)


def test_a_full_unet_round_trips_through_load_trained(tiny_sdxl_model, tmp_path):
    pipe = load_pipeline(tiny_sdxl_model)
    family = family_of_pipeline(pipe)
    base_images = images(pipe)
    with torch.no_grad():
        pipe.unet.conv_out.weight.mul_(1.5)
        pipe.unet.add_embedding.linear_1.weight.mul_(2.0)  # the added (pooled + time ids) embedding is saved too
    tuned_images = images(pipe)
    target = save_full_unet(pipe.unet, tmp_path, family)
    assert target == tmp_path / "unet" and json.loads((target / "config.json").read_text())["addition_embed_type"] == "text_time"
    trained = load_trained(str(tmp_path), base=tiny_sdxl_model)
    assert torch.allclose(images(trained), tuned_images, atol=1e-6)
    assert not torch.allclose(tuned_images, base_images, atol=1e-3)


def test_a_lora_trains_through_predict_on_the_family_target(tiny_sdxl_model):
    """Gradients reach the LoRA through the added (pooled + time ids) conditioning, and a few steps on
    one batch lower the denoising loss on it."""
    pipe = load_pipeline(tiny_sdxl_model)
    family = family_of_pipeline(pipe)
    add_lora(pipe.unet, rank=4, target_modules=family.lora_targets)
    cond = family.encode_prompts(pipe, PROMPTS, 32)
    generator = torch.Generator().manual_seed(0)
    x0 = family.encode_images(pipe, torch.rand(2, 3, 32, 32, generator=generator) * 2 - 1)
    noise = torch.randn(x0.shape, generator=generator)
    timesteps = family.draw_training_timesteps(pipe.scheduler, 2, generator)
    noisy, target = family.noisy_and_target(pipe.scheduler, x0, noise, timesteps)
    params = [p for p in pipe.unet.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(4):
        loss = torch.nn.functional.mse_loss(family.predict(pipe.unet, noisy, timesteps, cond), target)
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in params)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]

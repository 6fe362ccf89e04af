"""The SD 1.x/2.x family (align/families/sd.py) against StableDiffusionPipeline itself: prompt encoding, the
unconditional side, VAE encode/decode, DDIM sampling through the family, and SD 2.x's v-prediction
(training target and sampling through align/sampling/ddim.py)."""

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel

from align.families import family_of_pipeline
from align.families.base import guided_prediction
from align.families.sd import StableDiffusion
from align.pipeline import load_pipeline
from align.sampling.ddim import ddim_step_with_logprob, sample_with_logprob

PROMPTS = ["a red circle", "two blue squares on the left"]


@pytest.fixture(scope="module")
def tiny_sd2_model(tiny_model, tmp_path_factory):
    """The tiny SD pipeline made SD 2.1-like: v-prediction DDIM scheduler (SD 2.1's scheduler config) and a UNet
    with linear projections, per-block head sizes and upcast attention (SD 2.x's UNet settings)."""
    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None, requires_safety_checker=False)
    torch.manual_seed(1)
    pipe.unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=(2, 4), use_linear_projection=True, upcast_attention=True,
        norm_num_groups=8,
    )
    pipe.scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False,
        steps_offset=1, prediction_type="v_prediction",
    )
    folder = tmp_path_factory.mktemp("tiny_sd2") / "pipeline"
    pipe.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=["sd1", "sd2"])
def pipe(request, tiny_model, tiny_sd2_model):
    return load_pipeline(tiny_model if request.param == "sd1" else tiny_sd2_model)


def test_the_family_is_sd_and_keeps_the_prediction_type(pipe):
    assert isinstance(family_of_pipeline(pipe), StableDiffusion)
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    expected = "v_prediction" if pipe.unet.config.use_linear_projection else "epsilon"
    assert pipe.scheduler.config.prediction_type == expected


def test_encoding_and_the_unconditional_side_are_the_pipelines(pipe):
    family = family_of_pipeline(pipe)
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt(PROMPTS, "cpu", 1, True)
    assert torch.equal(family.encode_prompts(pipe, PROMPTS)["prompt_embeds"], embeds)
    # the SD pipeline encodes "" for a missing negative prompt (base default of ModelFamily.unconditional)
    uncond = family.unconditional(pipe, 2)
    assert set(uncond) == {"prompt_embeds"} and torch.allclose(uncond["prompt_embeds"], negative, atol=1e-6)


def test_images_encode_to_the_scaled_posterior_mean_and_decode_as_the_pipeline(pipe):
    family = family_of_pipeline(pipe)
    pixels = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        mean = pipe.vae.encode(pixels).latent_dist.mean
    assert torch.allclose(family.encode_images(pipe, pixels), mean * pipe.vae.config.scaling_factor)
    start = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    kwargs = dict(num_inference_steps=2, guidance_scale=5.0)
    latents = pipe(PROMPTS[:1], latents=start.clone(), output_type="latent", **kwargs).images
    shown = pipe(PROMPTS[:1], latents=start.clone(), output_type="pt", **kwargs).images
    assert torch.allclose(family.decode_latents(pipe, latents), shown, atol=1e-6)


def test_ddim_through_guided_prediction_reproduces_the_pipeline(pipe):
    family = family_of_pipeline(pipe)
    start = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    expected = pipe(PROMPTS, num_inference_steps=4, guidance_scale=5.0, latents=start.clone(), output_type="latent").images
    cond, uncond = family.encode_prompts(pipe, PROMPTS), family.unconditional(pipe, 2)
    scheduler = pipe.scheduler
    scheduler.set_timesteps(4)
    x = start.clone()
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(guided_prediction(family, pipe.unet, x, t.expand(2), cond, uncond, 5.0), t, x).prev_sample
    assert torch.allclose(x, expected, atol=1e-5), (x - expected).abs().max()


def test_sd2_v_prediction_trains_on_the_velocity(tiny_sd2_model):
    pipe = load_pipeline(tiny_sd2_model)
    family = family_of_pipeline(pipe)
    scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    assert scheduler.config.prediction_type == "v_prediction"
    timesteps = torch.tensor([0, 250, 500, 999])
    x0, noise = torch.randn(4, 4, 8, 8), torch.randn(4, 4, 8, 8)
    noisy, target = family.noisy_and_target(scheduler, x0, noise, timesteps)
    alpha = scheduler.alphas_cumprod[timesteps].view(-1, 1, 1, 1)
    # v = √ᾱ·ε − √(1−ᾱ)·x0 (Salimans & Ho 2022), diffusers' get_velocity
    assert torch.allclose(target, alpha.sqrt() * noise - (1 - alpha).sqrt() * x0, atol=1e-6)
    assert torch.allclose(target, scheduler.get_velocity(x0, noise, timesteps))
    assert torch.allclose(noisy, scheduler.add_noise(x0, noise, timesteps))
    # the velocity target and the noisy latents give back x0: √ᾱ·x_t − √(1−ᾱ)·v = x0
    assert torch.allclose(alpha.sqrt() * noisy - (1 - alpha).sqrt() * target, x0, atol=1e-5)


def test_sd2_stochastic_ddim_through_align_sampling_matches_the_pipeline(tiny_sd2_model):
    """The DDPO sampler (align/sampling/ddim.py) on a v-prediction model: with η = 1 and the same generator, the
    pipeline's own chain (its scheduler draws the step noise) and ours agree, step by step and whole."""
    pipe = load_pipeline(tiny_sd2_model)
    family = family_of_pipeline(pipe)
    start = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    expected = pipe(PROMPTS, num_inference_steps=4, guidance_scale=5.0, latents=start.clone(), eta=1.0,
                    generator=torch.Generator().manual_seed(7), output_type="latent").images
    cond, uncond = family.encode_prompts(pipe, PROMPTS), family.unconditional(pipe, 2)
    trajectory = sample_with_logprob(
        pipe.unet, pipe.scheduler, cond["prompt_embeds"], uncond["prompt_embeds"], num_inference_steps=4,
        guidance_scale=5.0, eta=1.0, latents=start.clone(), generator=torch.Generator().manual_seed(7),
    )
    assert torch.allclose(trajectory.final_latents, expected, atol=1e-5)
    # the per-step function with the family's guided prediction takes the same steps
    x, generator = start.clone(), torch.Generator().manual_seed(7)
    with torch.no_grad():
        for i, t in enumerate(pipe.scheduler.timesteps):
            prediction = guided_prediction(family, pipe.unet, x, t.expand(2), cond, uncond, 5.0)
            x, log_prob = ddim_step_with_logprob(pipe.scheduler, prediction, t, x, 1.0, generator=generator)
            assert torch.allclose(x, trajectory.all_latents[:, i + 1], atol=1e-5)
            assert torch.allclose(log_prob, trajectory.log_probs[:, i], atol=1e-5)
    # a v-prediction model read as epsilon would step elsewhere: the prediction type is really used
    scheduler = pipe.scheduler
    epsilon = type(scheduler).from_config(scheduler.config, prediction_type="epsilon")
    epsilon.set_timesteps(4)
    t = scheduler.timesteps[0]
    with torch.no_grad():
        prediction = guided_prediction(family, pipe.unet, start, t.expand(2), cond, uncond, 5.0)
    as_v = ddim_step_with_logprob(scheduler, prediction, t, start, 1.0, generator=torch.Generator().manual_seed(7))[0]
    as_eps = ddim_step_with_logprob(epsilon, prediction, t, start, 1.0, generator=torch.Generator().manual_seed(7))[0]
    assert not torch.allclose(as_v, as_eps, atol=1e-3)

"""The DDPO sampler: agreement with diffusers' DDIMScheduler.step and the Gaussian log-density."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, UNet2DConditionModel
from scipy.stats import norm

from align.pipeline import add_lora, merged_adapter
from align.sampling.ddim import (
    check_scheduler_steps,
    ddim_deterministic_jump,
    ddim_step_mean_std,
    ddim_step_with_logprob,
    guided_noise_prediction,
    sample_with_logprob,
)

SD_SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
)


def make_scheduler(num_steps=20, **overrides):
    scheduler = DDIMScheduler(**{**SD_SCHEDULER, **overrides})
    scheduler.set_timesteps(num_steps)
    return scheduler


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("step_index", [0, 7, 19])  # 19: the last step (previous timestep < 0)
def test_step_matches_diffusers(prediction_type, eta, step_index):
    scheduler = make_scheduler(prediction_type=prediction_type)
    g = torch.Generator().manual_seed(step_index)
    sample = torch.randn(3, 4, 8, 8, generator=g)
    model_output = torch.randn(3, 4, 8, 8, generator=g)
    noise = torch.randn(3, 4, 8, 8, generator=g)
    t = int(scheduler.timesteps[step_index])

    expected = scheduler.step(model_output, t, sample, eta=eta, variance_noise=noise).prev_sample
    mean, std = ddim_step_mean_std(scheduler, model_output, t, sample, eta)
    ours = mean + std * noise
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)

    # Scoring diffusers' own sample gives the same log-prob as scoring ours.
    _, logp_theirs = ddim_step_with_logprob(scheduler, model_output, t, sample, eta, prev_sample=expected)
    _, logp_ours = ddim_step_with_logprob(scheduler, model_output, t, sample, eta, prev_sample=ours)
    torch.testing.assert_close(logp_theirs, logp_ours, atol=1e-5, rtol=1e-5)


def test_step_with_generator_draws_the_same_noise_as_diffusers():
    scheduler = make_scheduler()
    sample, model_output = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = int(scheduler.timesteps[5])
    expected = scheduler.step(model_output, t, sample, eta=1.0, generator=torch.Generator().manual_seed(3)).prev_sample
    ours, _ = ddim_step_with_logprob(scheduler, model_output, t, sample, 1.0, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_batched_over_timesteps_matches_per_sample_steps(prediction_type):
    scheduler = make_scheduler(num_steps=10, prediction_type=prediction_type)
    idx = [0, 4, 9, 2]
    ts = scheduler.timesteps[idx]
    sample, model_output, noise = torch.randn(3, 4, 4, 8, 8).unbind(0)
    mean, std = ddim_step_mean_std(scheduler, model_output, ts, sample, 0.8)
    for i, t in enumerate(ts.tolist()):
        expected = scheduler.step(model_output[i : i + 1], t, sample[i : i + 1], eta=0.8, variance_noise=noise[i : i + 1])
        torch.testing.assert_close(mean[i : i + 1] + std[i : i + 1] * noise[i : i + 1], expected.prev_sample, atol=1e-5, rtol=1e-5)


def test_clip_sample_is_followed():
    scheduler = make_scheduler(clip_sample=True, clip_sample_range=1.0)
    sample, model_output, noise = torch.randn(3, 2, 4, 8, 8).mul(5).unbind(0)
    t = int(scheduler.timesteps[3])
    expected = scheduler.step(model_output, t, sample, eta=1.0, variance_noise=noise).prev_sample
    mean, std = ddim_step_mean_std(scheduler, model_output, t, sample, 1.0)
    torch.testing.assert_close(mean + std * noise, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("step_index", [0, 11, 19])
def test_log_prob_is_the_hand_computed_gaussian_density(step_index):
    eta = 1.0
    scheduler = make_scheduler()
    torch.manual_seed(0)
    sample, eps = torch.randn(2, 2, 4, 4, 4).unbind(0)
    t = int(scheduler.timesteps[step_index])
    prev_sample, log_prob = ddim_step_with_logprob(scheduler, eps, t, sample, eta, generator=torch.Generator().manual_seed(1))

    # The step's mean and variance from the DDIM formulas, in float64 numpy.
    ac = scheduler.alphas_cumprod.double().numpy()
    prev_t = t - 1000 // 20
    a_t = ac[t]
    a_prev = ac[prev_t] if prev_t >= 0 else float(scheduler.final_alpha_cumprod)
    x, e = sample.double().numpy(), eps.double().numpy()
    x0 = (x - np.sqrt(1 - a_t) * e) / np.sqrt(a_t)
    sigma = eta * np.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
    mu = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev - sigma**2) * e
    density = norm.logpdf(prev_sample.double().numpy(), loc=mu, scale=sigma)
    expected = density.reshape(2, -1).mean(axis=1)
    np.testing.assert_allclose(log_prob.numpy(), expected, atol=1e-4, rtol=1e-5)


def test_eta_zero_is_refused():
    scheduler = make_scheduler()
    x = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match="eta must be > 0"):
        ddim_step_with_logprob(scheduler, x, int(scheduler.timesteps[0]), x, 0.0)


def test_deterministic_last_step_is_refused():
    with pytest.raises(ValueError, match="set_alpha_to_one"):
        check_scheduler_steps(DDIMScheduler(**{**SD_SCHEDULER, "set_alpha_to_one": True}), 10, 1.0)
    check_scheduler_steps(DDIMScheduler(**SD_SCHEDULER), 10, 1.0)


@pytest.fixture(scope="module")
def tiny_unet(tmp_path_factory):
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    folder = tmp_path_factory.mktemp("unet")
    unet.save_pretrained(folder)
    return UNet2DConditionModel.from_pretrained(folder).eval()


def test_trajectory_matches_diffusers_chain_and_rescoring(tiny_unet):
    steps, guidance, eta = 6, 4.0, 1.0
    cond, uncond = torch.randn(2, 2, 5, 16).unbind(0)
    noise = torch.randn(2, 4, 8, 8)
    scheduler = DDIMScheduler(**SD_SCHEDULER)
    traj = sample_with_logprob(
        tiny_unet, scheduler, cond, uncond, num_inference_steps=steps, guidance_scale=guidance,
        eta=eta, latents=noise, generator=torch.Generator().manual_seed(7),
    )
    assert traj.all_latents.shape == (2, steps + 1, 4, 8, 8)
    assert traj.log_probs.shape == (2, steps) and traj.timesteps.shape == (2, steps)
    assert torch.isfinite(traj.log_probs).all()

    # The same chain through diffusers' scheduler.step with the same generator.
    reference = DDIMScheduler(**SD_SCHEDULER)
    reference.set_timesteps(steps)
    x, gen = noise.clone(), torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in reference.timesteps:
            pred = guided_noise_prediction(tiny_unet, x, t, cond, uncond, guidance)
            x = reference.step(pred, t, x, eta=eta, generator=gen).prev_sample
    torch.testing.assert_close(traj.final_latents, x, atol=1e-5, rtol=1e-5)

    # Re-scoring the stored steps with shuffled timesteps per sample reproduces the stored log-probs.
    perm = torch.stack([torch.randperm(steps) for _ in range(2)])
    rows = torch.arange(2)[:, None]
    with torch.no_grad():
        for j in range(steps):
            lat, nxt, ts = traj.latents[rows, perm][:, j], traj.next_latents[rows, perm][:, j], traj.timesteps[rows, perm][:, j]
            pred = guided_noise_prediction(tiny_unet, lat, ts, cond, uncond, guidance)
            _, logp = ddim_step_with_logprob(scheduler, pred, ts, lat, eta, prev_sample=nxt)
            torch.testing.assert_close(logp, traj.log_probs[rows, perm][:, j], atol=1e-5, rtol=1e-5)


def test_deterministic_tail_steps_follow_diffusers_eta_zero(tiny_unet):
    steps, stochastic, guidance, eta = 6, 2, 4.0, 0.7
    cond, uncond = torch.randn(2, 2, 5, 16).unbind(0)
    noise = torch.randn(2, 4, 8, 8)
    traj = sample_with_logprob(
        tiny_unet, DDIMScheduler(**SD_SCHEDULER), cond, uncond, num_inference_steps=steps, guidance_scale=guidance,
        eta=eta, latents=noise, generator=torch.Generator().manual_seed(3), stochastic_steps=stochastic,
    )
    assert torch.isfinite(traj.log_probs[:, :stochastic]).all() and traj.log_probs[:, stochastic:].isnan().all()

    # diffusers: eta for the first steps (same generator), then eta = 0, which draws no noise.
    reference = DDIMScheduler(**SD_SCHEDULER)
    reference.set_timesteps(steps)
    x, gen = noise.clone(), torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i, t in enumerate(reference.timesteps):
            pred = guided_noise_prediction(tiny_unet, x, t, cond, uncond, guidance)
            x = reference.step(pred, t, x, eta=eta if i < stochastic else 0.0, generator=gen).prev_sample
            torch.testing.assert_close(traj.all_latents[:, i + 1], x, atol=1e-5, rtol=1e-5)


def test_a_coarse_deterministic_jump_is_diffusers_step_on_the_coarser_schedule():
    # 20-step schedule (stride 50) for the chain; a jump of 200 is one step of a 5-step schedule.
    coarse = DDIMScheduler(**SD_SCHEDULER)
    coarse.set_timesteps(5)
    sample, model_output = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    expected = coarse.step(model_output, 701, sample, eta=0.0).prev_sample
    torch.testing.assert_close(ddim_deterministic_jump(make_scheduler(20), model_output, 701, sample, 501), expected)
    last = coarse.step(model_output, 101, sample, eta=0.0).prev_sample  # 101 - 200 < 0: the final alpha
    torch.testing.assert_close(ddim_deterministic_jump(make_scheduler(20), model_output, 101, sample, -1), last)


def test_sampling_with_the_lora_merged_matches_the_adapter_and_restores_the_weights(tiny_unet):
    unet = copy.deepcopy(tiny_unet)
    add_lora(unet, rank=4, target_modules=("to_q", "to_k", "to_v", "to_out.0"))
    torch.manual_seed(3)
    for name, p in unet.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3)  # B starts at zero: give the adapter a real update to merge
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    cond, uncond = torch.randn(2, 2, 5, 16).unbind(0)
    noise = torch.randn(2, 4, 8, 8)

    def chain():
        return sample_with_logprob(
            unet, DDIMScheduler(**SD_SCHEDULER), cond, uncond, num_inference_steps=5, guidance_scale=3.0,
            eta=1.0, latents=noise, generator=torch.Generator().manual_seed(11),
        )

    with merged_adapter(unet):
        merged = chain()
        # Inside, the LoRA branch is off and the base weights carry the update.
        assert any(not torch.equal(v, before[k]) for k, v in unet.state_dict().items() if "base_layer.weight" in k)
    unmerged = chain()
    with torch.no_grad(), merged_adapter(unet):
        no_lora_effect = unet(noise, 500, encoder_hidden_states=cond).sample
    with torch.no_grad():
        plain = unet(noise, 500, encoder_hidden_states=cond).sample
        with merged_adapter(copy.deepcopy(tiny_unet)) as base_only:  # no adapter: a no-op
            base = base_only(noise, 500, encoder_hidden_states=cond).sample
    torch.testing.assert_close(merged.all_latents, unmerged.all_latents, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(merged.log_probs, unmerged.log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(no_lora_effect, plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(plain, base, atol=1e-3)  # the adapter does change the output
    after = unet.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # restored bit for bit
    assert all(p.requires_grad for n, p in unet.named_parameters() if "lora_" in n)

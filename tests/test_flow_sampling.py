"""Flow-GRPO's SDE step, log-probability, KL and windowed sampler (align/sampling/flow.py)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from align.sampling import flow as fs


def _scheduler(steps: int = 10, shift: float = 3.0) -> FlowMatchEulerDiscreteScheduler:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(steps)
    return scheduler


def _tensors(seed: int = 0, shape=(2, 4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_noise_level_zero_is_diffusers_euler_step():
    scheduler = _scheduler()
    sample, velocity = _tensors()
    sigma_max = float(scheduler.sigmas[1])
    for i, t in enumerate(scheduler.timesteps):
        scheduler._step_index = None  # look the step up from the timestep, as a fresh pipeline does
        expected = scheduler.step(velocity, t, sample, return_dict=False)[0]
        sigma, sigma_next = scheduler.sigmas[i], scheduler.sigmas[i + 1]
        step = fs.sde_step(sample, velocity, sigma, sigma_next, sigma_max, noise_level=0.0)
        torch.testing.assert_close(step.mean, expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(fs.ode_step(sample, velocity, sigma, sigma_next), expected, atol=1e-6, rtol=0)
        assert float(step.std.max()) == 0.0


@pytest.mark.parametrize("sigma,sigma_next", [(0.9, 0.8), (0.5, 0.3), (0.2, 0.0)])
def test_step_mean_and_std_match_hand_computed_values(sigma, sigma_next):
    a, sigma_max = 0.7, 0.95
    x, v = 0.3, -1.2
    dt = sigma_next - sigma
    s = a * math.sqrt(sigma / (1 - sigma))
    expected_mean = x * (1 + s * s / (2 * sigma) * dt) + v * (1 + s * s * (1 - sigma) / (2 * sigma)) * dt
    expected_std = s * math.sqrt(-dt)
    # The paper's form of the same step: x + [v + s²/(2σ)·(x + (1-σ)·v)]·Δσ (its SDE drift, Euler-Maruyama).
    assert x + (v + s * s / (2 * sigma) * (x + (1 - sigma) * v)) * dt == pytest.approx(expected_mean, abs=1e-12)
    step = fs.sde_step(torch.full((1, 1, 2, 2), x), torch.full((1, 1, 2, 2), v), sigma, sigma_next, sigma_max, a)
    assert step.mean.flatten().tolist() == pytest.approx([expected_mean] * 4, abs=1e-6)
    assert float(step.std) == pytest.approx(expected_std, rel=1e-6)
    assert float(step.sde_sigma) == pytest.approx(s, rel=1e-6)


def test_sigma_one_uses_sigma_max_in_the_denominator():
    # At σ = 1, σ/(1-σ) is infinite: the authors divide by 1 - sigmas[1] instead.
    scheduler = _scheduler()
    sigma_max = float(scheduler.sigmas[1])
    assert float(scheduler.sigmas[0]) == 1.0
    s = fs.sde_sigma(scheduler.sigmas[0], sigma_max, 0.7, torch.zeros(1, 1, 1, 1))
    assert float(s) == pytest.approx(0.7 * math.sqrt(1 / (1 - sigma_max)), rel=1e-6)
    sample, velocity = _tensors()
    step = fs.sde_step(sample, velocity, scheduler.sigmas[0], scheduler.sigmas[1], sigma_max, 0.7)
    assert torch.isfinite(step.mean).all() and torch.isfinite(step.std).all()


def test_per_sample_sigmas_broadcast():
    sample, velocity = _tensors()
    sigma, sigma_next = torch.tensor([0.9, 0.4]), torch.tensor([0.8, 0.2])
    batched = fs.sde_step(sample, velocity, sigma, sigma_next, 0.95, 0.7)
    for b in range(2):
        single = fs.sde_step(sample[b:b + 1], velocity[b:b + 1], float(sigma[b]), float(sigma_next[b]), 0.95, 0.7)
        torch.testing.assert_close(batched.mean[b:b + 1], single.mean)


def test_log_prob_is_the_gaussian_density_averaged_over_elements():
    mean, x = _tensors(1)
    std = torch.tensor([0.3, 1.7]).reshape(2, 1, 1, 1)
    log_prob = fs.gaussian_log_prob(x, mean, std)
    for b in range(2):
        normal = torch.distributions.Normal(mean[b].double(), float(std[b]))
        expected = normal.log_prob(x[b].double()).mean()
        assert float(log_prob[b]) == pytest.approx(float(expected), rel=1e-5)


def test_sampled_next_latent_is_mean_plus_std_times_the_drawn_noise():
    scheduler = _scheduler(steps=4)
    latents, velocity = _tensors(2)
    trajectory = fs.sample_flow_with_logprob(
        lambda x, t: velocity, latents, scheduler.sigmas, window=(0, 1), noise_level=0.7,
        generator=torch.Generator().manual_seed(5),
    )
    z = torch.randn(latents.shape, generator=torch.Generator().manual_seed(5))
    step = fs.sde_step(latents, velocity, scheduler.sigmas[0], scheduler.sigmas[1], float(scheduler.sigmas[1]), 0.7)
    torch.testing.assert_close(trajectory.next_latents[:, 0], step.mean + step.std * z)
    torch.testing.assert_close(trajectory.log_probs[:, 0], fs.gaussian_log_prob(step.mean + step.std * z, step.mean, step.std))


def test_kl_of_identical_gaussians_is_zero_and_matches_closed_form():
    mean_p, mean_q = _tensors(3)
    assert fs.gaussian_kl(mean_p, 0.4, mean_p, 0.4).abs().max() < 1e-7
    # Closed form for one element: log(σq/σp) + (σp² + (μp-μq)²)/(2σq²) - 1/2.
    got = fs.gaussian_kl(torch.full((1, 3), 1.0), 0.5, torch.full((1, 3), 0.2), 0.8)
    expected = math.log(0.8 / 0.5) + (0.25 + 0.64) / (2 * 0.64) - 0.5
    assert float(got) == pytest.approx(expected, rel=1e-6)
    # torch's own Normal-Normal KL, averaged over elements.
    reference = torch.distributions.kl_divergence(torch.distributions.Normal(mean_p, 0.4), torch.distributions.Normal(mean_q, 0.9))
    torch.testing.assert_close(fs.gaussian_kl(mean_p, 0.4, mean_q, 0.9), reference.mean(dim=(1, 2, 3)))


def test_authors_kl_is_the_exact_kl_times_the_step_size():
    sample, v_policy = _tensors(4)
    v_reference = v_policy + 0.1 * torch.randn_like(v_policy)
    sigma, sigma_next = 0.6, 0.45
    policy = fs.sde_step(sample, v_policy, sigma, sigma_next, 0.95, 0.7)
    reference = fs.sde_step(sample, v_reference, sigma, sigma_next, 0.95, 0.7)
    exact = fs.gaussian_kl(policy.mean, policy.std, reference.mean, reference.std)
    authors = fs.flow_grpo_kl(policy.mean, reference.mean, policy.sde_sigma)
    torch.testing.assert_close(authors, exact * (sigma - sigma_next), rtol=1e-5, atol=0)
    assert fs.flow_grpo_kl(policy.mean, policy.mean, policy.sde_sigma).abs().max() == 0


def _toy_velocity(x, t):
    # Depends on the latents and the timestep, so a wrong step or timestep changes the result.
    return torch.tanh(x) * (t.reshape(-1, 1, 1, 1) / 1000) - 0.3 * x


def test_window_chain_is_deterministic_outside_the_window():
    scheduler = _scheduler(steps=6)
    latents, _ = _tensors(6)
    sigmas = scheduler.sigmas

    def run(seed):
        return fs.sample_flow_with_logprob(
            _toy_velocity, latents, sigmas, window=(2, 4), noise_level=0.7, generator=torch.Generator().manual_seed(seed)
        )

    a, b = run(0), run(1)
    assert a.step_indices == [2, 3] and a.latents.shape == (2, 2, 4, 8, 8) and a.log_probs.shape == (2, 2)
    torch.testing.assert_close(a.timesteps, sigmas[2:4] * 1000)
    # Before the window: plain Euler steps, whatever the generator.
    x = latents
    for i in range(2):
        x = fs.ode_step(x, _toy_velocity(x, (sigmas[i] * 1000).expand(2)), sigmas[i], sigmas[i + 1])
    torch.testing.assert_close(a.latents[:, 0], x)
    torch.testing.assert_close(b.latents[:, 0], x)
    # Inside the window the generators differ; the window's steps chain.
    assert not torch.allclose(a.next_latents[:, 1], b.next_latents[:, 1])
    torch.testing.assert_close(a.latents[:, 1], a.next_latents[:, 0])
    # After the window: the Euler continuation of the window's last output.
    for run_ in (a, b):
        x = run_.next_latents[:, -1]
        for i in range(4, 6):
            x = fs.ode_step(x, _toy_velocity(x, (sigmas[i] * 1000).expand(2)), sigmas[i], sigmas[i + 1])
        torch.testing.assert_close(run_.final_latents, x)
    # Same generator seed: the same trajectory.
    torch.testing.assert_close(run(0).final_latents, a.final_latents)


def test_no_window_makes_every_step_stochastic():
    scheduler = _scheduler(steps=3)
    latents, _ = _tensors(7)
    out = fs.sample_flow_with_logprob(_toy_velocity, latents, scheduler.sigmas, None, 0.7, torch.Generator().manual_seed(0))
    assert out.step_indices == [0, 1, 2] and torch.isfinite(out.log_probs).all()


@pytest.mark.parametrize("window", [(3, 2), (-1, 2), (0, 7)])
def test_bad_window_is_refused(window):
    scheduler = _scheduler(steps=6)
    with pytest.raises(ValueError, match="window must be"):
        fs.sample_flow_with_logprob(_toy_velocity, torch.zeros(1, 4, 2, 2), scheduler.sigmas, window, 0.7)


def test_zero_noise_level_in_the_sampler_is_refused():
    scheduler = _scheduler(steps=2)
    with pytest.raises(ValueError, match="noise_level"):
        fs.sample_flow_with_logprob(_toy_velocity, torch.zeros(1, 4, 2, 2), scheduler.sigmas, None, 0.0)


def test_draw_window_covers_every_start_of_the_range_and_nothing_else():
    g = torch.Generator().manual_seed(0)
    windows = {fs.draw_window(2, (1, 6), g) for _ in range(300)}
    assert windows == {(s, s + 2) for s in range(1, 5)}
    with pytest.raises(ValueError, match="does not fit"):
        fs.draw_window(3, (0, 2))

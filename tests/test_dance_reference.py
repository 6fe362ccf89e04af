"""Dance-SDE (align/sampling/flow.py ``dance_step``, --sampler dance) against DanceGRPO's own ``flux_step``:
tests/data/dance_reference.json holds what their function gave on seeded float32 tensors
(experiments/dance_reference.py ran it, read from their train_grpo_flux.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from align.sampling.dance_sampler import DanceSampler
from align.sampling.flow import dance_step, flow_x0_of, gaussian_log_prob, sde_step

REFERENCE = json.loads((Path(__file__).parent / "data" / "dance_reference.json").read_text())
ROWS = [(case, row) for case in REFERENCE["cases"] for row in case["rows"]]


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("case, row", ROWS, ids=[f"{c['name']}-step{r['index']}" for c, r in ROWS])
def test_step_and_log_prob_equal_the_authors(case, row):
    sigmas, i, eta = _t(case["sigmas"]), row["index"], case["eta"]
    latents, velocity = _t(row["latents"]), _t(row["velocity"])
    step = dance_step(latents, velocity, sigmas[i], sigmas[i + 1], eta)
    assert torch.equal(step.mean, _t(row["mean"]))  # bit for bit
    assert torch.equal(flow_x0_of(latents, velocity, sigmas[i]), _t(row["pred_original"]))
    assert float(step.std) == pytest.approx(row["std_dev_t"], rel=1e-7)
    prev = _t(row["prev_sample"])
    torch.testing.assert_close(gaussian_log_prob(prev, step.mean, step.std), _t(row["log_prob"]), rtol=0, atol=1e-6)
    rescored = dance_step(latents, _t(row["velocity_2"]), sigmas[i], sigmas[i + 1], eta)
    torch.testing.assert_close(gaussian_log_prob(prev, rescored.mean, rescored.std), _t(row["log_prob_2"]),
                               rtol=0, atol=1e-6)


def test_dance_is_flow_grpos_sde_with_a_constant_coefficient():
    """σ_t = η instead of η·√(σ/(1-σ)): the same mean and std up to float32 rounding (sde_step with s = η)."""
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.2]), torch.tensor([0.8, 0.4, 0.0])
    dance = dance_step(x, v, sigma, sigma_next, 0.5)
    sde = sde_step(x, v, sigma, sigma_next, 0.9, 1.0)  # noise level 1 at σ ... then rescaled below
    s = 0.5
    expected_mean = x * (1 + s**2 / (2 * sigma.view(-1, 1, 1, 1)) * (sigma_next - sigma).view(-1, 1, 1, 1)) \
        + v * (1 + s**2 * (1 - sigma.view(-1, 1, 1, 1)) / (2 * sigma.view(-1, 1, 1, 1))) * (sigma_next - sigma).view(-1, 1, 1, 1)
    torch.testing.assert_close(dance.mean, expected_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dance.std.flatten(), s * (sigma - sigma_next).sqrt(), rtol=1e-7, atol=0)
    assert not torch.allclose(dance.mean, sde.mean)  # Flow-GRPO's coefficient grows with σ: another step


def test_the_sampler_scores_its_own_steps_as_it_drew_them_and_returns_the_last_x0():
    """The recorded log-probabilities equal a re-scoring under the same prediction (PPO's first ratio is 1), the
    chain's image is x̂0 of its last step bit for bit (the authors' ``latents = pred_original``; the last step is not
    recorded), and the window samples as --sampler sde's."""
    sigmas = _t(REFERENCE["cases"][0]["sigmas"])
    weight = torch.randn(2, 2, generator=torch.Generator().manual_seed(3))

    def predict(x, t):  # a deterministic stand-in velocity that depends on the step
        return torch.einsum("oc,bchw->bohw", weight, x) * (t / 1000).view(-1, 1, 1, 1)

    sampler = DanceSampler(sigmas, 0.3)
    sampler.records_means = True
    noise = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    steps = sampler.run(predict, noise, torch.Generator().manual_seed(2))
    assert steps["latents"].shape[1] == 15 and steps["means"].shape == steps["latents"].shape  # the last is the ODE's
    k = 5
    x, t, idx = steps["latents"][:, k], steps["timesteps"][:, k], steps["step_indices"][:, k]
    gaussian = sampler.step(predict(x, t), x, t, idx)
    torch.testing.assert_close(gaussian.log_prob(steps["next_latents"][:, k]), steps["log_probs"][:, k], rtol=0, atol=0)
    assert torch.equal(gaussian.mean, steps["means"][:, k])
    torch.testing.assert_close(gaussian.dt.flatten(), (sigmas[idx] - sigmas[idx + 1]))
    last = steps["next_latents"][:, -1]  # the input of the last step, σ = sigmas[-2]
    expected = flow_x0_of(last, predict(last, (sigmas[-2] * 1000).expand(4)), sigmas[-2])
    assert torch.equal(steps["final_latents"], expected)  # the authors' image: x̂0 of the last step
    windowed = DanceSampler(sigmas, 0.3, window=3).run(predict, noise, torch.Generator().manual_seed(2))
    assert windowed["step_indices"][0].tolist() == [0, 1, 2] and windowed["latents"].shape[1] == 3
    assert "Dance-SDE on a window of 3 of 16 steps" in DanceSampler(sigmas, 0.3, window=3).describe()

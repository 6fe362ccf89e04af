"""MixGRPO's sliding window and steps (align/sampling/mix_sampler.py, --sampler mix) against the authors' code:
tests/data/mixgrpo_reference.json holds the windows their GRPOTrainingStates gave iteration by iteration and what their
flow_grpo_step / dance_grpo_step gave on seeded float32 tensors (experiments/mixgrpo_reference.py ran them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from align.sampling.flow import dance_step, gaussian_log_prob, ode_step, sde_step
from align.sampling.mix_sampler import MixSampler, mix_window

REFERENCE = json.loads((Path(__file__).parent / "data" / "mixgrpo_reference.json").read_text())
SIGMAS = torch.tensor(REFERENCE["sigmas"], dtype=torch.float32)


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("name", sorted(REFERENCE["schedules"]))
def test_the_window_moves_as_the_authors_training_states(name):
    """Epoch by epoch the window is theirs; where theirs is empty (its start at N - 2, before their roll-back) ours
    has already rolled back: their sequence without the empty windows is ours."""
    case = REFERENCE["schedules"][name]
    theirs = case["windows"]
    ours = [list(range(*mix_window(e, case["size"], case["steps"], case["per_position"], case["stride"])))
            for e in range(len(theirs))]
    first_empty = next((i for i, w in enumerate(theirs) if not w), len(theirs))
    assert ours[:first_empty] == theirs[:first_empty]
    non_empty = [w for w in theirs if w]
    assert ours[: len(non_empty)] == non_empty
    assert all(ours)


@pytest.mark.parametrize("row", REFERENCE["steps"], ids=lambda r: f"step{r['index']}")
def test_steps_equal_the_authors(row):
    i, eta = row["index"], REFERENCE["eta"]
    latents, velocity, velocity_2 = _t(row["latents"]), _t(row["velocity"]), _t(row["velocity_2"])
    theirs = row["flow_grpo"]
    step = sde_step(latents, velocity, SIGMAS[i], SIGMAS[i + 1], float(SIGMAS[1]), eta)
    assert torch.equal(step.mean, _t(theirs["mean"]))
    torch.testing.assert_close(step.std.flatten(), _t(theirs["std"]).flatten(), rtol=0, atol=0)
    prev = _t(theirs["prev_sample"])
    torch.testing.assert_close(gaussian_log_prob(prev, step.mean, step.std), _t(theirs["log_prob"]), rtol=0, atol=1e-6)
    rescored = sde_step(latents, velocity_2, SIGMAS[i], SIGMAS[i + 1], float(SIGMAS[1]), eta)
    assert torch.equal(rescored.mean, _t(theirs["mean_2"]))
    torch.testing.assert_close(gaussian_log_prob(prev, rescored.mean, rescored.std), _t(theirs["log_prob_2"]),
                               rtol=0, atol=1e-6)
    ode = ode_step(latents, velocity, SIGMAS[i], SIGMAS[i + 1])
    assert torch.equal(ode, _t(theirs["ode"])) and torch.equal(ode, _t(row["dance"]["ode"]))
    # their dance_grpo_step drops the log-density's constants (a line of it is a statement of its own): the same
    # log-probability less -log(std) - log(√(2π)), which no ratio sees
    dance, theirs = dance_step(latents, velocity, SIGMAS[i], SIGMAS[i + 1], eta), row["dance"]
    prev = _t(theirs["prev_sample"])
    constant = -torch.log(dance.std).flatten() - math.log(math.sqrt(2 * math.pi))
    torch.testing.assert_close(gaussian_log_prob(prev, dance.mean, dance.std) - constant, _t(theirs["log_prob"]),
                               rtol=0, atol=1e-6)
    rescored = dance_step(latents, velocity_2, SIGMAS[i], SIGMAS[i + 1], eta)
    torch.testing.assert_close(gaussian_log_prob(prev, rescored.mean, rescored.std) - constant,
                               _t(theirs["log_prob_2"]), rtol=0, atol=1e-6)


def test_the_sampler_records_the_epochs_window_and_takes_the_ode_elsewhere():
    weight = torch.randn(2, 2, generator=torch.Generator().manual_seed(3))

    def predict(x, t):
        return torch.einsum("oc,bchw->bohw", weight, x) * (t / 1000).view(-1, 1, 1, 1)

    noise = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    sampler = MixSampler(SIGMAS, 0.7, window=4, epochs_per_position=25, stride=1)
    sampler.records_means = True
    for epoch, start in ((0, 0), (24, 0), (25, 1), (13 * 25, 13)):
        sampler.set_epoch(epoch)
        steps = sampler.run(predict, noise, torch.Generator().manual_seed(2))
        assert steps["step_indices"][0].tolist() == list(range(start, start + 4))
        k = 2
        x, t, idx = steps["latents"][:, k], steps["timesteps"][:, k], steps["step_indices"][:, k]
        gaussian = sampler.step(predict(x, t), x, t, idx)
        assert torch.equal(gaussian.log_prob(steps["next_latents"][:, k]), steps["log_probs"][:, k])
        assert torch.equal(gaussian.mean, steps["means"][:, k])
    x = noise.float()  # outside the window: the Euler chain, so epoch 0's run from step 4 on is the ODE's
    sampler.set_epoch(0)
    steps = sampler.run(predict, noise, torch.Generator().manual_seed(2))
    x = steps["next_latents"][:, -1]
    for i in range(4, 25):
        x = ode_step(x, predict(x, (SIGMAS[i] * 1000).expand(2)), SIGMAS[i], SIGMAS[i + 1])
    assert torch.equal(x, steps["final_latents"])
    dance = MixSampler(SIGMAS, 0.3, window=2, epochs_per_position=1, stride=1, dynamics="dance")
    assert "Dance-SDE on a window of 2 of 25 steps" in dance.describe()

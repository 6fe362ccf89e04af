"""align/train/objectives/nft.py against the authors' own lines (tests/data/nft_reference.json, written by
experiments/nft_reference.py from NVlabs/DiffusionNFT @ 24af555), plus the x0-space identities it rests on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from align.sampling import forward
from align.sampling.flow import dpm2_flow_step
from align.sampling.flow_ode_sampler import ODESampler
from align.train.objectives import nft
from align.train.old_policy import OldPolicy
from align.train.rollout import TrainBatch

REFERENCE = json.loads((Path(__file__).parent / "data" / "nft_reference.json").read_text())
RTOL = 1e-5


def _t(values, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    """Within rtol of the reference, elementwise, with entries near zero judged against the tensor's scale."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("case", REFERENCE["loss_cases"], ids=lambda c: c["name"])
def test_loss_and_gradient_match_the_authors(case):
    t = _t(case["t"])
    xt, x0 = _t(case["xt"]), _t(case["x0"])
    velocity = _t(case["forward_prediction"]).requires_grad_(True)
    old, ref = _t(case["old_prediction"]), _t(case["ref_prediction"])
    r = nft.nft_reward_weight(_t(case["advantages"]), case["adv_clip_max"])
    loss, metrics = nft.nft_loss(forward.flow_x0(xt, velocity, t), forward.flow_x0(xt, old, t), x0, r, case["beta"],
                                 case["adv_clip_max"])
    total = loss + case["train_beta"] * nft.prediction_kl(velocity, ref).mean()
    total.backward()

    assert_relative(r, _t(case["r"]))
    assert total.dtype == torch.float64  # the float64 weights promote the loss, as the authors'
    assert total.item() == pytest.approx(case["loss"], rel=RTOL)
    assert_relative(velocity.grad, _t(case["grad_forward_prediction"]))
    terms = case["loss_terms"]
    # their logged policy_loss is the total: ``loss = policy_loss; loss += kl`` adds in place to the tensor whose
    # detached view they logged; ours is the policy part alone
    assert terms["policy_loss"] == case["loss"]
    kl = case["train_beta"] * nft.prediction_kl(velocity, ref).mean().item()
    assert metrics["policy_loss"].item() + kl == pytest.approx(terms["policy_loss"], rel=RTOL)
    assert metrics["policy_loss"].item() == pytest.approx(loss.item(), rel=1e-12)
    assert metrics["unweighted_policy_loss"].item() == pytest.approx(terms["unweighted_policy_loss"], rel=RTOL)
    assert metrics["x0_norm"].item() == pytest.approx(terms["x0_norm"], rel=RTOL)
    assert metrics["x0_norm_max"].item() == pytest.approx(terms["x0_norm_max"], rel=RTOL)
    # their old_deviate is in velocity space; ours is in x0 space, t^2 times it per sample
    assert nft.prediction_kl(velocity, old).mean().item() == pytest.approx(terms["old_deviate"], rel=RTOL)
    per_sample_x0 = ((velocity.detach() - old) ** 2).mean(dim=(1, 2, 3)) * t**2
    assert metrics["old_deviate_x0"].item() == pytest.approx(per_sample_x0.mean().item(), rel=1e-10)


def test_tiny_error_case_hits_the_weight_floor():
    """The reference's tiny-error sample really sits under the 1e-5 clip (so the clip branch is pinned)."""
    case = next(c for c in REFERENCE["loss_cases"] if c["tiny_first"])
    t, xt, x0 = _t(case["t"]), _t(case["xt"]), _t(case["x0"])
    error = (forward.flow_x0(xt, _t(case["forward_prediction"]), t) - x0).abs().mean(dim=(1, 2, 3))
    assert error[0] < nft.WEIGHT_FLOOR < error[1:].min()


@pytest.mark.parametrize("case", REFERENCE["adv_mode_cases"], ids=lambda c: c["adv_mode"])
def test_reward_weight_matches_the_authors(case):
    r = nft.nft_reward_weight(_t(case["advantages"]), case["adv_clip_max"], case["adv_mode"])
    torch.testing.assert_close(r, _t(case["r"]), rtol=1e-12, atol=1e-12)


def test_reward_weight_rejects_bad_arguments():
    with pytest.raises(ValueError):
        nft.nft_reward_weight(torch.zeros(2), 0.0)
    with pytest.raises(ValueError):
        nft.nft_reward_weight(torch.zeros(2), 5.0, "sometimes")


@pytest.mark.parametrize("parameterisation", ["flow", "eps", "v"])
@pytest.mark.parametrize("beta", [1.0, 0.1, 0.37])
def test_mixing_outputs_is_mixing_x0(parameterisation, beta):
    """x0 is affine in the model output, so x0(beta*o + (1-beta)*o_old) = beta*x0(o) + (1-beta)*x0(o_old), and
    x0((1+beta)*o_old - beta*o) = (1+beta)*x0(o_old) - beta*x0(o): the authors' velocity mix in x0 space."""
    g = torch.Generator().manual_seed(5)
    shape = (3, 4, 5, 5)
    x_t, out, out_old = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    level = torch.rand(3, generator=g, dtype=torch.float64) * 0.98 + 0.01  # sigma or alpha_cumprod per sample
    to_x0 = {"flow": forward.flow_x0, "eps": forward.eps_x0, "v": forward.v_prediction_x0}[parameterisation]
    positive = to_x0(x_t, beta * out + (1 - beta) * out_old, level)
    negative = to_x0(x_t, (1 + beta) * out_old - beta * out, level)
    x0_new, x0_old = to_x0(x_t, out, level), to_x0(x_t, out_old, level)
    torch.testing.assert_close(positive, beta * x0_new + (1 - beta) * x0_old, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(negative, (1 + beta) * x0_old - beta * x0_new, rtol=1e-12, atol=1e-12)


def test_noising_and_x0_maps_invert_each_other():
    g = torch.Generator().manual_seed(6)
    x0, noise = (torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(2))
    sigma = _t([0.9, 0.2])
    torch.testing.assert_close(forward.flow_x0(forward.flow_noised(x0, noise, sigma), noise - x0, sigma), x0)
    a = _t([0.05, 0.8])
    x_t = forward.ddpm_noised(x0, noise, a)
    torch.testing.assert_close(forward.eps_x0(x_t, noise, a), x0)
    v = a.sqrt().view(-1, 1, 1, 1) * noise - (1 - a).sqrt().view(-1, 1, 1, 1) * x0
    torch.testing.assert_close(forward.v_prediction_x0(x_t, v, a), x0)
    assert forward.flow_sigma(torch.tensor([1000.0, 8.928571701049805])).tolist() == pytest.approx([1.0, 0.0089285717])


def test_old_model_gets_no_gradient():
    g = torch.Generator().manual_seed(8)
    x0_policy, x0_old, x0 = (torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    loss, _ = nft.nft_loss(x0_policy, x0_old, x0.detach(), _t([0.2, 0.9]), 0.5, 5.0)
    loss.backward()
    assert x0_policy.grad is not None and x0_old.grad is None


def test_decay_schedule_matches_the_authors():
    steps = REFERENCE["return_decay"]["steps"]
    for decay_type, expected in REFERENCE["return_decay"]["decay"].items():
        name = nft.AUTHORS_DECAY_TYPES[int(decay_type)]
        assert [nft.old_policy_decay(s, int(decay_type)) for s in steps] == expected
        assert [nft.old_policy_decay(s, name) for s in steps] == expected
    with pytest.raises(ValueError):
        nft.old_policy_decay(3, 7)


def test_old_policy_update_matches_the_authors():
    update = REFERENCE["return_decay"]["old_policy_update"]
    decay = nft.old_policy_decay(update["global_step"], update["decay_type"])
    assert decay == update["decay"]
    params = [torch.nn.Parameter(_t(p)) for p in update["current"]]
    old = OldPolicy(params)  # the trainer's old policy, holding the authors' old weights
    old.load_state_dict({str(i): _t(p) for i, p in enumerate(update["old_before"])})
    old.update(decay)
    for ours, theirs in zip(old.tensors, update["old_after"]):
        assert_relative(ours, _t(theirs))




@pytest.mark.parametrize("case", REFERENCE["dpm2_solver"], ids=lambda c: c["name"])
def test_dpm2_sampler_matches_the_authors(case):
    a, b, z = (_t(case[k], torch.float32) for k in ("A", "B", "z"))

    def velocity(x, sigma):
        return torch.tanh(a * x) + float(sigma) * b

    sigmas = _t(case["sigmas"], torch.float32)
    sampler = ODESampler(len(sigmas) - 1, sigmas=sigmas, solver="dpm2")  # the trainer's --sampler dpm2
    steps = sampler.run(lambda x, t: velocity(x, t[0] / 1000), z, None)
    assert_relative(steps["final_latents"], _t(case["final"], torch.float32))
    # every intermediate step too
    grid = sigmas.tolist()
    x, previous = z, None
    for index, expected in enumerate(case["all_latents"][1:]):
        x0_pred = x - grid[index] * velocity(x, grid[index])
        x = dpm2_flow_step(x, x0_pred, previous, grid, index)
        previous = x0_pred
        assert_relative(x, _t(expected, torch.float32))


class RecordedPredictions:
    """The trainer's ``models`` for one recorded step: the authors' current, old and reference velocities at x_t."""

    def __init__(self, case, velocity):
        self.outputs = {"policy": velocity, "old": _t(case["old_prediction"]), "reference": _t(case["ref_prediction"])}

    def predict(self, latents, timesteps, cond, uncond, which="policy"):
        return self.outputs[which]


@pytest.mark.parametrize("case", [c for c in REFERENCE["loss_cases"] if not c["tiny_first"]], ids=lambda c: c["name"])
def test_the_trainers_objective_matches_the_authors_step(case):
    # DiffusionNFT's objective as the trainer runs it: the sampler's forward process of the final latents with the
    # step's noise (recovered from the authors' x_t), its x0 map, nft_loss and the KL. (The case whose x0 error sits
    # below the 1e-5 floor is left to the float64 test above: the trainer forms x_t in float32, whose rounding is
    # that size.)
    t, xt, x0 = _t(case["t"]), _t(case["xt"]), _t(case["x0"])
    noise = (xt - (1 - t.view(-1, 1, 1, 1)) * x0) / t.view(-1, 1, 1, 1)
    sigmas = torch.cat([t.sort(descending=True).values, torch.zeros(1)])
    sampler = ODESampler(len(t), sigmas=sigmas.float())
    objective = nft.DiffusionNFT(sampler, case["beta"], case["adv_clip_max"], case["train_beta"], "linear-0.5")
    velocity = _t(case["forward_prediction"]).requires_grad_(True)
    batch = TrainBatch(latents=xt, next_latents=xt, timesteps=t * 1000, step_indices=torch.zeros(len(t), dtype=torch.long),
                       old_log_probs=torch.zeros(len(t)), advantages=_t(case["advantages"]), final_latents=x0,
                       noise=noise, cond={}, uncond={}, num_samples=len(t))
    torch.testing.assert_close(sampler.forward.noisy(x0, noise, batch.timesteps), xt.float(), rtol=1e-5, atol=1e-5)
    loss, _ = objective.loss(RecordedPredictions(case, velocity), batch)
    loss.backward()
    assert loss.item() == pytest.approx(case["loss"], rel=RTOL)
    assert_relative(velocity.grad, _t(case["grad_forward_prediction"]))

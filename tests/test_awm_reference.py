"""AWM's pure maths (align/train/objectives/awm.py) against the authors' train_sd3_awm.py: tests/data/awm_reference.json holds
what their compute_log_prob_awm, training step, time sampling and "ema" adapter update gave on seeded float64
inputs (experiments/awm_reference.py ran them, exec'd from the authors' file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from align.sampling.flow_ode_sampler import ODESampler
from align.sampling.forward import flow_noised
from align.train.objectives.awm import (
    AdvantageWeightedMatching,
    awm_kl,
    awm_log_prob,
    awm_policy_loss,
    awm_std_dev_t,
    awm_timestep_indices,
    ema_kl_decay,
)
from align.train.old_policy import OldPolicy
from align.train.online_update import train_timestep_indices
from align.train.rollout import TrainBatch

REFERENCE = json.loads((Path(__file__).parent / "data" / "awm_reference.json").read_text())
# the authors' option names -> ours
WEIGHTING = {"Uniform": "uniform", "t": "t", "t**2": "t2", "huber": "huber", "ghuber": "ghuber"}
RATIO = {"exp_first": "per-timestep", "sum_first": "per-sample"}
KL = {"Uniform": "uniform", "ELBO": "elbo"}
TIME_TYPE = {"discrete": "discrete", "discrete_with_init": "discrete-with-init",
             "discrete_wo_init": "discrete-without-init"}


def _tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _close(got, want) -> None:
    """Within 1e-5 of the reference, relative to its largest magnitude."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-300)


LOG_PROB = REFERENCE["log_prob"][0]


@pytest.mark.parametrize("case", LOG_PROB["cases"], ids=lambda c: f"{c['weighting']}-{c['ghuber_power']}")
def test_log_prob_and_its_gradient_match_the_authors(case):
    t = _tensor(LOG_PROB["t"])
    clean, noise = _tensor(LOG_PROB["clean"]), _tensor(LOG_PROB["noise"])
    output = _tensor(LOG_PROB["model_output"]).requires_grad_(True)
    log_prob = awm_log_prob(output, noise - clean, t, WEIGHTING[case["weighting"]], ghuber_power=case["ghuber_power"])
    log_prob.sum().backward()
    assert log_prob.dtype == torch.float64 and log_prob.shape == (len(t),)
    _close(log_prob, case["log_prob"])
    _close(output.grad, case["grad"])
    _close(awm_std_dev_t(t), case["std_dev_t"])
    # the transformer is called with t·1000 (the scheduler's scale); t itself weights the loss
    _close(case["transformer_timestep"], 1000 * t)


@pytest.mark.parametrize("case", REFERENCE["steps"], ids=lambda c: c["name"])
def test_training_step_loss_and_gradient_match_the_authors(case):
    t = _tensor(case["t"])
    batch = len(case["advantages"])
    steps = len(t) // batch
    clean, noise = _tensor(case["clean"]), _tensor(case["noise"])
    output = _tensor(case["model_output"]).requires_grad_(True)
    log_prob = awm_log_prob(output, noise - clean, t, WEIGHTING[case["weighting"]],
                            ghuber_power=case.get("ghuber_power", 0.25)).reshape(steps, batch)
    _close(log_prob.detach().reshape(-1), case["log_prob"])
    old = log_prob.detach() if case["on_policy"] else _tensor(case["old_log_probs"])
    loss, metrics = awm_policy_loss(log_prob, old, _tensor(case["advantages"]), case["clip_range"],
                                    adv_clip_max=case["adv_clip_max"], advantage_max=case["advantage_max"],
                                    ratio=RATIO[case["loss_type"]])
    _close(loss.detach(), case["policy_loss"])
    _close(metrics["clipfrac"], case["clipfrac"])
    _close(metrics["ratio_mean"], torch.tensor(case["ratio"]).mean())
    if case["beta"] > 0:  # the authors compute the EMA term only inside the reference KL's branch
        kl = awm_kl(output, _tensor(case["ref_output"]), t, KL[case["kl_weight"]])
        _close(kl.detach(), case["kl_loss"])
        loss = loss + case["beta"] * kl
        if case["ema_beta"] > 0:
            ema_kl = awm_kl(output, _tensor(case["ema_output"]), t, KL[case["kl_ema_weight"]])
            _close(ema_kl.detach(), case["ema_kl_loss"])
            loss = loss + case["ema_beta"] * ema_kl
    _close(loss.detach(), case["loss"])
    loss.backward()
    _close(output.grad, case["grad"])


def test_the_reference_covers_clipping_both_ways():
    steps = REFERENCE["steps"]
    assert {c["loss_type"] for c in steps} == set(RATIO) and {c["kl_weight"] for c in steps} == set(KL)
    assert any(0 < c["clipfrac"] < 1 for c in steps) and any(c["clipfrac"] == 1 for c in steps)
    assert min(REFERENCE["steps"][0]["advantages"]) < -5 < 5 < max(REFERENCE["steps"][0]["advantages"])
    assert all(torch.count_nonzero(_tensor(c["grad"])) > 0 for c in steps)


@pytest.mark.parametrize("case", REFERENCE["times"],
                         ids=lambda c: f"{c['time_type']}-{c['num_steps']}-{c['train_timesteps']}-{c['seed']}")
def test_timestep_indices_and_values_match_the_authors_draw(case):
    generator = torch.Generator().manual_seed(case["seed"])
    indices = awm_timestep_indices(case["num_steps"], case["train_timesteps"], generator,
                                   timestep_fraction=case["timestep_fraction"], time_type=TIME_TYPE[case["time_type"]])
    assert indices.tolist() == case["t_indices"]
    t = (torch.tensor(case["grid"])[indices] / 1000).repeat_interleave(case["batch_size"])  # timestep-major rows
    assert t.tolist() == case["timesteps"]
    if case["time_type"] == "discrete" and case["timestep_fraction"] == 0.9:  # the trainer's --timestep_selection stratified
        ours = train_timestep_indices(1, case["num_steps"], case["train_timesteps"], "stratified",
                                      torch.Generator().manual_seed(case["seed"]))
        assert ours[0].tolist() == case["t_indices"]


@pytest.mark.parametrize("case", REFERENCE["ema"], ids=lambda c: f"{c['schedule']}-{c['global_step']}")
def test_ema_adapter_update_matches_the_authors(case):
    decay = ema_kl_decay(case["global_step"], case["kl_ema_decay"], case["schedule"])
    assert decay == pytest.approx(case["decay"], rel=1e-12, abs=1e-15)
    params = [torch.nn.Parameter(_tensor(current)) for current in case["current"]]
    ema = OldPolicy(params)  # the trainer's EMA ("ema" adapter) policy
    ema.load_state_dict({str(i): _tensor(value) for i, value in enumerate(case["ema"])})
    ema.update(decay)
    for ours, updated in zip(ema.tensors, case["updated"]):
        _close(ours, updated)


def test_on_policy_gradient_is_the_advantage_weighted_log_prob_gradient():
    """ratio ≡ 1: d loss = -mean over T·B of A_b·d log_prob (the recipe's case)."""
    log_prob = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    advantages = _tensor([0.5, -2.0, 9.0, -9.0])
    loss, metrics = awm_policy_loss(log_prob, log_prob.detach(), advantages, 1.0, adv_clip_max=5, advantage_max=1)
    loss.backward()
    assert float(metrics["clipfrac"]) == 0.0 and float(metrics["ratio_mean"]) == 1.0
    _close(log_prob.grad, (-advantages.clamp(-5, 5) / 5 / 12).expand(3, 4))


def test_weightings_relate_as_their_formulas():
    g = torch.Generator().manual_seed(1)
    prediction, target = torch.randn(5, 2, 3, generator=g), torch.randn(5, 2, 3, generator=g)
    t = torch.rand(5, generator=g)
    uniform = awm_log_prob(prediction, target, t, "uniform")
    _close(awm_log_prob(prediction, target, t, "t"), uniform * t.double())
    _close(awm_log_prob(prediction, target, t, "t2"), uniform * t.double() ** 2)
    _close(awm_log_prob(prediction, target, t, "huber"), awm_log_prob(prediction, target, t, "ghuber", 0.5) / 2)
    _close(awm_log_prob(prediction, target, t, "ghuber", 1.0), uniform * t.double())
    with pytest.raises(ValueError, match="weighting"):
        awm_log_prob(prediction, target, t, "Uniform")


def test_forward_process_and_schedules():
    clean, noise = torch.ones(2, 3), torch.zeros(2, 3)
    assert flow_noised(clean, noise, torch.tensor([0.25, 1.0])).tolist() == [[0.75] * 3, [0.0] * 3]
    assert ema_kl_decay(120, 0.3, "linear") == pytest.approx(0.12) and ema_kl_decay(10**6, 0.3, "linear") == 0.3
    assert ema_kl_decay(7, 0.3, "constant") == 0.3
    # the recipe: 6 timesteps of 14, below index 12; GenEval/OCR never train the grid's first (t = 1) step
    for seed in range(20):
        indices = awm_timestep_indices(14, 6, torch.Generator().manual_seed(seed), 0.9, "discrete-without-init")
        assert indices[0] == 1 and indices.max() < 12 and bool((indices.diff() > 0).all())
        first = awm_timestep_indices(14, 6, torch.Generator().manual_seed(seed), 0.9, "discrete-with-init")
        assert first[0] == 0 and len(first) == 6


class RecordedOutputs:
    """The trainer's ``models`` for the recorded step: the authors' policy, base and EMA velocities, reordered from
    their timestep-major rows (k·B + b) to the trainer's sample-major ones (b·T + k)."""

    def __init__(self, case, output, steps, batch):
        def ours(values):
            return values.reshape(steps, batch, *values.shape[1:]).transpose(0, 1).reshape(values.shape)

        self.ours = ours
        self.outputs = {"policy": ours(output), "reference": ours(_tensor(case["ref_output"])),
                        "old": ours(_tensor(case["ema_output"]))}

    def predict(self, latents, timesteps, cond, uncond, which="policy"):
        return self.outputs[which]


@pytest.mark.parametrize("case", [c for c in REFERENCE["steps"] if c["on_policy"]], ids=lambda c: c["name"])
def test_the_trainers_objective_matches_the_authors_on_policy_step(case):
    # AWM's objective as the trainer runs it (its recipes' on-policy step): forward process and target from the
    # sampler, the log-probability, the policy loss at ratio 1, the KL to the base and to the EMA policy.
    t = _tensor(case["t"])
    batch = len(case["advantages"])
    steps = len(t) // batch
    output = _tensor(case["model_output"]).requires_grad_(True)
    models = RecordedOutputs(case, output, steps, batch)
    clean, noise = models.ours(_tensor(case["clean"])), models.ours(_tensor(case["noise"]))
    timesteps = models.ours(t) * 1000
    sampler = ODESampler(steps, sigmas=torch.linspace(1, 0, steps + 1))
    objective = AdvantageWeightedMatching(sampler, WEIGHTING[case["weighting"]], case.get("ghuber_power", 0.25),
                                          case["clip_range"], case["adv_clip_max"], case["beta"], case["ema_beta"])
    rows = TrainBatch(latents=clean, next_latents=clean, timesteps=timesteps, step_indices=torch.zeros(len(t), dtype=torch.long),
                      old_log_probs=torch.zeros(len(t)), advantages=_tensor(case["advantages"]).repeat_interleave(steps),
                      final_latents=clean, noise=noise, cond={}, uncond={}, num_samples=batch)
    loss, metrics = objective.loss(models, rows)
    _close(loss.detach(), case["loss"])
    _close(metrics["kl_to_reference"], case["kl_loss"])
    _close(metrics["kl_to_old"], case["ema_kl_loss"])
    loss.backward()
    _close(output.grad, case["grad"])

"""DGPO (align/train/objectives/dgpo.py) against the authors' train_sd3_dgpo.py: tests/data/dgpo_reference.json holds
what their compute_group_dgpo_loss_allreduce and training step gave, with d loss / d model_v, on seeded float32 inputs
(experiments/dgpo_reference.py ran them). Also the trainer's plan in whole groups that DGPO's loss needs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from align.sampling.forward import FlowForward
from align.train.objectives.dgpo import (
    DGPO,
    denoising_loss,
    dgpo_clip,
    dgpo_loss,
    group_ids_of,
    old_policy_decay,
)
from align.train.online_update import plan_epoch
from align.train.rollout import TrainBatch

REFERENCE = json.loads((Path(__file__).parent / "data" / "dgpo_reference.json").read_text())


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _close(got, want) -> None:
    """Within 1e-5 of the reference, relative to its largest magnitude."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()) + 1e-30)


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["name"])
def test_loss_and_gradient_equal_the_authors(case):
    target = _t(case["noise"]) - _t(case["x0"])
    model_v = _t(case["model_v"]).requires_grad_(True)
    advantages = _t(case["advantages"]).clamp(-5, 5)
    dsm = denoising_loss(model_v, target)
    old_dsm = denoising_loss(_t(case["old_v"]), target)
    if case["clip_dsm"]:
        dsm, clipped = dgpo_clip(dsm, old_dsm, advantages, case["clip_range"])
        assert clipped.tolist() == case["clipped"]
    reference_dsm = old_dsm if case["use_ema_ref"] else denoising_loss(_t(case["ref_v"]), target)
    loss, _ = dgpo_loss(dsm, reference_dsm, advantages, torch.tensor(case["groups"]), case["beta_dpo"],
                        case["group_size"])
    _close(loss.detach(), case["dgpo_loss"])
    if case["beta"] > 0:
        kl = denoising_loss(model_v, _t(case["ref_v"])).mean()
        _close(kl.detach(), case["kl_loss"])
        loss = loss + case["beta"] * kl
    _close(loss.detach(), case["loss"])
    loss.backward()
    _close(model_v.grad, case["grad_model_v"])


class Prepared:
    """The policy models as the objective sees them, returning the reference's prepared velocities."""

    def __init__(self, case):
        self.policy = _t(case["model_v"]).requires_grad_(True)
        self.outputs = {"old": _t(case["old_v"]), "reference": _t(case["ref_v"])}
        self.calls = []

    def predict(self, latents, timesteps, cond, uncond, which="policy", guidance_scale=None):
        self.calls.append((which, guidance_scale))
        return self.policy if which == "policy" else self.outputs[which]


@pytest.mark.parametrize("case", [c for c in REFERENCE["cases"] if not c["name"].startswith("interleaved")],
                         ids=lambda c: c["name"])
def test_the_objective_on_a_train_batch_is_the_authors_step(case):
    """The trainer's rows (whole groups, consecutive) through DGPO.loss: the authors' loss; the policy and the old
    policy without classifier-free guidance, the base model at the reference guidance."""
    rows = len(case["advantages"])
    sampler = SimpleNamespace(forward=FlowForward(1000))
    objective = DGPO(sampler, case["beta_dpo"], case["group_size"], case["clip_range"] if case["clip_dsm"] else None,
                     5.0, case["beta"], case["use_ema_ref"], 1.0)
    batch = TrainBatch(latents=None, next_latents=None, timesteps=torch.full((rows,), 600.0), step_indices=None,
                       old_log_probs=None, advantages=_t(case["advantages"]), final_latents=_t(case["x0"]),
                       noise=_t(case["noise"]), cond={}, uncond={}, num_samples=rows)
    models = Prepared(case)
    loss, metrics = objective.loss(models, batch)
    _close(loss.detach(), case["loss"])
    loss.backward()
    _close(models.policy.grad, case["grad_model_v"])
    assert ("policy", 1.0) in models.calls and all(scale == 1.0 for which, scale in models.calls if which == "old")


def test_groups_of_a_train_batch_are_one_prompt_at_one_step():
    # 4 samples (2 groups of 2) x 3 steps, sample-major
    assert group_ids_of(4, 12, 2).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]
    assert old_policy_decay(1) == 0.0 and old_policy_decay(101) == pytest.approx(0.1) and old_policy_decay(900) == 0.3


def test_the_plan_keeps_each_group_together_at_shared_steps_and_noise():
    config = SimpleNamespace(seed=0, sample_batch_size=8, images_per_prompt=4, num_train_timesteps=3,
                             timestep_selection="random")
    rollout = SimpleNamespace(timesteps=torch.zeros(16, 10), final_latents=torch.zeros(16, 2, 4, 4))
    plan = plan_epoch(config, rollout, 3, 0, 1, 2, True, whole_groups=True)
    assert sorted(plan.order.tolist()) == list(range(16))
    for start in range(0, 16, 4):  # the order reads whole groups, each one prompt's 4 consecutive images
        members = plan.order[start:start + 4]
        assert members.tolist() == list(range(int(members[0]), int(members[0]) + 4)) and int(members[0]) % 4 == 0
    for group in range(4):
        rows = slice(4 * group, 4 * group + 4)
        assert (plan.steps[rows] == plan.steps[4 * group]).all()
        assert (plan.noise[rows] == plan.noise[4 * group]).all()
    assert not torch.equal(plan.noise[0], plan.noise[4]) and not torch.equal(plan.noise[0, 0], plan.noise[0, 1])
    alone = plan_epoch(config, rollout, 3, 0, 1, 2, True)  # other objectives: unchanged, a sample each
    assert not torch.equal(alone.noise[0], alone.noise[1])

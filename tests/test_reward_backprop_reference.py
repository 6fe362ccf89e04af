"""Reward backpropagation's gradients against the authors' code on the same inputs (tests/data/
reward_backprop_reference.json, from experiments/reward_backprop_reference.py: AlignProp's pipeline_step_with_grad with
trl's DDIM step, ImageReward's ReFL training lines), through the trainer's own objectives, samplers and family decoder,
on align/testing/tiny_backprop.py's float64 stand-ins: within 1e-5 of the largest gradient component. DRaFT has no
official code: DRaFT-K is checked through AlignProp's fixed truncation (the same truncation), DRaFT-LV against its
paper's Algorithm 2 written out here."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler

from align.families.base import guided_prediction
from align.families.sd import StableDiffusion
from align.sampling.ddim_sampler import DDIMSampler
from align.testing.tiny_backprop import (
    TinyDecoder,
    TinyDenoiser,
    TinyJudge,
    gradient_vector,
    text_embeddings,
)
from align.train.backprop_sampling import draw_first_trained_step, truncated_sample
from align.train.objectives.alignprop import AlignProp
from align.train.objectives.draft import DRaFT
from align.train.objectives.draft_lv import DRaFTLV
from align.train.objectives.refl import ReFL

REFERENCE = json.loads((Path(__file__).parent / "data" / "reward_backprop_reference.json").read_text())
INPUTS = REFERENCE["inputs"]
SD = StableDiffusion()


def setup(steps: int, eta: float, guidance: float, seed: int):
    unet, vae, judge = TinyDenoiser(INPUTS["channels"]), TinyDecoder(INPUTS["channels"]), TinyJudge()
    sampler = DDIMSampler(DDIMScheduler(**INPUTS["schedule"]), steps, eta, stochastic_steps=None if eta > 0 else 0)
    positive, negative = text_embeddings(INPUTS["batch"])
    generator = torch.Generator().manual_seed(seed)
    size = INPUTS["size"]
    noise = torch.randn((INPUTS["batch"], INPUTS["channels"], size, size), generator=generator)

    def predict(latents, timesteps):
        copies = latents.shape[0] // positive.shape[0]
        return guided_prediction(SD, unet, latents, timesteps, {"prompt_embeds": positive.repeat(copies, 1, 1)},
                                 {"prompt_embeds": negative.repeat(copies, 1, 1)}, guidance)

    def reward(latents):
        images = SD.decode_latents(SimpleNamespace(vae=vae), latents)
        return judge.score_differentiable(INPUTS["prompts"] * (latents.shape[0] // len(INPUTS["prompts"])), images)

    return unet, sampler, predict, reward, noise, generator


def assert_same_gradient(ours: torch.Tensor, theirs: list[float]) -> None:
    theirs = torch.tensor(theirs, dtype=torch.float64)
    scale = theirs.abs().max()
    assert scale > 0 and float((ours - theirs).abs().max() / scale) < 1e-5


@pytest.mark.parametrize("case", sorted(REFERENCE["alignprop"]))
def test_alignprop_and_draft_k_gradients_equal_the_authors_pipeline(case):
    ref = REFERENCE["alignprop"][case]
    steps, first = ref["steps"], ref["first_trained_step"]
    unet, sampler, predict, reward, noise, generator = setup(steps, ref["eta"], ref["guidance"], ref["seed"])
    if case.startswith("draft"):
        objective = DRaFT(steps - first)
        latents, _ = objective.sample(sampler, predict, noise, generator)
    else:  # the authors' checkpointed steps at a fixed truncation
        objective = AlignProp(0.84, 0.1, INPUTS["loss_scale_alignprop"], checkpointed=True)
        latents = truncated_sample(sampler, predict, noise, generator, steps - first, checkpointed=True)
    rewards = reward(latents)
    torch.testing.assert_close(rewards.double(), torch.tensor(ref["scores"], dtype=torch.float64), rtol=1e-6, atol=1e-7)
    loss = AlignProp(0.84, 0.1, INPUTS["loss_scale_alignprop"], True).reward_loss(rewards)  # 0.01 x -r: 0.01 x (1 - r)
    loss.backward()
    assert_same_gradient(gradient_vector(unet), ref["gradient"])


@pytest.mark.parametrize("case", REFERENCE["alignprop_truncation"], ids=lambda c: f"{c['steps']}-steps")
def test_alignprops_truncation_draw_is_the_authors(case):
    generator = torch.Generator().manual_seed(case["seed"])
    assert draw_first_trained_step(case["steps"], case["mean"], case["std"], generator) == case["first_trained_step"]


@pytest.mark.parametrize("case", sorted(REFERENCE["refl"]))
def test_refl_gradient_equals_the_authors_training_step(case, monkeypatch):
    ref = REFERENCE["refl"][case]
    unet, sampler, predict, reward, noise, generator = setup(40, 1.0, 1.0, ref["seed"])  # their DDPM: DDIM eta 1
    objective = ReFL(10, INPUTS["refl_ceiling"], INPUTS["loss_scale_refl"])
    monkeypatch.setattr("align.train.objectives.refl.draw_refl_step", lambda total, last, gen: ref["step"])
    latents, metrics = objective.sample(sampler, predict, noise, generator)
    assert metrics["refl_step"] == ref["step"]
    loss = objective.reward_loss(reward(latents))
    assert float(loss.detach()) == pytest.approx(ref["loss"], rel=1e-6)
    loss.backward()
    assert_same_gradient(gradient_vector(unet), ref["gradient"])


def test_draft_lv_gradient_is_the_papers_algorithm_2():
    """DRaFT-LV (no official code): x_0 sampled without gradients; n times, x_1 = α_1 x_0 + σ_1 ε and the last DDIM step
    from x_1 with gradients; the gradient of the mean reward of the n images. Written out in float64 here."""
    steps, n = 6, 2
    unet, sampler, predict, reward, noise, generator = setup(steps, 0.0, 7.5, 5)
    latents, _ = DRaFTLV(n).sample(sampler, predict, noise, generator)
    DRaFTLV(n).reward_loss(reward(latents)).backward()
    ours = gradient_vector(unet)

    unet.zero_grad()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(noise.shape, generator=g).double()
    scheduler = DDIMScheduler(**INPUTS["schedule"])
    scheduler.set_timesteps(steps)
    alphas = scheduler.alphas_cumprod.double()
    positive, negative = text_embeddings(INPUTS["batch"])

    def eps(latents, t):
        copies = latents.shape[0] // positive.shape[0]
        text = torch.cat([negative.repeat(copies, 1, 1), positive.repeat(copies, 1, 1)])
        out = unet(torch.cat([latents, latents]), t, text).sample
        uncond, cond = out.chunk(2)
        return uncond + 7.5 * (cond - uncond)

    def ddim_step(latents, t, prev):  # η = 0
        e = eps(latents, t)
        x0 = (latents - (1 - alphas[t]).sqrt() * e) / alphas[t].sqrt()
        a_prev = alphas[prev] if prev >= 0 else alphas[0]
        return a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * e

    with torch.no_grad():
        chain = scheduler.timesteps.tolist()
        for i, t in enumerate(chain):
            torch.randn(noise.shape, generator=g)  # the chain's step draws (unused at η = 0)
            x = ddim_step(x, t, chain[i + 1] if i + 1 < len(chain) else -1)
    t1 = chain[-1]
    x0 = x.repeat(n, 1, 1, 1)  # the n copies, copy-major, re-noised with one draw
    x1 = alphas[t1].sqrt() * x0 + (1 - alphas[t1]).sqrt() * torch.randn(x0.shape, generator=g).double()
    images = ddim_step(x1, t1, -1)
    (-reward(images).mean()).backward()
    theirs = gradient_vector(unet)
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-5

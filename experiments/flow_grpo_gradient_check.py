"""Is Flow-GRPO's policy gradient an unbiased estimate of the reward's gradient? A check on a differentiable reward.

    python -m experiments.flow_grpo_gradient_check                      # flow testbed, 512 samples, window of 5 of 10
    python -m experiments.flow_grpo_gradient_check --model <folder> --samples 1024 --window 2

For a reward that is differentiable in the final latent (here R = 10 · mean(w ⊙ x_final) with a fixed random
w), the gradient of E[R] with respect to the trained weights can be computed exactly per sample by
backpropagating through the sampling chain with its noises held fixed (the reparameterised gradient). The
trainer's estimate is the score-function one, mean(A · Σ_t ∇ log p(x_{t+1} | x_t)) over the stochastic
window, with A = R - mean(R), computed with the trainer's own sampler and step Gaussian (both halves of
classifier-free guidance differentiated, as the exact gradient does and as the trainer and Flow-GRPO do).
Only the path through the window's steps counts in the comparison: the deterministic steps after the window
see the trained weights without gradient (the score-function estimate cannot see that path). Both
estimates are accumulated over batches of 32 and their cosine is printed after each batch: it should grow
towards 1 as samples accumulate if the trainer's estimate is unbiased, and its growth rate shows how noisy
it is. The LoRA's B matrices start at small random values (not zero) so that every LoRA weight has a gradient.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from align.data.prompt_sets import load_prompt_list
from align.families import family_of_pipeline
from align.families.base import expand_conditioning, guided_prediction, repeat_conditioning
from align.pipeline import add_lora, load_pipeline
from align.sampling.flow import sample_flow_with_logprob
from align.sampling.flow_sde_sampler import FlowSampler


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="testbed-flow")
    p.add_argument("--prompts", default="testbed:256")
    p.add_argument("--samples", type=int, default=512, help="samples in all, in batches of 32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=int, default=5, help="the first this many steps are stochastic and trained")
    p.add_argument("--eta", type=float, default=0.7, help="the SDE's noise level")
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)

    pipe = load_pipeline(args.model)
    family = family_of_pipeline(pipe)
    if not family.is_flow:
        sys.exit(f"--model {args.model!r} is a {family.name} pipeline; this check is for flow-matching models")
    denoiser = family.denoiser(pipe)
    for module in family.frozen_modules(pipe):
        module.requires_grad_(False)
    torch.manual_seed(args.seed)
    add_lora(denoiser, rank=8, target_modules=family.lora_targets)
    for name, p in denoiser.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.01)
    params = [p for p in denoiser.parameters() if p.requires_grad]
    resolution = family.native_resolution(pipe)
    negative = family.unconditional(pipe, 1, resolution)
    sigmas = family.flow_sigmas(pipe, args.steps, resolution)
    shape = family.latent_shape(pipe, resolution)
    sampler = FlowSampler(sigmas, args.eta, window=args.window, window_at="start")  # the trainer's sampler
    prompts = load_prompt_list(args.prompts)
    direction = torch.randn(*shape, generator=torch.Generator().manual_seed(args.seed + 5))

    def reward(latents):
        return 10 * (latents * direction).flatten(1).mean(1)

    def gradient(loss):
        for p in params:
            p.grad = None
        loss.backward()
        return torch.cat([p.grad.flatten().clone() for p in params])

    print(f"model {args.model} ({family.name}) | {args.steps} steps, SDE on the first {args.window}, noise level {args.eta}, "
          f"guidance {args.guidance} | reward 10·mean(w ⊙ x_final)")
    score_function, reparameterised, batch = 0, 0, 32
    for b in range(args.samples // batch):
        g = torch.Generator().manual_seed(args.seed * 1000 + 100 + b)
        chosen = [prompts[i] for i in torch.randint(0, len(prompts), (batch,), generator=g)]
        cond = family.encode_prompts(pipe, chosen, resolution)
        uncond = expand_conditioning(negative, batch)
        noise = torch.randn((batch, *shape), generator=g)
        calls = [0]

        def velocity(x, t, calls=calls, cond=cond, uncond=uncond):
            in_window = calls[0] < args.window
            calls[0] += 1
            for p in params:  # after the window: only the path through x, as the score function sees it
                p.requires_grad_(in_window)
            out = guided_prediction(family, denoiser, x, t, cond, uncond, args.guidance)
            for p in params:
                p.requires_grad_(True)
            return out

        trajectory = sample_flow_with_logprob(velocity, noise, sigmas, (0, args.window), args.eta, generator=g)
        rewards = reward(trajectory.final_latents)
        reparameterised = reparameterised + gradient(rewards.mean())
        latents = trajectory.latents.detach().flatten(0, 1)
        next_latents = trajectory.next_latents.detach().flatten(0, 1)
        timesteps = trajectory.timesteps.repeat(batch)
        step_indices = torch.arange(args.window).repeat(batch)
        prediction = guided_prediction(family, denoiser, latents, timesteps, repeat_conditioning(cond, args.window),
                                        expand_conditioning(negative, len(latents)), args.guidance)
        step = sampler.step(prediction, latents, timesteps, step_indices)
        log_prob = step.log_prob(next_latents).reshape(batch, args.window).sum(1)
        advantages = rewards.detach() - rewards.detach().mean()
        score_function = score_function + gradient((advantages * log_prob).mean())
        cosine = torch.nn.functional.cosine_similarity(score_function, reparameterised, dim=0)
        print(f"{(b + 1) * batch:>6} samples: cos(score function, reparameterised) = {cosine:+.3f}", flush=True)


if __name__ == "__main__":
    main()

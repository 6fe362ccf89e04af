"""Is a reward learnable by DDPO at a given batch size? Agreement of independent policy-gradient estimates.

    python experiments/ddpo_gradient_snr.py                       # testbed + shapes-oracle, 64 samples per estimate
    python experiments/ddpo_gradient_snr.py --samples 256 --eta 0.5 --reward jpeg-compressibility

Each estimate is the gradient of DDPO's first-minibatch objective, -mean(A · log p(x_{t-1} | x_t)),
with group-relative advantages, on its own fresh batch of prompts and samples, all from the same
model. The mean pairwise cosine between estimates measures signal against noise: if g_i = μ + ε_i,
then E[cos(g_i, g_j)] ≈ |μ|² / (|μ|² + E|ε|²), so a cosine near 0 means an optimiser step of that
batch size is mostly noise (more samples per step, not more steps, is what helps), and the cosine
grows roughly linearly with the batch size while it is small. Rows: timestep selection (random
half of the chain, or the noisiest half) × starting noise (independent, or shared within a group).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="testbed")
    p.add_argument("--reward", default="shapes-oracle")
    p.add_argument("--prompts", default="testbed:256")
    p.add_argument("--samples", type=int, default=64, help="samples per gradient estimate")
    p.add_argument("--images-per-prompt", type=int, default=8)
    p.add_argument("--estimates", type=int, default=4, help="independent estimates per row (pairs compared: n(n-1)/2)")
    p.add_argument("--steps", type=int, default=None, help="DDIM steps (default: the testbed's own, else 50)")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--eta", type=float, default=1.0)
    p.add_argument("--timestep-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def gradient_estimate(pipe, judge, prompts, negative, args, steps, guidance, seed, shared_noise, selection):
    """One flattened gradient of the PPO objective at ratio 1 (i.e. the policy gradient), and the mean reward."""
    from align.advantages import group_advantages
    from align.ddpo import DDPOConfig, draw_prompts, train_timestep_indices
    from align.pipeline import decode_latents, encode_prompts
    from align.sampling import (
        ddim_step_mean_std,
        gaussian_log_prob,
        guided_noise_prediction,
        sample_with_logprob,
    )

    unet, g = pipe.unet, torch.Generator().manual_seed(seed)
    # The trainer's own draws: one sampling batch of the whole estimate
    sampling = DDPOConfig(prompts="-", sample_batch_size=args.samples, images_per_prompt=args.images_per_prompt)
    batch = draw_prompts(prompts, sampling, g)
    shape = (unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    if shared_noise:  # one starting noise per group of a prompt's images (DanceGRPO; not a trainer option)
        x_T = torch.randn((len(batch) // args.images_per_prompt, *shape), generator=g)
        x_T = x_T.repeat_interleave(args.images_per_prompt, dim=0)
    else:
        x_T = torch.randn((len(batch), *shape), generator=g)
    embeds = encode_prompts(pipe, batch)
    with torch.no_grad():
        chain = sample_with_logprob(unet, pipe.scheduler, embeds, negative.expand(len(batch), -1, -1),
                                    num_inference_steps=steps, guidance_scale=guidance, eta=args.eta, latents=x_T, generator=g)
        rewards = judge.score(batch, decode_latents(pipe, chain.final_latents)).double().numpy()
    advantages = torch.as_tensor(group_advantages(batch, rewards), dtype=torch.float32)

    k = max(1, int(steps * args.timestep_fraction))
    chosen = train_timestep_indices(len(batch), steps, k, selection, g)
    rows = torch.arange(len(batch))[:, None]
    latents = chain.all_latents[rows, chosen].flatten(0, 1)
    next_latents = chain.all_latents[rows, chosen + 1].flatten(0, 1)
    timesteps = chain.timesteps[rows, chosen].flatten()
    unet.zero_grad(set_to_none=True)
    pred = guided_noise_prediction(unet, latents, timesteps, embeds.repeat_interleave(k, dim=0),
                                   negative.expand(len(latents), -1, -1), guidance)
    mean, std = ddim_step_mean_std(pipe.scheduler, pred, timesteps, latents, args.eta)
    loss = -(advantages.repeat_interleave(k) * gaussian_log_prob(next_latents, mean, std)).mean()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in unet.parameters() if p.grad is not None])
    return grad, float(rewards.mean())


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    import rewards
    from align.pipeline import encode_prompts, load_pipeline, testbed_settings
    from align.training import load_prompt_list

    if args.samples % args.images_per_prompt or args.images_per_prompt < 2:
        sys.exit("--samples must be a multiple of --images-per-prompt (>= 2: advantages are group-relative)")
    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    pipe.unet.requires_grad_(True)
    defaults = testbed_settings(args.model)
    steps = args.steps or defaults.get("num_inference_steps", 50)
    guidance = args.guidance if args.guidance is not None else defaults.get("guidance_scale", 5.0)
    judge = rewards.load(args.reward)
    prompts = load_prompt_list(args.prompts)
    negative = encode_prompts(pipe, [""])
    print(f"model {args.model} | reward {args.reward} | {args.samples} samples per estimate "
          f"({args.images_per_prompt} per prompt) | {steps} steps, eta {args.eta}, guidance {guidance} | "
          f"{args.estimates} estimates per row")
    print(f"{'timesteps':<11} {'x_T':<12} {'cos(g_i, g_j)':>14} {'± s.e.':>8} {'mean reward':>12}")
    for selection, shared in itertools.product(("random", "high_noise"), (False, True)):
        estimates = [gradient_estimate(pipe, judge, prompts, negative, args, steps, guidance, args.seed * 1000 + i, shared, selection)
                     for i in range(args.estimates)]
        cos = torch.tensor([torch.nn.functional.cosine_similarity(a, b, dim=0).item()
                            for (a, _), (b, _) in itertools.combinations(estimates, 2)])
        se = float(cos.std() / len(cos) ** 0.5) if len(cos) > 1 else float("nan")
        reward = sum(r for _, r in estimates) / len(estimates)
        print(f"{selection:<11} {'shared' if shared else 'independent':<12} {float(cos.mean()):>+14.4f} {se:>8.4f} {reward:>12.3f}",
              flush=True)


if __name__ == "__main__":
    main()

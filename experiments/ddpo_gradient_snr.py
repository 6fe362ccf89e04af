"""Is a reward learnable by DDPO / Flow-GRPO at a given batch size? Agreement of independent policy-gradient estimates.

    python -m experiments.ddpo_gradient_snr                                  # SD testbed + shapes-oracle, 64 samples
    python -m experiments.ddpo_gradient_snr --samples 256 --eta 0.5 --reward jpeg-compressibility
    python -m experiments.ddpo_gradient_snr --model testbed-flow --steps 10 --rows all:10 first:5 window:2

Each estimate is the gradient of the trainer's first-minibatch objective, -mean(A · log p(x_next | x)),
with group-relative advantages, on its own fresh batch of prompts and samples, all from the same model,
computed with the trainer's own sampler (``align.train.rollout``) and guided prediction, for the
weights the trainer trains (a fresh LoRA: only its B matrices have a gradient at the start; ``--full``:
every weight of the denoiser). The mean pairwise cosine between estimates measures signal against
noise: if g_i = μ + ε_i, then E[cos(g_i, g_j)] ≈ |μ|² / (|μ|² + E|ε|²), so a cosine near 0 means an
optimiser step of that batch size is mostly noise (more samples per step, not more steps, is what helps), and the cosine grows roughly
linearly with the batch size while it is small.

Rows (``--rows``), each ``selection:k`` with k trained steps of the chain:
    all:k     every step stochastic, k of them drawn per sample (DDPO; Flow-GRPO at k = steps)
    first:k   only the k noisiest steps stochastic and trained, deterministic after (--deterministic_tail,
              --timestep_selection high_noise)
    window:k  flow only: a k-step stochastic window drawn per batch in the first half (Flow-GRPO-Fast)
``--shared-noise`` gives a caption's images one starting noise (DanceGRPO), so that they differ only by the
sampler's noise. ``--detach-uncond`` takes no gradient through the unconditional half of guidance (Flow-GRPO before
its commit a482878; the trainer, as Flow-GRPO now, differentiates both halves).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

import rewards
from align.data.prompt_sets import load_prompt_list
from align.families import family_of_pipeline
from align.families.base import cat_conditioning, expand_conditioning, guided_prediction, repeat_conditioning
from align.pipeline import add_lora, decode_latents, load_pipeline, testbed_settings
from align.sampling.registry import sampler_entry
from align.train.advantages import group_advantages
from align.train.ddpo import DDPOConfig
from align.train.online_rollouts import draw_prompts
from align.train.online_update import train_timestep_indices


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="testbed")
    p.add_argument("--reward", default="shapes-oracle")
    p.add_argument("--prompts", default="testbed:256")
    p.add_argument("--samples", type=int, default=64, help="samples per gradient estimate")
    p.add_argument("--images-per-prompt", type=int, default=8)
    p.add_argument("--estimates", type=int, default=4, help="independent estimates per row (pairs compared: n(n-1)/2)")
    p.add_argument("--steps", type=int, default=None, help="sampling steps (default: the testbed's own, else 50)")
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--eta", type=float, default=0.7, help="DDIM eta, or the flow SDE's noise level")
    p.add_argument("--rows", nargs="+", default=["all:10", "first:10"], help="selection:k rows (see above)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--targets", nargs="+", default=None, help="LoRA target modules (default: the family's)")
    p.add_argument("--full", action="store_true", help="the gradient of every denoiser weight instead of a LoRA's")
    p.add_argument("--detach-uncond", action="store_true", help="no gradient through the unconditional half of guidance")
    p.add_argument("--shared-noise", action="store_true",
                   help="one starting noise per group of a caption's images (DanceGRPO; not a trainer option)")
    p.add_argument("--shift", type=float, default=None, help="flow: sample with this static σ shift (SD3.5: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def row_config(args, steps: int, guidance: float, row: str):
    """The trainer's config for one row ``selection:k``."""
    selection, _, k = row.partition(":")
    if selection not in ("all", "first", "window") or not k.isdigit() or not 1 <= int(k) <= steps:
        sys.exit(f"--rows: {row!r} is not all:k, first:k or window:k with 1 <= k <= {steps} steps")
    return DDPOConfig(prompts="-", sample_batch_size=args.samples, images_per_prompt=args.images_per_prompt,
                      num_inference_steps=steps, guidance_scale=guidance, eta=args.eta,
                      timestep_fraction=int(k) / steps, deterministic_tail=selection != "all",
                      timestep_selection="high_noise" if selection == "first" else "random")


def pairwise_cosine(estimates: list[torch.Tensor]) -> tuple[float, float]:
    """Mean cosine between every pair of flattened gradient estimates, ± the standard error of those pairs' mean."""
    cos = torch.tensor([torch.nn.functional.cosine_similarity(a, b, dim=0).item()
                        for a, b in itertools.combinations(estimates, 2)])
    return float(cos.mean()), float(cos.std() / len(cos) ** 0.5) if len(cos) > 1 else float("nan")


def detached_uncond_prediction(family, denoiser, latents, timesteps, cond, uncond, guidance_scale):
    """uncond + w·(cond - uncond) with no gradient through uncond (Flow-GRPO's compute_log_prob until a482878)."""
    if guidance_scale == 1.0 or family.uses_guidance_embedding(denoiser):
        return guided_prediction(family, denoiser, latents, timesteps, cond, uncond, guidance_scale)
    out = family.predict(denoiser, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                         cat_conditioning([uncond, cond]))
    uncond_out, cond_out = out.float().chunk(2)
    uncond_out = uncond_out.detach()
    return uncond_out + guidance_scale * (cond_out - uncond_out)


def gradient_estimate(pipe, family, denoiser, judge, prompts, negative, sampler, resolution, config, seed, detach_uncond,
                      params, shared_noise=False):
    """One flattened policy gradient (the PPO objective at ratio 1) and the batch's mean reward."""
    g = torch.Generator().manual_seed(seed)
    batch = draw_prompts(prompts, config, g)
    n = len(batch)
    cond = family.encode_prompts(pipe, batch, resolution)
    shape = family.latent_shape(pipe, resolution)
    if shared_noise:  # draw_prompts puts a caption's images next to each other
        noise = torch.randn((n // config.images_per_prompt, *shape), generator=g).repeat_interleave(config.images_per_prompt, 0)
    else:
        noise = torch.randn((n, *shape), generator=g)
    uncond = expand_conditioning(negative, n)
    with torch.no_grad():
        steps = sampler.run(lambda x, t: guided_prediction(family, denoiser, x, t, cond, uncond, config.guidance_scale),
                            noise, g)
        rewards = judge.score(batch, decode_latents(pipe, steps["final_latents"])).double().numpy()
    advantages = torch.as_tensor(group_advantages(batch, rewards), dtype=torch.float32)
    steps_total = steps["timesteps"].shape[1]
    k = min(config.num_train_timesteps, steps_total)
    chosen = train_timestep_indices(n, steps_total, k, "high_noise" if config.deterministic_tail else "random", g)
    rows = torch.arange(n)[:, None]
    latents, next_latents = (steps[key][rows, chosen].flatten(0, 1) for key in ("latents", "next_latents"))
    timesteps = steps["timesteps"][rows, chosen].flatten()
    step_indices = steps["step_indices"][rows, chosen].flatten()
    denoiser.zero_grad(set_to_none=True)
    predict = detached_uncond_prediction if detach_uncond else guided_prediction
    pred = predict(family, denoiser, latents, timesteps, repeat_conditioning(cond, k),
                   expand_conditioning(negative, len(latents)), config.guidance_scale)
    log_prob = sampler.step(pred, latents, timesteps, step_indices).log_prob(next_latents)
    loss = -(advantages.repeat_interleave(k) * log_prob).mean()
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    return grad, float(rewards.mean())


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    if args.samples % args.images_per_prompt or args.images_per_prompt < 2:
        sys.exit("--samples must be a multiple of --images-per-prompt (>= 2: advantages are group-relative)")
    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    family = family_of_pipeline(pipe)
    if args.shift is not None:
        if not family.is_flow:
            sys.exit("--shift is for flow-matching models")
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, shift=args.shift)
    denoiser = family.denoiser(pipe)
    for module in family.frozen_modules(pipe):
        module.requires_grad_(False)
    torch.manual_seed(args.seed)
    if args.full:
        denoiser.requires_grad_(True)
    else:
        add_lora(denoiser, rank=args.lora_rank, target_modules=args.targets or family.lora_targets)
    params = [p for p in denoiser.parameters() if p.requires_grad]
    defaults = testbed_settings(args.model)
    steps = args.steps or defaults.get("num_inference_steps", 50)
    guidance = args.guidance if args.guidance is not None else defaults.get("guidance_scale", 5.0)
    judge = rewards.load(args.reward)
    prompts = load_prompt_list(args.prompts)
    resolution = family.native_resolution(pipe)
    negative = family.unconditional(pipe, 1, resolution)
    print(f"model {args.model} ({family.name}) | reward {args.reward} | {args.samples} samples per estimate "
          f"({args.images_per_prompt} per prompt) | {steps} steps, eta {args.eta}, guidance {guidance} | "
          f"{args.estimates} estimates per row | " + ("every denoiser weight" if args.full else f"LoRA r{args.lora_rank}")
          + (" | no gradient through the unconditional half" if args.detach_uncond else "")
          + (" | one starting noise per group" if args.shared_noise else "")
          + (f" | σ shift {args.shift}" if args.shift is not None else ""))
    print(f"{'row':<11} {'cos(g_i, g_j)':>14} {'± s.e.':>8} {'mean reward':>12}")
    for row in args.rows:
        config = row_config(args, steps, guidance, row)
        if config.deterministic_tail and not family.is_flow and config.timestep_selection != "high_noise":
            sys.exit(f"--rows {row}: windows are for flow models")
        config.resolve_for_family(family.is_flow)
        sampler = sampler_entry(config.sampler, family.is_flow).build(config, family, pipe, resolution, "cpu")
        estimates = [gradient_estimate(pipe, family, denoiser, judge, prompts, negative, sampler,
                                       resolution, config, args.seed * 1000 + i, args.detach_uncond, params,
                                       args.shared_noise)
                     for i in range(args.estimates)]
        cosine, se = pairwise_cosine([grad for grad, _ in estimates])
        reward = sum(r for _, r in estimates) / len(estimates)
        print(f"{row:<11} {cosine:>+14.4f} {se:>8.4f} {reward:>12.3f}", flush=True)


if __name__ == "__main__":
    main()

"""The SD3 transformer or the flow objective? The SD testbed's UNet retrained to predict velocity, probed for
Flow-GRPO's policy-gradient signal.

    python -m experiments.unet_flow_probe --minutes 12

On the flow testbed (SD3 transformer, velocity) independent 64-sample Flow-GRPO gradients do not agree (cosine
~0), on the SD testbed (UNet, epsilon, DDIM) DDPO's agree at +0.20 (experiments/notes/flow.md, round 2). This
takes the SD testbed's UNet and changes only the objective:

1. render scenes of the shapes world as scripts/build_flow_testbed.py does (a quarter under another scene's
   caption, the held-out captions left out) and encode them with the SD testbed's VAE;
2. fine-tune the UNet from its epsilon weights with the flow testbed's objective (x_σ = (1-σ)·z0 + σ·ε, σ
   logit-normal, velocity target ε - z0, timestep σ·1000, caption dropout 0.1; text encoder frozen);
3. score it on the flow testbed's held-out captions with the flow testbed's sampler (20 Euler steps, guidance 3);
4. measure the cosine between independent Flow-GRPO policy gradients exactly as experiments/ddpo_gradient_snr.py
   does for the pipelines (64 samples, groups of 8, SDE at noise level 0.7 on the first 5 of 10 steps, ODE
   after, LoRA r8 on the UNet's attention, the unconditional half of guidance detached).

A cosine near the SD testbed's says the flow objective and Flow-GRPO's sampler carry the signal and the SD3
transformer does not; near zero says the flow parametrisation itself loses it.

    python -m experiments.unet_flow_probe --epsilon --ddim-grid [--step ddim] [--both-cfg-halves]

``--epsilon`` skips steps 1-2 and samples the SD testbed's ε-UNet as it is, its prediction converted to a
velocity; ``--ddim-grid`` puts the steps on the σ of DDIM's 20 timesteps (the first 10 stochastic) and
``--step ddim`` makes them DDIM's η = 0.7 step written in flow coordinates instead of Flow-GRPO's SDE: the
SD testbed's own chain, seen through the flow code.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import rewards
from align.data.prompt_sets import load_prompt_list
from align.pipeline import add_lora, decode_latents, encode_prompts, load_pipeline
from align.sampling.flow import FlowStep, gaussian_log_prob, sample_flow_with_logprob, sde_step
from align.testbed.scene import sample_captions
from align.train.advantages import group_advantages
from align.train.ddpo import DDPOConfig
from align.train.online_rollouts import draw_prompts
from experiments.ddpo_gradient_snr import pairwise_cosine
from scripts.build_flow_testbed import EVAL_CAPTION_SEED, encode_latents, render_scenes, swap_captions

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=12.0, help="fine-tuning budget (wall-clock minutes, one thread)")
    p.add_argument("--num-scenes", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-captions", type=int, default=200)
    p.add_argument("--estimates", type=int, default=4)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--epsilon", action="store_true",
                   help="skip the fine-tuning: the SD testbed's ε-UNet as it is, its prediction converted to velocity")
    p.add_argument("--ddim-grid", action="store_true",
                   help="Flow-GRPO's SDE on the σ of DDIM's 20 timesteps (999, 949, ..., 49; σ = √(1-ᾱ) / (√ᾱ + √(1-ᾱ))), "
                        "the first 10 stochastic and trained, instead of 10 uniform σ from 1")
    p.add_argument("--step", choices=["sde", "ddim"], default="sde",
                   help="the stochastic step: Flow-GRPO's SDE, or DDIM's (η 0.7) written in flow coordinates")
    p.add_argument("--both-cfg-halves", action="store_true", help="differentiate the unconditional half of guidance too")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def epsilon_as_velocity(unet, alphas_cumprod, latents, sigma, embeds):
    """An ε-prediction UNet (DDPM) seen as a flow model: x_flow = (1-σ)·x0 + σ·ε is the DDPM latent x_t / (√ᾱ + √(1-ᾱ))
    with ᾱ = (1-σ)² / ((1-σ)² + σ²); t is read off the schedule (continuous, clamped to its last step, ᾱ ≈ 0.0047,
    where σ = 1 has no DDPM counterpart); the velocity is ε̂ - x̂0."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1, 1, 1, 1)
    alpha_bar = ((1 - sigma) ** 2 / ((1 - sigma) ** 2 + sigma**2)).clamp(min=float(alphas_cumprod[-1]))
    # alphas_cumprod falls with t: interpolate t at alpha_bar
    table = alphas_cumprod.flip(0)
    position = torch.searchsorted(table, alpha_bar.flatten()).clamp(1, len(table) - 1)
    low, high = table[position - 1], table[position]
    t = (len(table) - 1) - (position - 1 + (alpha_bar.flatten() - low) / (high - low))
    alpha_bar = alpha_bar.expand(len(latents), 1, 1, 1) if alpha_bar.shape[0] == 1 else alpha_bar
    x_t = latents * (alpha_bar.sqrt() + (1 - alpha_bar).sqrt())
    eps = unet(x_t, t.expand(len(latents)) if t.numel() == 1 else t, encoder_hidden_states=embeds).sample.float()
    x0 = (x_t - (1 - alpha_bar).sqrt() * eps) / alpha_bar.sqrt()
    return eps - x0


def ddim_flow_step(x, v, sigma, sigma_next, sigma_max, eta: float):
    """DDIM's stochastic step (η) in flow coordinates: x_t = (√ᾱ + √(1-ᾱ))·x_flow turns DDIM's
    √ᾱ'·x̂0 + √(1-ᾱ'-σ_t²)·ε̂ + σ_t·z into (1-σ')·x̂0 + √(σ'² - s²)·ε̂ + s·z with s = σ_t / (√ᾱ' + √(1-ᾱ')).
    ``sde_step``'s arguments (``sigma_max`` unused), so that the trainer's sampler takes it."""
    def alpha_bar(s):
        return (1 - s) ** 2 / ((1 - s) ** 2 + s**2)

    a, a_next = alpha_bar(torch.as_tensor(sigma).float()), alpha_bar(torch.as_tensor(sigma_next).float())
    ddim_std = eta * ((1 - a_next) / (1 - a) * (1 - a / a_next)).sqrt()
    std = ddim_std / (a_next.sqrt() + (1 - a_next).sqrt())
    x, v = x.float(), v.float()
    x0, eps = x - sigma * v, x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + (sigma_next**2 - std**2).clamp(min=0).sqrt() * eps
    return FlowStep(mean=mean, std=std.reshape(1, 1, 1, 1), sde_sigma=std)


def velocity(unet, latents, sigma, embeds, negative, guidance, detach_uncond=False, alphas_cumprod=None):
    """Classifier-free guided velocity of the UNet at σ (timestep σ·1000; an ε-UNet through ``alphas_cumprod``)."""
    both, conditioning = torch.cat([latents, latents]), torch.cat([negative.expand(len(latents), -1, -1), embeds])
    if alphas_cumprod is not None:
        out = epsilon_as_velocity(unet, alphas_cumprod, both, sigma, conditioning)
    else:
        t = (torch.as_tensor(sigma, dtype=torch.float32) * 1000).reshape(-1).expand(len(both))
        out = unet(both, t, encoder_hidden_states=conditioning).sample.float()
    uncond, cond = out.chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance * (cond - uncond)


def teach_velocity(pipe, eval_captions, args, g) -> None:
    """Steps 1-2: render and encode the flow build's scenes, fine-tune the UNet on the velocity objective."""
    unet, vae = pipe.unet, pipe.vae
    # 1. data, as the flow testbed's build
    held_out = set(eval_captions)
    captions = [c for c in sample_captions(2 * args.num_scenes, seed=args.seed) if c not in held_out][: args.num_scenes]
    images = render_scenes(captions, seed=args.seed)
    captions = swap_captions(captions, 0.25, g)
    latent_mean, latent_std = encode_latents(vae, images)
    print(f"[probe] {len(captions)} scenes encoded to {tuple(latent_mean.shape[1:])} latents", flush=True)

    # 2. the UNet taught velocity
    unet.requires_grad_(True)
    unet.train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=1e-2)
    start, step = time.time(), 0
    while time.time() - start < args.minutes * 60:
        idx = torch.randint(0, len(captions), (args.batch_size,), generator=g)
        z0 = latent_mean[idx] + latent_std[idx] * torch.randn(latent_mean[idx].shape, generator=g)
        drop = (torch.rand(args.batch_size, generator=g) < 0.1).tolist()
        with torch.no_grad():
            embeds = encode_prompts(pipe, ["" if d else captions[i] for d, i in zip(drop, idx.tolist())])
        noise = torch.randn(z0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(len(z0), generator=g)).reshape(-1, 1, 1, 1)
        noisy = (1 - sigma) * z0 + sigma * noise
        loss = F.mse_loss(unet(noisy, sigma.flatten() * 1000, encoder_hidden_states=embeds).sample, noise - z0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 200 == 0:
            print(f"[probe] step {step} loss {loss.item():.4f} ({time.time() - start:.0f} s)", flush=True)
    print(f"[probe] {step} velocity steps in {(time.time() - start) / 60:.1f} min", flush=True)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    g = torch.Generator().manual_seed(args.seed)
    pipe = load_pipeline("testbed")
    unet, vae = pipe.unet, pipe.vae
    pipe.text_encoder.requires_grad_(False)
    vae.requires_grad_(False)

    eval_captions = sample_captions(args.eval_captions, seed=EVAL_CAPTION_SEED + args.seed)
    alphas_cumprod = pipe.scheduler.alphas_cumprod.float() if args.epsilon else None
    if not args.epsilon:
        teach_velocity(pipe, eval_captions, args, g)
    unet.eval()
    unet.requires_grad_(False)

    # 3. held-out score with the flow testbed's sampler
    judge = rewards.load("shapes-oracle")
    negative = encode_prompts(pipe, [""])
    shape = (unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    scores = []
    with torch.no_grad():
        for i in range(0, len(eval_captions), 50):
            chunk = eval_captions[i : i + 50]
            x = torch.randn((len(chunk), *shape), generator=torch.Generator().manual_seed(args.seed + i))
            embeds = encode_prompts(pipe, chunk)
            sigmas = torch.linspace(1, 0, 21)
            for s, s_next in zip(sigmas[:-1], sigmas[1:]):
                x = x + velocity(unet, x, s, embeds, negative, 3.0, alphas_cumprod=alphas_cumprod) * (s_next - s)
            scores.append(judge.score(chunk, decode_latents(pipe, x)))
    scores = torch.cat(scores).double() if scores else torch.full((1,), float("nan"))
    print(f"[probe] held-out oracle {scores.mean():.4f} ± {scores.std() / len(scores) ** 0.5:.4f} "
          f"({len(scores)} captions, 20 Euler steps, guidance 3)", flush=True)

    # 4. Flow-GRPO's gradient signal
    add_lora(unet, rank=8)
    params = [p for p in unet.parameters() if p.requires_grad]
    prompts = load_prompt_list("testbed:256")
    config = DDPOConfig(prompts="-", sample_batch_size=args.samples, images_per_prompt=8)
    sigmas, window = torch.linspace(1, 0, 11), 5
    if args.ddim_grid:
        alpha_bar = pipe.scheduler.alphas_cumprod.float()[torch.arange(999, 0, -50)]
        sigmas = torch.cat([(1 - alpha_bar).sqrt() / (alpha_bar.sqrt() + (1 - alpha_bar).sqrt()), torch.zeros(1)])
        window = 10
    print(f"[probe] {'DDIM' if args.step == 'ddim' else 'Flow-GRPO SDE'} steps on σ {', '.join(f'{v:.3f}' for v in sigmas[: window + 1])}, ... (the first {window} "
          "stochastic and trained)", flush=True)
    step_fn = ddim_flow_step if args.step == "ddim" else sde_step
    estimates = []
    for e in range(args.estimates):
        ge = torch.Generator().manual_seed(args.seed * 1000 + e)
        batch = draw_prompts(prompts, config, ge)
        embeds = encode_prompts(pipe, batch)
        noise = torch.randn((len(batch), *shape), generator=ge)
        with torch.no_grad():
            trajectory = sample_flow_with_logprob(
                lambda x, t, e=embeds: velocity(unet, x, t[0] / 1000, e, negative, 3.0, alphas_cumprod=alphas_cumprod),
                noise, sigmas, (0, window), 0.7, generator=ge, step_fn=step_fn)
            rewards_ = judge.score(batch, decode_latents(pipe, trajectory.final_latents)).double().numpy()
        advantages = torch.as_tensor(group_advantages(batch, rewards_), dtype=torch.float32)
        unet.zero_grad(set_to_none=True)
        loss = 0
        for j in range(window):
            x, x_next = trajectory.latents[:, j], trajectory.next_latents[:, j]
            v = velocity(unet, x, sigmas[j], embeds, negative, 3.0, detach_uncond=not args.both_cfg_halves,
                         alphas_cumprod=alphas_cumprod)
            step_ = step_fn(x, v, sigmas[j], sigmas[j + 1], float(sigmas[1]), 0.7)
            loss = loss - (advantages * gaussian_log_prob(x_next, step_.mean, step_.std)).mean() / window
        loss.backward()
        estimates.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        print(f"[probe] estimate {e}: mean reward {rewards_.mean():.3f}", flush=True)
    cosine, se = pairwise_cosine(estimates)
    print(f"[probe] policy-gradient cosine, first {window} of {len(sigmas) - 1} steps: {cosine:+.4f} ± {se:.4f}",
          flush=True)


if __name__ == "__main__":
    main()

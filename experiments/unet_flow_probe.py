"""The SD3 transformer or the flow objective? The SD testbed's UNet retrained to predict velocity, probed for
Flow-GRPO's policy-gradient signal.

    python experiments/unet_flow_probe.py --minutes 12

On the flow testbed (SD3 transformer, velocity) independent 64-sample Flow-GRPO gradients do not agree (cosine
~0), on the SD testbed (UNet, epsilon, DDIM) DDPO's agree at +0.20 (docs/experiments/flow.md, round 2). This
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
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=12.0, help="fine-tuning budget (wall-clock minutes, one thread)")
    p.add_argument("--num-scenes", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-captions", type=int, default=200)
    p.add_argument("--estimates", type=int, default=4)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_build_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_flow_testbed", ROOT / "scripts" / "build_flow_testbed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def velocity(unet, latents, sigma, embeds, negative, guidance, detach_uncond=False):
    """Classifier-free guided velocity of the UNet at σ (timestep σ·1000)."""
    t = (torch.as_tensor(sigma, dtype=torch.float32) * 1000).reshape(-1).expand(len(latents))
    out = unet(torch.cat([latents, latents]), torch.cat([t, t]),
               encoder_hidden_states=torch.cat([negative.expand(len(latents), -1, -1), embeds])).sample.float()
    uncond, cond = out.chunk(2)
    if detach_uncond:
        uncond = uncond.detach()
    return uncond + guidance * (cond - uncond)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    import rewards
    from align.advantages import group_advantages
    from align.ddpo import DDPOConfig, draw_prompts
    from align.flow_sampling import gaussian_log_prob, sample_flow_with_logprob, sde_step
    from align.pipeline import add_lora, decode_latents, encode_prompts, load_pipeline
    from align.testbed.scene import sample_captions
    from align.training import load_prompt_list

    build = load_build_script()
    g = torch.Generator().manual_seed(args.seed)
    pipe = load_pipeline("testbed")
    unet, vae = pipe.unet, pipe.vae
    pipe.text_encoder.requires_grad_(False)
    vae.requires_grad_(False)

    # 1. data, as the flow testbed's build
    eval_captions = sample_captions(args.eval_captions, seed=build.EVAL_CAPTION_SEED + args.seed)
    held_out = set(eval_captions)
    captions = [c for c in sample_captions(2 * args.num_scenes, seed=args.seed) if c not in held_out][: args.num_scenes]
    images = build.render_scenes(captions, seed=args.seed)
    captions = build.swap_captions(captions, 0.25, g)
    with torch.no_grad():
        posterior = [vae.encode(images[i : i + 256]).latent_dist for i in range(0, len(images), 256)]
    scale = vae.config.scaling_factor
    latent_mean = torch.cat([p.mean for p in posterior]) * scale
    latent_std = torch.cat([p.std for p in posterior]) * scale
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
    unet.eval()
    unet.requires_grad_(False)
    print(f"[probe] {step} velocity steps in {(time.time() - start) / 60:.1f} min", flush=True)

    # 3. held-out score with the flow testbed's sampler
    judge = rewards.load("shapes-oracle")
    negative = encode_prompts(pipe, [""])
    shape = tuple(latent_mean.shape[1:])
    scores = []
    with torch.no_grad():
        for i in range(0, len(eval_captions), 50):
            chunk = eval_captions[i : i + 50]
            x = torch.randn((len(chunk), *shape), generator=torch.Generator().manual_seed(args.seed + i))
            embeds = encode_prompts(pipe, chunk)
            sigmas = torch.linspace(1, 0, 21)
            for s, s_next in zip(sigmas[:-1], sigmas[1:]):
                x = x + velocity(unet, x, s, embeds, negative, 3.0) * (s_next - s)
            scores.append(judge.score(chunk, decode_latents(pipe, x)))
    scores = torch.cat(scores).double()
    print(f"[probe] held-out oracle {scores.mean():.4f} ± {scores.std() / len(scores) ** 0.5:.4f} "
          f"({len(scores)} captions, 20 Euler steps, guidance 3)", flush=True)

    # 4. Flow-GRPO's gradient signal
    add_lora(unet, rank=8)
    params = [p for p in unet.parameters() if p.requires_grad]
    prompts = load_prompt_list("testbed:256")
    config = DDPOConfig(prompts="-", sample_batch_size=args.samples, images_per_prompt=8)
    sigmas, window = torch.linspace(1, 0, 11), 5
    estimates = []
    for e in range(args.estimates):
        ge = torch.Generator().manual_seed(args.seed * 1000 + e)
        batch = draw_prompts(prompts, config, ge)
        embeds = encode_prompts(pipe, batch)
        with torch.no_grad():
            trajectory = sample_flow_with_logprob(lambda x, t, e=embeds: velocity(unet, x, t[0] / 1000, e, negative, 3.0),
                                                  torch.randn((len(batch), *shape), generator=ge), sigmas, (0, window),
                                                  0.7, generator=ge)
            rewards_ = judge.score(batch, decode_latents(pipe, trajectory.final_latents)).double().numpy()
        advantages = torch.as_tensor(group_advantages(batch, rewards_), dtype=torch.float32)
        unet.zero_grad(set_to_none=True)
        loss = 0
        for j in range(window):
            x, x_next = trajectory.latents[:, j], trajectory.next_latents[:, j]
            v = velocity(unet, x, sigmas[j], embeds, negative, 3.0, detach_uncond=True)
            step_ = sde_step(x, v, sigmas[j], sigmas[j + 1], float(sigmas[1]), 0.7)
            loss = loss - (advantages * gaussian_log_prob(x_next, step_.mean, step_.std)).mean() / window
        loss.backward()
        estimates.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        print(f"[probe] estimate {e}: mean reward {rewards_.mean():.3f}", flush=True)
    cos = torch.tensor([F.cosine_similarity(a, b, dim=0).item() for a, b in itertools.combinations(estimates, 2)])
    se = float(cos.std() / len(cos) ** 0.5) if len(cos) > 1 else float("nan")
    print(f"[probe] Flow-GRPO gradient cosine, first 5 of 10 steps: {cos.mean():+.4f} ± {se:.4f}", flush=True)


if __name__ == "__main__":
    main()

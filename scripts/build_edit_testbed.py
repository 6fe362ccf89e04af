"""Train the editing testbed: a tiny FLUX.1 Kontext pipeline for the shapes editing world, on CPU, within a time budget.

    python scripts/build_edit_testbed.py --out /tmp/edit_testbed --minutes 20
    python scripts/build_edit_testbed.py --out /tmp/et --size test --max-steps 3 --num-edits 64 --eval-prompts 4

Stages (seeded):
1. draw ``--num-edits`` edit prompts of the shapes editing world (rewards.shapes_edit; the held-out prompts of
   ``testbed-edit:<--held-out>:4242`` left out), render each source scene and the scene its instruction asks for;
   ``--edit-noise`` of them keep their target under another instruction on the same source, so the model follows its
   instruction only part of the time (as the other testbeds' caption noise);
2. encode sources and targets with the SD testbed's trained VAE (frozen; 32 px <-> 8 x 8 x 4 latents);
3. train the FluxTransformer2DModel and both text encoders (CLIP, T5) with FLUX.1 Kontext's objective
   (diffusers' train_dreambooth_lora_flux_kontext.py): x_σ = (1 - σ)·x0 + σ·ε with σ uniform, the source image's
   tokens after the noisy ones, regress the velocity ε - x0 on the noisy tokens. The instruction goes through
   ``FluxKontextPipeline.encode_prompt`` and the prediction through the FLUX.1 Kontext family's own ``predict``, so
   training sees what sampling sees; the instruction is dropped with probability ``--instruction-dropout``. Stops
   after ``--minutes`` of this process's CPU time (one thread) or ``--max-steps``;
4. save the EMA weights as a FluxKontextPipeline folder plus ``flow_testbed.json`` (sampling settings);
5. load it back, edit each held-out prompt once and print the mean shapes-edit-oracle score.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL

import rewards
from align.families import family_named
from align.pipeline import generate_images, load_pipeline
from align.testbed import edit_models
from align.testbed.edit_world import (
    EVAL_SEED,
    images_tensor,
    sample_edit_prompts,
    target_scene_image,
    wrong_instruction,
)
from align.testbed.weights import TESTBED_PIPELINE_DIR
from rewards.edit_prompts import load_source, parse_edit_prompt, without_instruction

RESOLUTION = 32
KONTEXT = family_named("FluxKontextPipeline")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=edit_models.EDIT_TESTBED_PIPELINE_DIR)
    p.add_argument("--vae-from", default=str(TESTBED_PIPELINE_DIR), help="SD testbed pipeline folder whose vae/ is reused")
    p.add_argument("--size", default="small", choices=sorted(edit_models.SIZES))
    p.add_argument("--minutes", type=float, default=20.0, help="training budget in CPU minutes of this process")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--num-edits", type=int, default=20000)
    p.add_argument("--held-out", type=int, default=2000, help="testbed-edit:<this>:4242 is left out of training")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--edit-noise", type=float, default=0.2)
    p.add_argument("--instruction-dropout", type=float, default=0.1)
    p.add_argument("--num-inference-steps", type=int, default=20)
    p.add_argument("--guidance-scale", type=float, default=1.0)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=200)
    return p.parse_args(argv)


def log(message: str) -> None:
    print(f"[build_edit_testbed {time.strftime('%H:%M:%S')}] {message}", flush=True)


def training_edits(args, rng: random.Random) -> tuple[list[str], list[str]]:
    """(the prompts trained on, with edit noise; the prompts whose targets are rendered)."""
    held_out = set(sample_edit_prompts(args.held_out, EVAL_SEED))
    pool = sample_edit_prompts(2 * args.num_edits, args.seed)
    prompts = [p for p in pool if p not in held_out][: args.num_edits]
    noisy = [wrong_instruction(p, rng) if rng.random() < args.edit_noise else p for p in prompts]
    return noisy, prompts


@torch.no_grad()
def encode(vae, images, batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std in FLUX's latent scale ((z - shift) * scale; the SD VAE has no shift)."""
    means, stds = [], []
    for i in range(0, len(images), batch_size):
        posterior = vae.encode(images_tensor(images[i : i + batch_size])).latent_dist
        means.append(posterior.mean)
        stds.append(posterior.std)
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
    return (torch.cat(means) - shift) * scale, torch.cat(stds) * scale


class EMA:
    """Exponential moving average of parameters (the decay ramps up so early steps are not frozen in)."""

    def __init__(self, params, max_decay: float):
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]
        self.max_decay = max_decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.max_decay, (1 + step) / (10 + step))
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1.0 - decay)

    @torch.no_grad()
    def swap(self) -> None:
        for s, p in zip(self.shadow, self.params):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)


def kontext_loss(pipe, prompts: list[str], target, source, generator) -> torch.Tensor:
    """FLUX.1 Kontext's rectified-flow loss on a batch, through the pipeline's encoder and the family's predict."""
    instructions = [parse_edit_prompt(p).instruction if parse_edit_prompt(p) else "" for p in prompts]
    prompt_embeds, pooled, _ = pipe.encode_prompt(instructions, None, max_sequence_length=edit_models.MAX_SEQUENCE_LENGTH)
    noise = torch.randn(target.shape, generator=generator)
    timesteps = KONTEXT.draw_training_timesteps(pipe.scheduler, len(target), generator)
    noisy, velocity = KONTEXT.noisy_and_target(pipe.scheduler, target, noise, timesteps)
    cond = {"prompt_embeds": prompt_embeds, "pooled_embeds": pooled, "source_latents": source}
    return F.mse_loss(KONTEXT.predict(pipe.transformer, noisy, timesteps, cond), velocity)


def train(pipe, prompts, target_stats, source_latents, args, generator) -> tuple[EMA, int, float]:
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    ema = EMA(params, args.ema_decay)
    for m in modules:
        m.train()
    mean, std = target_stats
    # the budget is this process's CPU time (one thread): on a shared machine wall-clock minutes buy fewer steps
    budget_s, start, step, running = args.minutes * 60, time.process_time(), 0, 0.0
    while time.process_time() - start < budget_s and (args.max_steps is None or step < args.max_steps):
        idx = torch.randint(0, len(prompts), (args.batch_size,), generator=generator)
        z0 = mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=generator)
        drop = (torch.rand(args.batch_size, generator=generator) < args.instruction_dropout).tolist()
        batch = [without_instruction(prompts[i]) if d else prompts[i] for d, i in zip(drop, idx.tolist())]
        loss = kontext_loss(pipe, batch, z0, source_latents[idx], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        ema.update(step)
        running = loss.item() if step == 0 else 0.98 * running + 0.02 * loss.item()
        step += 1
        if step % args.log_every == 0 or step == 1:
            log(f"step {step} loss {running:.4f} ({time.process_time() - start:.0f} CPU s of {budget_s:.0f} s)")
    for m in modules:
        m.eval()
    return ema, step, time.process_time() - start


def save_pipeline(pipe, out: Path, settings: dict) -> None:
    """Write to a temporary sibling folder, then swap it in (an older pipeline there is removed last)."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    (tmp / edit_models.SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def evaluate(folder: Path, prompts: list[str], seed: int, guidance_scale: float, steps: int) -> dict:
    """Mean shapes-edit-oracle score of one edit per held-out prompt, loaded the way users load it."""
    pipe = load_pipeline(str(folder))
    images = generate_images(pipe, prompts, [seed + i for i in range(len(prompts))], num_inference_steps=steps,
                             guidance_scale=guidance_scale, height=RESOLUTION, width=RESOLUTION, batch_size=50)
    scores = rewards.load("shapes-edit-oracle").score(prompts, images)
    return {"mean_oracle_score": round(scores.mean().item(), 4),
            "standard_error": round((scores.std() / len(scores) ** 0.5).item(), 4) if len(scores) > 1 else None,
            "num_prompts": len(prompts), "guidance_scale": guidance_scale}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)
    prompts, truthful = training_edits(args, rng)
    log(f"rendering {len(prompts)} edits ({sum(p != t for p, t in zip(prompts, truthful))} under another instruction)")
    sources = [load_source(parse_edit_prompt(p).source, RESOLUTION) for p in truthful]
    targets = [target_scene_image(p, RESOLUTION) for p in truthful]
    vae = AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae").eval().requires_grad_(False)
    source_latents, _ = encode(vae, sources)
    target_stats = encode(vae, targets)
    pipe = edit_models.build_pipeline(vae, args.size)
    n_params = {n: sum(p.numel() for p in getattr(pipe, n).parameters()) for n in ("transformer", "text_encoder", "text_encoder_2")}
    log(f"parameters {n_params}; batch {args.batch_size}; budget {args.minutes} min; {args.threads} thread(s)")
    ema, steps, seconds = train(pipe, prompts, target_stats, source_latents, args, generator)
    log(f"trained {steps} steps in {seconds / 60:.1f} min")
    ema.swap()
    settings = {
        "num_inference_steps": args.num_inference_steps, "guidance_scale": args.guidance_scale,
        "resolution": RESOLUTION, "max_sequence_length": edit_models.MAX_SEQUENCE_LENGTH,
        "scheduler": "FlowMatchEulerDiscreteScheduler",
        "build": {"script": "scripts/build_edit_testbed.py", "size": args.size, "seed": args.seed, "threads": args.threads,
                  "num_edits": args.num_edits, "held_out": args.held_out, "batch_size": args.batch_size, "lr": args.lr,
                  "steps": steps, "train_minutes": round(seconds / 60, 2), "edit_noise": args.edit_noise,
                  "instruction_dropout": args.instruction_dropout},
    }
    save_pipeline(pipe, args.out, settings)
    log(f"saved the pipeline to {args.out}")
    if args.eval_prompts:
        held_out = sample_edit_prompts(args.eval_prompts, EVAL_SEED)
        settings["evaluation"] = {**evaluate(args.out, held_out, args.seed, args.guidance_scale, args.num_inference_steps),
                                  "prompt_seed": EVAL_SEED, "generation_seed": args.seed}
        path = args.out / edit_models.SETTINGS_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        log(f"held-out mean shapes-edit-oracle score {settings['evaluation']['mean_oracle_score']} "
            f"± {settings['evaluation']['standard_error']} ({len(held_out)} prompts)")
    return settings


if __name__ == "__main__":
    main()

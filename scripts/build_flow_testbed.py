"""Train the flow-matching shapes testbed: a tiny Stable Diffusion 3 pipeline, on CPU, within a time budget.

    python scripts/build_flow_testbed.py --out /tmp/flow_testbed --minutes 10
    python scripts/build_flow_testbed.py --out /tmp/ft --size test --max-steps 3 --num-scenes 64 --eval-captions 4

Stages (seeded):
1. render ``--num-scenes`` captioned scenes of the shapes world (the held-out evaluation captions
   are left out), with ``--caption-noise`` of them under another scene's caption, as the SD
   testbed does, so the model follows its prompt only part of the time;
2. encode them with the SD testbed's trained VAE (frozen; 32 px <-> 8 x 8 x 4 latents);
3. train the SD3Transformer2DModel and both CLIP text encoders with the rectified-flow objective
   SD3 uses: x_σ = (1 - σ)·x0 + σ·ε, σ logit-normal(0, 1), predict the velocity ε - x0 (MSE); the
   caption is dropped with probability ``--caption-dropout`` so classifier-free guidance works.
   The prompt goes through ``StableDiffusion3Pipeline.encode_prompt`` itself, so training sees
   exactly what sampling sees. Stops after ``--minutes`` of training or ``--max-steps``;
4. save the EMA weights as a StableDiffusion3Pipeline folder (text_encoder_3 / tokenizer_3 None)
   plus ``flow_testbed.json`` (sampling settings, among them ``max_sequence_length``);
5. load it back with ``StableDiffusion3Pipeline.from_pretrained``, generate one image per held-out
   caption and print the mean shapes-oracle score (the SD testbed's is in its testbed.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from transformers import CLIPTextModel

import rewards
from align.testbed import flow_models, models
from align.testbed.scene import render, sample_captions
from align.testbed.tokenizer import build_tokenizer, grammar_words
from align.testbed.weights import TESTBED_PIPELINE_DIR

REPO = Path(__file__).resolve().parents[1]

# The SD testbed's held-out caption stream, so both testbeds are scored on the same captions.
EVAL_CAPTION_SEED = 1_000_003


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="pipeline folder to write")
    p.add_argument("--size", default="small", choices=sorted(flow_models.SIZES), help="transformer size")
    p.add_argument("--minutes", type=float, default=10.0, help="CPU budget of the training loop, in minutes")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps even within the budget")
    p.add_argument("--vae-from", type=Path, default=TESTBED_PIPELINE_DIR,
                   help="SD testbed pipeline folder whose vae/ (and text_encoder/, see --init-text-encoder) is reused")
    p.add_argument("--init-text-encoder", action=argparse.BooleanOptionalAction, default=True,
                   help="start text_encoder from the SD testbed's trained CLIP text encoder (it knows the grammar)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--num-scenes", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument("--caption-noise", type=float, default=0.25, help="share of scenes under another scene's caption")
    p.add_argument("--num-inference-steps", type=int, default=20)
    p.add_argument("--guidance-scale", type=float, default=3.0)
    p.add_argument("--eval-captions", type=int, default=200, help="held-out captions scored at the end (0: none)")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    problems = []
    if not args.minutes > 0:
        problems.append(f"--minutes must be > 0, got {args.minutes}")
    if args.max_steps is not None and args.max_steps < 1:
        problems.append(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.num_scenes < 1 or args.batch_size < 1:
        problems.append("--num-scenes and --batch-size must be >= 1")
    if not (args.vae_from / "vae" / "config.json").is_file():
        problems.append(f"--vae-from {args.vae_from} has no vae/config.json (expected an SD testbed pipeline folder; "
                        "build it with scripts/build_testbed.py)")
    if args.out.exists() and not (args.out / "model_index.json").is_file():
        problems.append(f"--out {args.out} exists and is not a pipeline folder; refusing to replace it")
    if problems:
        p.error("; ".join(problems))
    return args


def log(message: str) -> None:
    print(f"[build_flow_testbed {time.strftime('%H:%M:%S')}] {message}", flush=True)


def render_scenes(captions: list[str], seed: int) -> torch.Tensor:
    """Images in [-1, 1], [N, 3, 32, 32]; scene i is rendered with seed ``seed + i``."""
    arrays = [np.asarray(render(c, seed=seed + i, size=models.IMAGE_SIZE), dtype=np.uint8) for i, c in enumerate(captions)]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def swap_captions(captions: list[str], share: float, generator: torch.Generator) -> list[str]:
    """Give a random ``share`` of the scenes the caption of another scene of that share (web-like noise)."""
    chosen = torch.nonzero(torch.rand(len(captions), generator=generator) < share).flatten()
    shuffled = chosen[torch.randperm(len(chosen), generator=generator)]
    swapped = list(captions)
    for target, source in zip(chosen.tolist(), shuffled.tolist()):
        swapped[target] = captions[source]
    return swapped


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor, batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every image, in the transformer's latent scale (SD3: (z - shift) * scale)."""
    means, stds = [], []
    for i in range(0, len(images), batch_size):
        posterior = vae.encode(images[i : i + batch_size]).latent_dist
        means.append(posterior.mean)
        stds.append(posterior.std)
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0  # SD VAEs have no shift (None)
    return (torch.cat(means) - shift) * scale, torch.cat(stds) * scale


def rectified_flow_loss(transformer, z0, prompt_embeds, pooled, generator) -> torch.Tensor:
    """SD3's objective: x_σ = (1-σ)·z0 + σ·ε with σ ~ logit-normal(0, 1); regress the velocity ε - z0."""
    noise = torch.randn(z0.shape, generator=generator)
    sigma = torch.sigmoid(torch.randn(len(z0), generator=generator)).reshape(-1, 1, 1, 1)
    noisy = (1 - sigma) * z0 + sigma * noise
    velocity = transformer(
        hidden_states=noisy,
        timestep=sigma.flatten() * 1000,  # FlowMatchEulerDiscreteScheduler's timesteps are σ·1000
        encoder_hidden_states=prompt_embeds,
        pooled_projections=pooled,
        return_dict=False,
    )[0]
    return F.mse_loss(velocity, noise - z0)


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
        """Exchange live and averaged weights (call twice to restore)."""
        for s, p in zip(self.shadow, self.params):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)


def train(pipe, latent_mean, latent_std, captions, args, generator) -> tuple[EMA, int, float]:
    """Train transformer + both text encoders until the budget or --max-steps; returns (EMA, steps, seconds)."""
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    ema = EMA(params, args.ema_decay)
    for m in modules:
        m.train()
    budget_s, start, step, running = args.minutes * 60, time.time(), 0, 0.0
    while time.time() - start < budget_s and (args.max_steps is None or step < args.max_steps):
        idx = torch.randint(0, len(captions), (args.batch_size,), generator=generator)
        z0 = latent_mean[idx] + latent_std[idx] * torch.randn(latent_mean[idx].shape, generator=generator)
        drop = (torch.rand(args.batch_size, generator=generator) < args.caption_dropout).tolist()
        prompts = ["" if d else captions[i] for d, i in zip(drop, idx.tolist())]
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=flow_models.MAX_SEQUENCE_LENGTH
        )
        loss = rectified_flow_loss(pipe.transformer, z0, prompt_embeds, pooled, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        ema.update(step)
        running = loss.item() if step == 0 else 0.98 * running + 0.02 * loss.item()
        step += 1
        if step % args.log_every == 0 or step == 1:
            log(f"step {step} loss {running:.4f} ({time.time() - start:.0f} s of {budget_s:.0f} s)")
    for m in modules:
        m.eval()
    return ema, step, time.time() - start


def save_pipeline(pipe, out: Path, settings: dict) -> None:
    """Write to a temporary sibling folder, then swap it in (an older pipeline there is removed last)."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    (tmp / flow_models.FLOW_SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def sampling_kwargs(settings: dict) -> dict:
    """What a StableDiffusion3Pipeline call needs to sample as the testbed was trained."""
    return dict(
        num_inference_steps=settings["num_inference_steps"],
        guidance_scale=settings["guidance_scale"],
        height=settings["resolution"],
        width=settings["resolution"],
        max_sequence_length=settings["max_sequence_length"],
    )


@torch.no_grad()
def evaluate(folder: Path, captions: list[str], seed: int, batch_size: int = 50) -> dict:
    """Mean shapes-oracle score of one image per held-out caption, loaded the way users load it."""
    settings = json.loads((folder / flow_models.FLOW_SETTINGS_FILE).read_text(encoding="utf-8"))
    pipe = flow_models.load_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    oracle = rewards.load("shapes-oracle")
    scores = []
    for i in range(0, len(captions), batch_size):
        chunk = captions[i : i + batch_size]
        generators = [torch.Generator().manual_seed(seed + i + j) for j in range(len(chunk))]
        images = pipe(chunk, generator=generators, **sampling_kwargs(settings)).images
        scores.append(torch.as_tensor(oracle.score(chunk, images), dtype=torch.float32))
    scores = torch.cat(scores)
    return {
        "mean_oracle_score": round(scores.mean().item(), 4),
        "standard_error": round((scores.std() / len(scores) ** 0.5).item(), 4) if len(scores) > 1 else None,
        "num_captions": len(captions),
    }


def load_parts(args, tokenizer):
    """The SD testbed's VAE (frozen) and, if asked, its text encoder's weights for text_encoder."""
    vae = AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae").eval().requires_grad_(False)
    text_encoders = flow_models.build_text_encoders(tokenizer)
    if args.init_text_encoder:
        trained = CLIPTextModel.from_pretrained(args.vae_from, subfolder="text_encoder")
        # transformers 5's CLIPTextModel holds the text transformer's parts directly (4.x: under .text_model).
        source = getattr(trained, "text_model", trained)
        text_encoders[0].text_model.load_state_dict(source.state_dict())
    return vae, text_encoders


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    t0 = time.time()

    eval_captions = sample_captions(args.eval_captions, seed=EVAL_CAPTION_SEED + args.seed)
    held_out = set(eval_captions)
    pool = sample_captions(2 * args.num_scenes, seed=args.seed)
    captions = [c for c in pool if c not in held_out][: args.num_scenes]
    log(f"rendering {len(captions)} scenes ({len(set(captions))} distinct captions, {len(held_out)} held out)")
    images = render_scenes(captions, seed=args.seed)
    training_captions = swap_captions(captions, args.caption_noise, generator) if args.caption_noise else captions

    tokenizer = build_tokenizer(grammar_words())
    vae, text_encoders = load_parts(args, tokenizer)
    pipe = flow_models.build_pipeline(tokenizer, vae, text_encoders=text_encoders, size=args.size)
    latent_mean, latent_std = encode_latents(pipe.vae, images)
    n_params = {name: sum(p.numel() for p in getattr(pipe, name).parameters())
                for name in ("transformer", "text_encoder", "text_encoder_2")}
    log(f"parameters {n_params}; batch {args.batch_size}; budget {args.minutes} min; {args.threads} thread(s)")

    ema, steps, seconds = train(pipe, latent_mean, latent_std, training_captions, args, generator)
    log(f"trained {steps} steps in {seconds / 60:.1f} min")
    ema.swap()  # save the averaged weights
    settings = {
        "num_inference_steps": args.num_inference_steps,
        "guidance_scale": args.guidance_scale,
        "resolution": models.IMAGE_SIZE,
        "max_sequence_length": flow_models.MAX_SEQUENCE_LENGTH,
        "scheduler": "FlowMatchEulerDiscreteScheduler",
        "build": {
            "script": "scripts/build_flow_testbed.py", "size": args.size, "seed": args.seed, "threads": args.threads,
            "num_scenes": args.num_scenes, "batch_size": args.batch_size, "lr": args.lr, "steps": steps,
            "train_minutes": round(seconds / 60, 2), "caption_dropout": args.caption_dropout,
            "caption_noise": args.caption_noise, "init_text_encoder": args.init_text_encoder,
        },
    }
    save_pipeline(pipe, args.out, settings)
    log(f"saved the pipeline to {args.out}")
    if eval_captions:
        settings["evaluation"] = {**evaluate(args.out, eval_captions, seed=args.seed),
                                  "caption_seed": EVAL_CAPTION_SEED + args.seed, "generation_seed": args.seed}
        path = args.out / flow_models.FLOW_SETTINGS_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        log(f"held-out mean shapes-oracle score {settings['evaluation']['mean_oracle_score']} "
            f"(± {settings['evaluation']['standard_error']}) on {len(eval_captions)} captions")
    log(f"done in {(time.time() - t0) / 60:.1f} min")
    return settings


if __name__ == "__main__":
    main()

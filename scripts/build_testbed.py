"""Train the bundled shapes-testbed base model: a tiny Stable Diffusion pipeline, on CPU.

    python scripts/build_testbed.py                       # writes align/testbed/weights/pipeline
    python scripts/build_testbed.py --vae-steps 5 --unet-steps 5 --num-scenes 500 --eval-captions 8 --out /tmp/tb/pipeline

The bundled weights came from the defaults (a rerun reproduced them byte for byte): 36-38 min wall with 1 thread on a 2-core
machine; 7.5 MB of fp32 safetensors; the held-out mean oracle score is recorded in testbed.json.

Stages (all seeded; torch deterministic algorithms on):
1. render ``--num-scenes`` captioned scenes of the shapes world (captions of the held-out
   evaluation set are left out of training);
2. train the AutoencoderKL: 32 px images <-> 8x8x4 latents, MSE reconstruction + a small KL term;
   then set the VAE's ``scaling_factor`` to 1/std of the latents, as Stable Diffusion does;
3. train the UNet2DConditionModel and the CLIPTextModel together with the standard
   epsilon-prediction loss; the caption is dropped (replaced by "") with probability
   ``--caption-dropout`` so that classifier-free guidance works, and ``--caption-noise`` of the
   scenes carry another scene's caption (as scraped web pairs do);
4. save a plain diffusers StableDiffusionPipeline (no safety checker, safetensors) and a
   ``testbed.json`` holding the default inference settings;
5. load the folder back with ``StableDiffusionPipeline.from_pretrained``, generate one image
   per held-out caption and print the mean shapes-oracle score.

The model is meant to be imperfect (mean oracle score 0.3-0.7) so alignment has room to show, and
imperfect in the way real text-to-image models are: it renders shapes and colours well but, having
seen a quarter of its training scenes under another scene's caption, it ignores the prompt for a
share of the seeds. That error varies from seed to seed, so a judge can tell a caption's good
samples from its bad ones and a trainer can learn from the difference. (An earlier build without
caption noise, 2,500 UNet steps, scored 0.49 but its errors were under-fitting shared by every seed
of a caption, and neither DPO nor DDPO moved it by more than 0.03.) The learning rate is constant
after warm-up, so ``--snapshot-steps 2500,4000 --snapshot-dir /tmp/snaps`` scores intermediate
models that are exactly what ``--unet-steps 2500`` / ``4000`` would produce. Calibration (held-out
mean oracle score at guidance 4): caption noise 0.25: 2500 steps 0.41, 4000 0.58, 6000 0.70;
caption noise 0.5: 0.28, 0.37, 0.43.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import StableDiffusionPipeline

import rewards
from align.testbed import models
from align.testbed.scene import render, sample_captions
from align.testbed.tokenizer import build_tokenizer, grammar_words, save_tokenizer
from align.testbed.weights import TESTBED_PIPELINE_DIR, TESTBED_SETTINGS_FILE
from rewards.shapes_grammar import parse_caption

REPO = Path(__file__).resolve().parents[1]

# Seeds of the disjoint caption streams (training scenes vs the held-out evaluation captions).
EVAL_CAPTION_SEED = 1_000_003


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=TESTBED_PIPELINE_DIR, help="pipeline folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (the bundled weights were built with 1: the same count reproduces them "
                        "exactly, and on a shared machine 1 thread is faster than 2 fighting for cores)")
    p.add_argument("--num-scenes", type=int, default=20000, help="rendered training scenes")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--vae-steps", type=int, default=600)
    p.add_argument("--vae-lr", type=float, default=1e-3)
    p.add_argument("--kl-weight", type=float, default=1e-5, help="weight of the KL term (per latent element)")
    p.add_argument("--unet-steps", type=int, default=6000)
    p.add_argument("--unet-lr", type=float, default=6e-4)
    p.add_argument("--ema-decay", type=float, default=0.999, help="EMA of the UNet + text encoder (what is saved)")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--caption-dropout", type=float, default=0.1, help="probability of training on the empty caption")
    p.add_argument("--caption-noise", type=float, default=0.25,
                   help="share of training scenes whose caption is swapped with another scene's (web-style "
                        "mismatched pairs: the model learns to ignore the prompt that often)")
    p.add_argument("--num-inference-steps", type=int, default=20, help="default DDIM steps stored in testbed.json")
    p.add_argument("--guidance-scale", type=float, default=3.0, help="default CFG scale stored in testbed.json")
    p.add_argument("--eval-captions", type=int, default=200, help="held-out captions scored by the oracle (0: skip)")
    p.add_argument("--fp16", action="store_true", help="store weights in float16 (load with torch_dtype=torch.float32)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--snapshot-steps", type=str, default="",
                   help="comma-separated UNet step counts at which to save and score a snapshot (calibration)")
    p.add_argument("--snapshot-dir", type=Path, default=None, help="where snapshots go (needed for --snapshot-steps)")
    args = p.parse_args(argv)
    for name in ("num_scenes", "batch_size", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("vae_steps", "unet_steps", "eval_captions", "warmup_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    try:
        args.snapshot_steps = sorted({int(x) for x in args.snapshot_steps.split(",") if x.strip()})
    except ValueError:
        p.error(f"--snapshot-steps must be comma-separated integers, got {args.snapshot_steps!r}")
    if args.snapshot_steps and args.snapshot_dir is None:
        p.error("--snapshot-steps needs --snapshot-dir (snapshots never go into the package)")
    if not 0.0 <= args.caption_dropout < 1.0:
        p.error(f"--caption-dropout must be in [0, 1), got {args.caption_dropout}")
    if not 0.0 <= args.caption_noise < 1.0:
        p.error(f"--caption-noise must be in [0, 1), got {args.caption_noise}")
    if args.num_inference_steps < 1 or args.guidance_scale < 1.0:
        p.error("--num-inference-steps must be >= 1 and --guidance-scale >= 1")
    return args


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def set_determinism(seed: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)


def render_scenes(captions: list[str], seed: int) -> torch.Tensor:
    """uint8 [N, 3, 32, 32]; scene i is rendered with seed ``seed + i``."""
    arrays = [np.asarray(render(c, seed=seed + i, size=models.IMAGE_SIZE), dtype=np.uint8) for i, c in enumerate(captions)]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def swap_captions(captions: list[str], share: float, generator: torch.Generator) -> list[str]:
    """Pair a random ``share`` of the scenes with another scene of that share's caption.

    The images stay as rendered, so about ``share`` of the (caption, image) pairs disagree, as in
    scraped web data. A model trained on them follows its prompt only part of the time: the
    imperfection alignment is meant to fix, drawn afresh with every seed rather than fixed per caption.
    """
    chosen = torch.nonzero(torch.rand(len(captions), generator=generator) < share).flatten()
    shuffled = chosen[torch.randperm(len(chosen), generator=generator)]
    swapped = list(captions)
    for target, source in zip(chosen.tolist(), shuffled.tolist()):
        swapped[target] = captions[source]
    return swapped


def to_model_range(images_uint8: torch.Tensor) -> torch.Tensor:
    return images_uint8.float() / 127.5 - 1.0


def warmup_lr(step: int, warmup: int) -> float:
    """Linear warm-up, then constant (a multiplier for the base lr).

    No decay on purpose: a run with ``--unet-steps K`` then equals the first K steps of any
    longer run, so the step count can be calibrated from the snapshots of one run.
    """
    return min(1.0, (step + 1) / max(1, warmup))


class EMA:
    """Exponential moving average of parameters; the decay ramps up, so early steps are not frozen in."""
    def __init__(self, modules, max_decay: float):
        self.params = [p for m in modules for p in m.parameters()]
        self.shadow = [p.detach().clone() for p in self.params]
        self.max_decay = max_decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.max_decay, (1 + step) / (10 + step))
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach(), 1.0 - decay)

    @torch.no_grad()
    def copy_to(self, modules) -> None:
        targets = [p for m in modules for p in m.parameters()]
        for s, p in zip(self.shadow, targets):
            p.copy_(s)


def train_vae(vae, images: torch.Tensor, args, generator: torch.Generator) -> None:
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_lr(s, args.warmup_steps))
    vae.train()
    start = time.time()
    for step in range(args.vae_steps):
        idx = torch.randint(0, len(images), (args.batch_size,), generator=generator)
        x = to_model_range(images[idx])
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(z).sample
        mse = F.mse_loss(recon, x)
        # KL(q || N(0, I)) per latent element: keeps the latent space smooth for diffusion.
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        loss = mse + args.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % args.log_every == 0 or step == args.vae_steps - 1:
            eta = (time.time() - start) / (step + 1) * (args.vae_steps - step - 1)
            log(f"vae step {step + 1}/{args.vae_steps} mse {mse.item():.5f} kl {kl.item():.2f} eta {eta / 60:.1f} min")
    vae.eval()


@torch.no_grad()
def encode_latents(vae, images: torch.Tensor, batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and std of every training image (unscaled)."""
    means, stds = [], []
    for i in range(0, len(images), batch_size):
        posterior = vae.encode(to_model_range(images[i : i + batch_size])).latent_dist
        means.append(posterior.mean)
        stds.append(posterior.std)
    return torch.cat(means), torch.cat(stds)


def epsilon_loss(unet, scheduler, z0: torch.Tensor, hidden: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The standard denoising loss: noise ``z0`` to a random timestep, predict the noise (draws noise, then timesteps)."""
    noise = torch.randn(z0.shape, generator=generator)
    t = torch.randint(0, scheduler.config.num_train_timesteps, (len(z0),), generator=generator)
    pred = unet(scheduler.add_noise(z0, noise, t), t, encoder_hidden_states=hidden).sample
    return F.mse_loss(pred, noise)


def train_unet(unet, text_encoder, tokenizer, scheduler, latent_mean, latent_std, captions, args, generator,
               on_snapshot=None) -> EMA:
    """Epsilon-prediction training; ``latent_mean`` / ``latent_std`` are already multiplied by the VAE
    scaling factor. Returns the EMA of the UNet + text-encoder weights; ``on_snapshot(step, ema)``
    runs after each step listed in ``args.snapshot_steps``."""
    params = list(unet.parameters()) + list(text_encoder.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_lr(s, args.warmup_steps))
    ema = EMA([unet, text_encoder], args.ema_decay)
    # Tokenize every distinct caption once (and the empty caption used for dropout).
    distinct = sorted(set(captions)) + [""]
    row_of = {c: i for i, c in enumerate(distinct)}
    token_ids = tokenizer(
        distinct, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids
    caption_rows = torch.tensor([row_of[c] for c in captions])
    empty_row = row_of[""]
    unet.train()
    text_encoder.train()
    start, running = time.time(), 0.0
    for step in range(args.unet_steps):
        idx = torch.randint(0, len(captions), (args.batch_size,), generator=generator)
        z0 = latent_mean[idx] + latent_std[idx] * torch.randn(latent_mean[idx].shape, generator=generator)
        rows = caption_rows[idx].clone()
        drop = torch.rand(args.batch_size, generator=generator) < args.caption_dropout
        rows[drop] = empty_row
        loss = epsilon_loss(unet, scheduler, z0, text_encoder(token_ids[rows])[0], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        ema.update(step)
        running = loss.item() if step == 0 else 0.98 * running + 0.02 * loss.item()
        if step % args.log_every == 0 or step == args.unet_steps - 1:
            eta = (time.time() - start) / (step + 1) * (args.unet_steps - step - 1)
            log(f"unet step {step + 1}/{args.unet_steps} loss {running:.4f} eta {eta / 60:.1f} min")
        if on_snapshot is not None and step + 1 in args.snapshot_steps and step + 1 < args.unet_steps:
            on_snapshot(step + 1, ema)
    unet.eval()
    text_encoder.eval()
    return ema


def folder_size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def save_pipeline(pipe, out: Path, settings: dict, fp16: bool) -> None:
    """Write the pipeline to a temporary sibling folder, then swap it in (the old one is removed last)."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if fp16:
        pipe.to(torch.float16)
    pipe.save_pretrained(tmp, safe_serialization=True)
    if fp16:
        pipe.to(torch.float32)
    # The plain BPE files (vocab.json + merges.txt) beside transformers' tokenizer.json.
    save_tokenizer(tmp / "tokenizer", grammar_words())
    (tmp / TESTBED_SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@torch.no_grad()
def evaluate(folder: Path, captions: list[str], settings: dict, seed: int, batch_size: int = 50) -> dict:
    """Mean shapes-oracle score of one generation per held-out caption, loaded the way users load it."""
    pipe = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    oracle = rewards.load("shapes-oracle")
    scores = []
    for i in range(0, len(captions), batch_size):
        chunk = captions[i : i + batch_size]
        generators = [torch.Generator().manual_seed(seed + i + j) for j in range(len(chunk))]
        images = pipe(
            chunk,
            num_inference_steps=settings["num_inference_steps"],
            guidance_scale=settings["guidance_scale"],
            height=settings["resolution"],
            width=settings["resolution"],
            generator=generators,
        ).images
        scores.append(torch.as_tensor(oracle.score(chunk, images), dtype=torch.float32))
    scores = torch.cat(scores)

    by_category: dict[str, list[float]] = {}
    for caption, score in zip(captions, scores.tolist()):
        by_category.setdefault(parse_caption(caption).category, []).append(score)
    return {
        "mean_oracle_score": round(scores.mean().item(), 4),
        "num_captions": len(captions),
        "by_category": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_category.items())},
    }


def build_settings(args, unet_steps: int, train_minutes: float) -> dict:
    return {
        "num_inference_steps": args.num_inference_steps,
        "guidance_scale": args.guidance_scale,
        "resolution": models.IMAGE_SIZE,
        "scheduler": "DDIMScheduler",
        "build": {
            "script": "scripts/build_testbed.py",
            "seed": args.seed,
            "threads": args.threads,
            "num_scenes": args.num_scenes,
            "batch_size": args.batch_size,
            "vae_steps": args.vae_steps,
            "unet_steps": unet_steps,
            "unet_lr": args.unet_lr,
            "ema_decay": args.ema_decay,
            "caption_dropout": args.caption_dropout,
            "caption_noise": args.caption_noise,
            "train_minutes": round(train_minutes, 1),
        },
    }


def save_and_evaluate(out: Path, tokenizer, vae, unet, text_encoder, ema, settings, eval_captions, args) -> None:
    """Save the EMA weights as a pipeline folder, then score it the way a user would load it."""
    unet_ema, text_encoder_ema = copy.deepcopy(unet).eval(), copy.deepcopy(text_encoder).eval()
    ema.copy_to([unet_ema, text_encoder_ema])
    pipe = models.build_pipeline(tokenizer, vae=vae, unet=unet_ema, text_encoder=text_encoder_ema)
    save_pipeline(pipe, out, settings, args.fp16)
    log(f"saved the pipeline ({settings['build']['unet_steps']} UNet steps) to {out} ({folder_size_mb(out):.1f} MB)")
    if not eval_captions:
        return
    result = evaluate(out, eval_captions, settings, seed=args.seed)
    settings["evaluation"] = {**result, "caption_seed": EVAL_CAPTION_SEED + args.seed, "generation_seed": args.seed}
    path = out / TESTBED_SETTINGS_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    log(f"mean shapes-oracle score after {settings['build']['unet_steps']} UNet steps on {len(eval_captions)} "
        f"held-out captions: {result['mean_oracle_score']:.4f} by category {result['by_category']}")


def main(argv=None) -> None:
    args = parse_args(argv)
    set_determinism(args.seed, args.threads)
    t0 = time.time()
    generator = torch.Generator().manual_seed(args.seed)

    eval_captions = sample_captions(args.eval_captions, seed=EVAL_CAPTION_SEED + args.seed)
    held_out = set(eval_captions)
    # Draw extra captions so that --num-scenes remain after leaving out the held-out ones.
    pool = sample_captions(2 * args.num_scenes, seed=args.seed)
    captions = [c for c in pool if c not in held_out][: args.num_scenes]
    log(f"rendering {len(captions)} scenes ({len(set(captions))} distinct captions, {len(held_out)} held out)")
    images = render_scenes(captions, seed=args.seed)
    training_captions = captions
    if args.caption_noise:  # no draw at 0, so the generator's stream matches builds made before this option
        training_captions = swap_captions(captions, args.caption_noise, generator)
        mismatched = sum(a != b for a, b in zip(captions, training_captions))
        log(f"caption noise: {mismatched} of {len(captions)} scenes carry another scene's caption")

    tokenizer = build_tokenizer(grammar_words())
    vae = models.build_vae()
    unet = models.build_unet()
    text_encoder = models.build_text_encoder(tokenizer)
    scheduler = models.build_scheduler()
    n_params = {name: sum(p.numel() for p in m.parameters()) for name, m in
                [("vae", vae), ("unet", unet), ("text_encoder", text_encoder)]}
    log(f"parameters: {n_params}; batch size {args.batch_size}; {args.threads} thread(s)")

    log(f"training the VAE for {args.vae_steps} steps")
    train_vae(vae, images, args, generator)
    latent_mean, latent_std = encode_latents(vae, images)
    sample = latent_mean + latent_std * torch.randn(latent_mean.shape, generator=generator)
    scaling_factor = float(1.0 / sample.std())
    vae.register_to_config(scaling_factor=scaling_factor)
    with torch.no_grad():
        recon = vae.decode(latent_mean[:256]).sample
        recon_mse = F.mse_loss(recon, to_model_range(images[:256])).item()
    log(f"VAE reconstruction MSE (range [-1, 1]) {recon_mse:.5f}; latent scaling factor {scaling_factor:.4f}")

    def on_snapshot(step: int, ema: EMA) -> None:
        folder = args.snapshot_dir / f"unet_steps_{step}"
        settings = build_settings(args, step, (time.time() - t0) / 60)
        save_and_evaluate(folder, tokenizer, vae, unet, text_encoder, ema, settings, eval_captions, args)

    log(f"training the UNet + text encoder for {args.unet_steps} steps")
    ema = train_unet(unet, text_encoder, tokenizer, scheduler, latent_mean * scaling_factor,
                     latent_std * scaling_factor, training_captions, args, generator,
                     on_snapshot=on_snapshot if args.snapshot_dir is not None else None)
    settings = build_settings(args, args.unet_steps, (time.time() - t0) / 60)
    log(f"training took {settings['build']['train_minutes']:.1f} min")
    save_and_evaluate(args.out, tokenizer, vae, unet, text_encoder, ema, settings, eval_captions, args)
    log(f"done in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()

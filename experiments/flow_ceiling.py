"""What the flow testbed reaches in a CPU budget when taught with perfect data: the yardstick for flow DPO and Flow-GRPO.

    python -m experiments.flow_ceiling --out runs/flow-ceiling                   # LoRA r8 on the transformer
    python -m experiments.flow_ceiling --out runs/flow-ceiling-full --finetune full

Fine-tunes the flow testbed (``--model``, default the bundled ``testbed-flow``) with the rectified-flow
loss it was built with (scripts/build_flow_testbed.py: x_σ = (1-σ)·z0 + σ·ε, σ logit-normal, velocity
target) on freshly rendered scenes of training-part captions (align/testbed/split.py) whose captions are all true (the base saw a quarter of its scenes
under another scene's caption), for ``--minutes`` of training CPU time (process time, one thread; the
transformer only, both text encoders frozen, as the trainers keep them), and scores it on the
trainers' held-out set (``--eval-prompts``, default DDPO's ``testbed-heldout:200:1000`` (unseen captions), ``--eval-seed`` 1234,
4 seeds per caption, the testbed's sampling settings, the trainers'
``align.pipeline.generate_images``) before, every ``--eval-every`` minutes and at
the end. Rendering, encoding and evaluations are not counted in the budget.

The gain is reported with its paired standard error: every image after training has the same caption
and seed as one before, so the error is that of the per-image differences (and, more conservatively,
clustered by caption, since a caption's seeds are not independent). Training captions come from the split's
training part, so none is a held-out one.

Differences from experiments/testbed_sft_ceiling.py (the SD testbed's): the flow objective instead of
epsilon prediction; LoRA targets the SD3 attention's image and text projections, the default of
diffusers' train_dreambooth_lora_sd3.py.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import rewards
from align.data.prompt_sets import load_prompt_list
from align.metrics import paired_change
from align.pipeline import add_lora, generate_images, load_pipeline, merged_adapter, testbed_settings
from align.run_folder import atomic_write_text
from align.testbed.split import sample_split_captions
from scripts.build_flow_testbed import encode_latents, rectified_flow_loss, render_scenes

REPO = Path(__file__).resolve().parents[1]

# diffusers' train_dreambooth_lora_sd3.py default --lora_layers: both streams of every joint attention.
SD3_LORA_TARGETS = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/flow-ceiling"), help="folder for the evaluations")
    p.add_argument("--model", default="testbed-flow", help="flow testbed pipeline folder, or 'testbed-flow'")
    p.add_argument("--minutes", type=float, default=15.0, help="training CPU minutes (process time, one thread)")
    p.add_argument("--eval-every", type=float, default=5.0, help="CPU minutes between held-out evaluations")
    p.add_argument("--finetune", choices=["lora", "full"], default="lora")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 for LoRA, 1e-4 for full")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-scenes", type=int, default=8192, help="rendered training scenes (true captions)")
    p.add_argument("--caption-dropout", type=float, default=0.1, help="keeps classifier-free guidance working")
    p.add_argument("--eval-prompts", default="testbed-heldout:200:1000", help="unseen captions (the online-RL configs'; DPO's: testbed-heldout:200:777)")
    p.add_argument("--eval-images-per-prompt", type=int, default=4)
    p.add_argument("--eval-seed", type=int, default=1234, help="seed of the first held-out image (the trainers' default)")
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.eval_every <= 0:
        p.error("--minutes and --eval-every must be positive")
    if args.num_scenes < 1 or args.batch_size < 1 or args.eval_images_per_prompt < 1 or args.lora_rank < 1:
        p.error("--num-scenes, --batch-size, --eval-images-per-prompt and --lora-rank must be at least 1")
    if args.out.exists() and any(args.out.iterdir()):
        p.error(f"--out {args.out} is not empty; choose another folder (its results are kept)")
    return args


def paired_gain(before: list[float], after: list[float], prompts: list[str]) -> dict:
    """Mean of after - before and its paired standard error, per image and clustered by caption (a caption's
    seeds share its difficulty, and a caption that repeats in the set is one cluster)."""
    change = paired_change(before, after, prompts)
    return {"gain": change.mean, "paired_sem_images": change.sem_images, "paired_sem_captions": change.sem_prompts,
            "num_images": change.images, "num_captions": change.prompts}


def held_out_set(spec: str, repeats: int, first_seed: int) -> tuple[list[str], list[int]]:
    """The trainers' layout: the prompt list repeated ``repeats`` times, image i seeded ``first_seed + i``."""
    prompts = load_prompt_list(spec) * repeats
    return prompts, [first_seed + i for i in range(len(prompts))]


def render_training_scenes(n: int, held_out: set[str], seed: int) -> tuple[list[str], torch.Tensor]:
    """``n`` true (caption, image) pairs on training-part captions (align/testbed/split.py), none held out; images in [-1, 1]."""
    pool = sample_split_captions(2 * n, 10_000 + seed, "train")  # training-part captions, a stream of their own
    captions = [c for c in pool if c not in held_out][:n]
    return captions, render_scenes(captions, seed=seed)


@torch.no_grad()
def encode_captions(pipe, captions: list[str], max_sequence_length: int, batch_size: int = 256):
    """(prompt_embeds, pooled) of each caption, through the pipeline's own encode_prompt (frozen encoders)."""
    embeds, pooled = [], []
    for start in range(0, len(captions), batch_size):
        e, _, p, _ = pipe.encode_prompt(captions[start : start + batch_size], None, None,
                                        do_classifier_free_guidance=False, max_sequence_length=max_sequence_length)
        embeds.append(e)
        pooled.append(p)
    return torch.cat(embeds), torch.cat(pooled)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    settings = testbed_settings(args.model)
    if "max_sequence_length" not in settings:
        raise SystemExit(f"--model {args.model!r} has no flow_testbed.json: give a flow testbed folder or 'testbed-flow'")
    pipe = load_pipeline(args.model)  # through the model family, as the trainers load it
    for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        module.requires_grad_(False).eval()
    transformer = pipe.transformer
    if args.finetune == "lora":
        add_lora(transformer, rank=args.lora_rank, target_modules=SD3_LORA_TARGETS)
    params = [p for p in transformer.parameters() if p.requires_grad]
    lr = args.lr if args.lr is not None else (1e-3 if args.finetune == "lora" else 1e-4)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    judge = rewards.load("shapes-oracle")
    prompts, seeds = held_out_set(args.eval_prompts, args.eval_images_per_prompt, args.eval_seed)
    args.out.mkdir(parents=True, exist_ok=True)

    captions, images = render_training_scenes(args.num_scenes, set(prompts), args.seed)
    latent_mean, latent_std = encode_latents(pipe.vae, images)
    distinct = sorted(set(captions)) + [""]  # the last row: the empty caption (caption dropout)
    row_of = {c: i for i, c in enumerate(distinct)}
    embeds, pooled = encode_captions(pipe, distinct, settings["max_sequence_length"])
    caption_rows = torch.tensor([row_of[c] for c in captions])
    print(f"[flow-ceiling] {len(captions)} true scenes ({len(distinct) - 1} distinct captions); {args.finetune}, "
          f"{sum(p.numel() for p in params):,} trained parameters, lr {lr}", flush=True)

    curve, scores_before = [], None

    def evaluate(label: str, minutes: float, step: int) -> None:
        nonlocal scores_before
        transformer.eval()
        with merged_adapter(transformer):  # LoRA folded in: the same images up to rounding, faster
            # the trainers' generation (align.pipeline.generate_images): the same images for the same seeds
            generated = generate_images(pipe, prompts, seeds, num_inference_steps=settings["num_inference_steps"],
                                        guidance_scale=settings["guidance_scale"], batch_size=args.eval_batch_size)
        transformer.train()
        scores = judge.score(prompts, generated).float().tolist()
        scores_before = scores if scores_before is None else scores_before
        point = {"cpu_minutes": round(minutes, 2), "step": step, "mean_oracle_score": sum(scores) / len(scores),
                 **paired_gain(scores_before, scores, prompts)}
        curve.append(point)
        atomic_write_text(args.out / f"eval_{label}.json",
                          json.dumps({"mean": point["mean_oracle_score"], "scores": scores, "prompts": prompts,
                                      "seeds": seeds}))
        atomic_write_text(args.out / "curve.json", json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                               "base_settings": settings, "curve": curve}, indent=2))
        print(f"[flow-ceiling] {label}: mean oracle {point['mean_oracle_score']:.4f}, gain {point['gain']:+.4f} "
              f"± {point['paired_sem_images']:.4f} (paired SE, images) ± {point['paired_sem_captions']:.4f} "
              f"(clustered by caption)", flush=True)

    evaluate("before", 0.0, 0)
    generator = torch.Generator().manual_seed(args.seed)
    transformer.train()
    spent, step, next_eval = 0.0, 0, args.eval_every
    while spent < args.minutes * 60:
        start = time.process_time()
        idx = torch.randint(0, len(captions), (args.batch_size,), generator=generator)
        rows = caption_rows[idx].clone()
        rows[torch.rand(args.batch_size, generator=generator) < args.caption_dropout] = len(distinct) - 1
        z0 = latent_mean[idx] + latent_std[idx] * torch.randn(latent_mean[idx].shape, generator=generator)
        loss = rectified_flow_loss(transformer, z0, embeds[rows], pooled[rows], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        spent += time.process_time() - start
        if step % 100 == 0:
            print(f"[flow-ceiling] step {step} loss {loss.item():.4f} cpu {spent / 60:.1f} min", flush=True)
        if spent >= next_eval * 60 and spent < args.minutes * 60:
            evaluate(f"min{next_eval:g}", spent / 60, step)
            next_eval += args.eval_every
    evaluate("after", spent / 60, step)
    result = {"base": curve[0]["mean_oracle_score"], "after": curve[-1]["mean_oracle_score"],
              **{k: curve[-1][k] for k in ("gain", "paired_sem_images", "paired_sem_captions", "step", "cpu_minutes")}}
    atomic_write_text(args.out / "result.json", json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return {"curve": curve, "result": result}


if __name__ == "__main__":
    main()

"""What the testbed model reaches in a CPU budget when taught with perfect data: a reference for DDPO's target.

    python -m experiments.testbed_sft_ceiling                      # LoRA r8 on the UNet, as DDPO's default trains
    python -m experiments.testbed_sft_ceiling --finetune full      # every UNet weight

Fine-tunes the bundled testbed pipeline with the ordinary denoising loss on freshly rendered scenes
whose captions are all true (the base model saw a quarter of its scenes under another scene's caption),
for ``--minutes`` of training CPU time (the UNet only; the text encoder stays frozen, as in both
trainers), and scores the model on DDPO's held-out set (``testbed-heldout:200:1000``, unseen captions, 4 seeds each, guidance 3,
the trainers' ``evaluate_model``) before, every ``--eval-every`` minutes and at the end. Each training
image is a perfect answer to its caption, a stronger signal per CPU-second than a trainer that samples
its own images and only learns how good they are; what this reaches in 15 CPU minutes is a yardstick
for DDPO's target of +0.15 in that budget, not a proof of a limit. Rendering and encoding the scenes
and the evaluations are not counted in the budget.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import rewards
from align.data.prompt_sets import load_prompt_list
from align.pipeline import add_lora, encode_images, encode_prompts, load_pipeline, testbed_settings
from align.testbed.split import sample_split_captions
from align.train.ddpo import DDPOConfig
from align.train.heldout import evaluate_model
from rewards.weights import batched
from scripts.build_testbed import epsilon_loss, render_scenes, to_model_range

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/testbed-sft-ceiling"), help="folder for the evaluations")
    p.add_argument("--minutes", type=float, default=15.0, help="training CPU minutes (process time, one thread)")
    p.add_argument("--eval-every", type=float, default=5.0, help="CPU minutes between held-out evaluations")
    p.add_argument("--finetune", choices=["lora", "full"], default="lora")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="default: 1e-3 for LoRA, 1e-4 for full")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-scenes", type=int, default=8192, help="rendered training scenes (true captions)")
    p.add_argument("--caption-dropout", type=float, default=0.1, help="keeps classifier-free guidance working")
    p.add_argument("--eval-prompts", default="testbed-heldout:200:1000", help="unseen captions (the DDPO-style configs' set)")
    p.add_argument("--eval-images-per-prompt", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.eval_every <= 0:
        p.error("--minutes and --eval-every must be positive")
    if args.num_scenes < 1 or args.batch_size < 1:
        p.error("--num-scenes and --batch-size must be at least 1")
    if args.out.exists() and any(args.out.iterdir()):
        p.error(f"--out {args.out} is not empty; choose another folder (its results are kept)")
    return args


def render_training_scenes(n: int, held_out: set[str], seed: int) -> tuple[list[str], torch.Tensor]:
    """``n`` true (caption, image) pairs on training-part captions (align/testbed/split.py), none held out; images in [-1, 1]."""
    pool = sample_split_captions(2 * n, 10_000 + seed, "train")  # training-part captions, a stream of their own
    captions = [c for c in pool if c not in held_out][:n]
    return captions, to_model_range(render_scenes(captions, seed=seed))


def encode_in_batches(fn, items, batch_size: int = 256) -> torch.Tensor:
    """``fn`` (one of the pipeline's no-grad encoders) over ``items`` in chunks, concatenated."""
    return torch.cat([fn(chunk) for chunk in batched(items, batch_size)])


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    settings = testbed_settings("testbed")
    steps, guidance = settings["num_inference_steps"], settings["guidance_scale"]
    pipe = load_pipeline("testbed")
    unet = pipe.unet
    if args.finetune == "lora":
        add_lora(unet, rank=args.lora_rank)
    params = [p for p in unet.parameters() if p.requires_grad]
    lr = args.lr if args.lr is not None else (1e-3 if args.finetune == "lora" else 1e-4)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    judge = rewards.load("shapes-oracle")
    # DDPO's held-out evaluation: the same captions and seeds as a default testbed run's eval_before / eval_after.
    eval_config = SimpleNamespace(eval_prompts=args.eval_prompts, eval_images_per_prompt=args.eval_images_per_prompt,
                                  eval_seed=DDPOConfig.eval_seed, eval_batch_size=32)
    args.out.mkdir(parents=True, exist_ok=True)

    held_out = set(load_prompt_list(args.eval_prompts))
    captions, images = render_training_scenes(args.num_scenes, held_out, args.seed)
    latents = encode_in_batches(lambda x: encode_images(pipe, x), images)
    distinct = sorted(set(captions)) + [""]
    row_of = {c: i for i, c in enumerate(distinct)}
    hidden = encode_in_batches(lambda c: encode_prompts(pipe, c), distinct)
    caption_rows = torch.tensor([row_of[c] for c in captions])
    print(f"[sft] {len(captions)} true scenes ({len(distinct) - 1} distinct captions); {args.finetune}, "
          f"{sum(p.numel() for p in params):,} trained parameters, lr {lr}", flush=True)

    curve = []

    def evaluate(label: str, minutes: float, step: int) -> None:
        unet.eval()
        score = evaluate_model(pipe, judge, eval_config, steps, guidance, args.out / f"eval_{label}.json", label)
        unet.train()
        curve.append({"cpu_minutes": round(minutes, 2), "step": step, "mean_oracle_score": score})
        (args.out / "curve.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "curve": curve}, indent=2))

    evaluate("before", 0.0, 0)
    generator = torch.Generator().manual_seed(args.seed)
    unet.train()
    spent, step, next_eval = 0.0, 0, args.eval_every
    while spent < args.minutes * 60:
        start = time.process_time()
        idx = torch.randint(0, len(captions), (args.batch_size,), generator=generator)
        rows = caption_rows[idx].clone()
        rows[torch.rand(args.batch_size, generator=generator) < args.caption_dropout] = len(distinct) - 1
        loss = epsilon_loss(unet, pipe.scheduler, latents[idx], hidden[rows], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        spent += time.process_time() - start
        if step % 100 == 0:
            print(f"[sft] step {step} loss {loss.item():.4f} cpu {spent / 60:.1f} min", flush=True)
        if spent >= next_eval * 60 and spent < args.minutes * 60:
            evaluate(f"min{next_eval:g}", spent / 60, step)
            next_eval += args.eval_every
    evaluate("after", spent / 60, step)
    print(json.dumps(curve, indent=2))
    return curve


if __name__ == "__main__":
    main()

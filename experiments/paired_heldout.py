"""Is a run's held-out gain real? Score a base and trained models on the same large held-out set, paired.

    python -m experiments.paired_heldout --base testbed-flow runs/testbed-flow-dpo runs/testbed-flow-grpo

Every model draws the same images, each with its own starting noise: caption c's k-th image has seed
``first_seed + K·c + k`` (``--trainers-layout``: image i is caption i mod C with seed ``first_seed + i``, the
trainers' held-out layout; with --first-seed 1234 and a run's --eval_prompts, the images of its eval_*.json).
That matters: a trained model's gain varies strongly from one starting noise to another, so a set that
reuses a few noises for every caption measures those few noises, however many captions it has, and its
per-image standard error is far too small (experiments/notes/flow.md, round 3). Prints, per model, the mean
oracle score and the gain over the base ± its paired standard error per image and per caption (seeds
averaged first); --out keeps every image's score as JSON (base.json, <run folder name>.json), and a later call with
the same --out reuses the scores of a model already scored on the same images.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import rewards
from align.data.prompt_sets import load_prompt_list
from align.eval.evaluate import EvalConfig
from align.eval.generation import sampling_settings
from align.pipeline import generate_images, load_trained
from experiments.flow_ceiling import held_out_set
from experiments.flow_ceiling import paired_gain as seed_major_paired_gain

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="run folders or pipelines to compare with the base")
    p.add_argument("--base", required=True, help="the base pipeline ('testbed', 'testbed-flow' or a folder)")
    p.add_argument("--prompts", default="testbed:1000:4242", help="held-out captions (a seed no trainer used)")
    p.add_argument("--images-per-prompt", type=int, default=4)
    p.add_argument("--first-seed", type=int, default=50000)
    p.add_argument("--trainers-layout", action="store_true",
                   help="image i is caption i mod C (the trainers' held-out layout) instead of captions one after another")
    p.add_argument("--judge", default="shapes-oracle")
    p.add_argument("--out", type=Path, default=None, help="folder for each model's scores (JSON)")
    return p.parse_args(argv)


def paired_gain(before: list[float], after: list[float], images_per_prompt: int, trainers_layout: bool = False) -> dict:
    """flow_ceiling.paired_gain (the trainers' layout: image i is caption i mod C) for either layout (by default
    caption c = images K·c .. K·c+K-1), with the counts of images made better and worse."""
    k = images_per_prompt
    if len(before) % k or len(after) != len(before):
        raise ValueError(f"{len(before)} and {len(after)} scores are not {k} per prompt for the same images")
    order = list(range(len(before))) if trainers_layout else [c * k + i for i in range(k) for c in range(len(before) // k)]
    gain = seed_major_paired_gain([before[j] for j in order], [after[j] for j in order], k)
    gain["better"] = sum(a > b for a, b in zip(after, before))
    gain["worse"] = sum(a < b for a, b in zip(after, before))
    return gain


def score_model(model: str, captions: list[str], seeds: list[int], judge) -> list[float]:
    """The judge's score of every (caption, seed) image, sampled with the (base) model's testbed settings."""
    pipe = load_trained(model)
    pipe.set_progress_bar_config(disable=True)
    settings = sampling_settings(EvalConfig(), model)
    scores = []
    for start in range(0, len(captions), 400):
        images = generate_images(pipe, captions[start:start + 400], seeds[start:start + 400],
                                 num_inference_steps=settings["num_inference_steps"],
                                 guidance_scale=settings["guidance_scale"], batch_size=100)
        scores += judge.score(captions[start:start + 400], images).tolist()
    return scores


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)

    names = [Path(model).name for model in args.models]
    for model in [args.base, *args.models]:
        if model not in ("testbed", "testbed-flow") and not Path(model).exists():
            sys.exit(f"{model}: no such run folder or pipeline")
    if args.out and (len(set(names)) < len(names) or "base" in names):
        sys.exit(f"--out: the models' folder names must differ and not be 'base' (the score files are <name>.json), got {names}")
    k = args.images_per_prompt
    if args.trainers_layout:
        captions, seeds = held_out_set(args.prompts, k, args.first_seed)
    else:
        captions = [c for c in load_prompt_list(args.prompts) for _ in range(k)]
        seeds = [args.first_seed + i for i in range(len(captions))]
    judge = rewards.load(args.judge)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for model, name in [(args.base, "base"), *zip(args.models, names)]:
        kept = args.out / f"{name}.json" if args.out else None
        if kept is not None and kept.is_file():  # scored before on the same images (an earlier or interrupted call)
            record = json.loads(kept.read_text())
            if (record["model"], record["captions"], record["seeds"]) == (model, captions, seeds):
                results[model] = record["scores"]
                continue
        results[model] = score_model(model, captions, seeds, judge)
        if args.out:
            record = {"model": model, "prompts": args.prompts, "captions": captions, "seeds": seeds,
                      "scores": results[model]}
            (args.out / f"{name}.json").write_text(json.dumps(record))
    base = results[args.base]
    print(f"{len(captions)} images ({args.prompts} x {k}, seeds {seeds[0]}-{seeds[-1]}), judge {args.judge}")
    print(f"base {args.base}: {sum(base) / len(base):.4f}")
    for model in args.models:
        g = paired_gain(base, results[model], k, args.trainers_layout)
        ratio = g["gain"] / g["paired_sem_images"] if g["paired_sem_images"] else float("nan")
        print(f"{model}: {sum(results[model]) / len(base):.4f}  gain {g['gain']:+.4f} ± {g['paired_sem_images']:.4f} per image "
              f"({ratio:.1f} SE), ± {g['paired_sem_captions']:.4f} per caption; "
              f"{g['better']} images better, {g['worse']} worse", flush=True)


if __name__ == "__main__":
    main()

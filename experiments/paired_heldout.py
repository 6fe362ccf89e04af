"""Is a run's gain real, and is it on captions it never saw? Runs against their base on large sets, paired.

    python -m experiments.paired_heldout --base testbed-flow runs/flow-grpo runs/flow-nft --out runs/paired
    python -m experiments.paired_heldout --base testbed-edit runs/edit-nft --judge shapes-edit-oracle \
        --sets unseen=testbed-edit:2000:4242 --images-per-prompt 2        # the editing testbed's held-out edits

Every model draws the same images of each set, each with its own starting noise: caption c's k-th image has seed
``first_seed + K·c + k`` (``--trainers-layout``: image i is caption i mod C with seed ``first_seed + i``, the trainers'
held-out layout; with --first-seed 1234 and a run's --eval_prompts, the images of its eval_*.json). A set that
reuses a few noises for every caption measures those few noises (experiments/notes/flow.md, round 3).

The sets (``--sets NAME=SPEC[@FIRST_SEED] ...``; default: the three below) answer three questions:

- ``unseen`` (testbed-heldout:1000:4242): captions no testbed-train set can draw. The headline.
- ``novel`` (testbed-novel:500:4343): captions naming a colour-shape pair no training caption names.
- ``seen`` (testbed-train:256, the online-RL configs' training prompts; DPO's are testbed-train:512:1): the
  training captions again (each scene once), with fresh seeds: how much of a gain is recall.

Before anything is generated, every run folder's training prompts (its config.yaml) are checked against every set:
a held-out set that shares a caption with them is refused (align/data/prompt_overlap.py); for a set drawn from the
training part the share of its images on captions the run trained on is printed.

Printed per model and set: the mean score, the gain over the base ± its paired standard error per image and
clustered by caption (a caption's seeds share its difficulty, and repeated captions are one cluster), the gain in
clustered standard errors (the bar of experiments/notes: more than four), images better and worse, and with
--by-category the same per caption category. --out keeps each model's scores per set as JSON
(<out>/<set>/<model>.json, the base as base.json); a later call with the same --out reuses the scores of a model
already scored on the same images.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import yaml

import rewards
from align.cli import ConfigError
from align.data.prompt_overlap import prompt_key, prompt_overlap, report_overlap
from align.data.prompt_sets import load_prompt_list
from align.eval.evaluate import EvalConfig
from align.eval.generation import sampling_settings
from align.metrics import paired_change
from align.pipeline import generate_images, load_trained
from align.run_folder import CONFIG_FILE
from align.testbed.edit_world import edit_kind
from align.testbed.split import part_of_prompt
from rewards.edit_prompts import is_edit_prompt
from rewards.shapes_grammar import parse_caption

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SETS = ("unseen=testbed-heldout:1000:4242@50000", "novel=testbed-novel:500:4343@60000",
                "seen=testbed-train:256@70000")
BUNDLED = ("testbed", "testbed-flow", "testbed-edit")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="run folders or pipelines to compare with the base")
    p.add_argument("--base", required=True, help="the base pipeline ('testbed', 'testbed-flow', 'testbed-edit' or a folder)")
    p.add_argument("--sets", nargs="+", default=list(DEFAULT_SETS),
                   help="NAME=SPEC[@FIRST_SEED]: the prompt sets to score (first seed default 50000)")
    p.add_argument("--images-per-prompt", type=int, default=4)
    p.add_argument("--trainers-layout", action="store_true",
                   help="image i is caption i mod C (the trainers' held-out layout) instead of captions one after another")
    p.add_argument("--by-category", action="store_true", help="also the gain within each caption category (an edit's kind on the editing testbed)")
    p.add_argument("--judge", default="shapes-oracle")
    p.add_argument("--out", type=Path, default=None, help="folder for each model's scores (JSON)")
    args = p.parse_args(argv)
    if args.images_per_prompt < 1:
        p.error("--images-per-prompt must be at least 1")
    return args


def parse_set(text: str) -> tuple[str, str, int]:
    """'unseen=testbed-heldout:1000:4242@50000' -> (name, spec, first seed)."""
    name, sep, rest = text.partition("=")
    spec, _, seed = rest.rpartition("@") if "@" in rest else (rest, "", "50000")
    if not sep or not name or not spec or not seed.isdigit():
        raise SystemExit(f"--sets {text!r}: give NAME=SPEC[@FIRST_SEED], e.g. unseen=testbed-heldout:1000:4242@50000")
    return name, spec, int(seed)


def image_set(spec: str, images_per_prompt: int, first_seed: int, trainers_layout: bool) -> tuple[list[str], list[int]]:
    """The (caption, seed) of every image: captions one after another, or the trainers' layout (the list repeated).
    A scene named twice in the set (a training set's recurring captions) is kept once: its seeds are its images."""
    first_of_scene: dict[str, str] = {}
    for prompt in load_prompt_list(spec):
        first_of_scene.setdefault(prompt_key(prompt), prompt)
    prompts = list(first_of_scene.values())
    if trainers_layout:
        captions = prompts * images_per_prompt
    else:
        captions = [c for c in prompts for _ in range(images_per_prompt)]
    return captions, [first_seed + i for i in range(len(captions))]


def training_prompts(model: str) -> tuple[str, list[str]] | None:
    """(spec, prompts) a run folder trained on, from its config.yaml (None for a pipeline or a run on a dataset)."""
    config_file = Path(model) / CONFIG_FILE
    if not config_file.is_file():
        return None
    config = yaml.safe_load(config_file.read_text()) or {}
    spec = config.get("prompts") if config.get("reward") else None
    return (spec, load_prompt_list(spec)) if spec else None


def check_sets_against_training(models: list[str], sets: dict[str, tuple[list[str], list[int]]], specs: dict[str, str]) -> None:
    """Refuse a held-out set a run trained on; say how much of a training-part set each run trained on."""
    for model in models:
        trained = training_prompts(model)
        if trained is None:
            print(f"{model}: no training prompts in a config.yaml (a pipeline, or pairs from a dataset): not checked")
            continue
        for name, (captions, _) in sets.items():
            if {part_of_prompt(c) for c in captions} == {"train"}:  # a set of seen captions: how many were trained on
                found = prompt_overlap(trained[1], captions)
                print(f"{model}: {found.shared} of the {found.total} images of {name} ({specs[name]}) are on captions it "
                      f"trained on ({trained[0]})")
            else:
                report_overlap(trained[0], trained[1], specs[name], captions, f"{model}'s --prompts", f"--sets {name}")


def paired_gain(before: list[float], after: list[float], captions: list[str]) -> dict:
    """The gain with its paired standard errors (per image, clustered by caption) and the counts of better/worse."""
    change = paired_change(before, after, captions)
    return {"gain": change.mean, "paired_sem_images": change.sem_images, "paired_sem_captions": change.sem_prompts,
            "clustered_se_ratio": change.prompt_se_ratio, "num_images": change.images, "num_captions": change.prompts,
            "better": change.better, "worse": change.worse}


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


def scores_of(model: str, name: str, captions: list[str], seeds: list[int], judge, kept: Path | None) -> list[float]:
    """A model's scores on one set, from --out when it already holds them for the same images."""
    if kept is not None and kept.is_file():
        record = json.loads(kept.read_text())
        if (record["model"], record["captions"], record["seeds"]) == (model, captions, seeds):
            return record["scores"]
    scores = score_model(model, captions, seeds, judge)
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps({"model": model, "set": name, "captions": captions, "seeds": seeds, "scores": scores}))
    return scores


def caption_category(caption: str) -> str:
    """A generation caption's category (object, count, ...) or an edit's kind (recolour, move, remove)."""
    return edit_kind(caption) if is_edit_prompt(caption) else parse_caption(caption).category


def describe(g: dict) -> str:
    return (f"gain {g['gain']:+.4f} ± {g['paired_sem_images']:.4f} per image, ± {g['paired_sem_captions']:.4f} by caption "
            f"({g['clustered_se_ratio']:.1f} SE by caption; {g['num_images']} images, {g['num_captions']} captions); "
            f"{g['better']} images better, {g['worse']} worse")


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)

    names = [Path(model).name for model in args.models]
    for model in [args.base, *args.models]:
        if model not in BUNDLED and not Path(model).exists():
            sys.exit(f"{model}: no such run folder or pipeline")
    if args.out and (len(set(names)) < len(names) or "base" in names):
        sys.exit(f"--out: the models' folder names must differ and not be 'base' (the score files are <name>.json), got {names}")
    parsed = [parse_set(text) for text in args.sets]
    if len({name for name, _, _ in parsed}) < len(parsed):
        sys.exit(f"--sets: every set needs a name of its own, got {args.sets}")
    specs = {name: spec for name, spec, _ in parsed}
    sets = {name: image_set(spec, args.images_per_prompt, seed, args.trainers_layout) for name, spec, seed in parsed}
    try:
        check_sets_against_training(args.models, sets, specs)  # before any image is generated
    except ConfigError as err:
        sys.exit(str(err))

    judge = rewards.load(args.judge)
    summary = {}
    for name, (captions, seeds) in sets.items():
        print(f"{name}: {len(captions)} images ({specs[name]} x {args.images_per_prompt}, seeds {seeds[0]}-{seeds[-1]}), "
              f"judge {args.judge}", flush=True)
        folder = args.out / name if args.out else None
        base = scores_of(args.base, name, captions, seeds, judge, folder / "base.json" if folder else None)
        print(f"  base {args.base}: {sum(base) / len(base):.4f}", flush=True)
        summary[name] = {"spec": specs[name], "base": sum(base) / len(base), "models": {}}
        for model, model_name in zip(args.models, names):
            after = scores_of(model, name, captions, seeds, judge, folder / f"{model_name}.json" if folder else None)
            gain = paired_gain(base, after, captions)
            summary[name]["models"][model] = {"mean": sum(after) / len(after), **gain}
            print(f"  {model}: {sum(after) / len(after):.4f}  {describe(gain)}", flush=True)
            if args.by_category:
                categories = [caption_category(c) for c in captions]
                for category in sorted(set(categories)):
                    rows = [i for i, c in enumerate(categories) if c == category]
                    part = paired_gain([base[i] for i in rows], [after[i] for i in rows], [captions[i] for i in rows])
                    summary[name]["models"][model][category] = part
                    print(f"    {category}: {describe(part)}", flush=True)
    if args.out:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()

"""Where the held-out score falls short of perfect: captions no seed gets right, or seeds that miss.

    python -m experiments.heldout_gap runs/testbed-ddpo [more run folders]

For a judge whose best score is 1 (the shapes oracle: the share of a caption's facts that hold), each
caption's shortfall 1 - mean over its seeds splits exactly into

    (1 - best seed's score)   the caption's own part: what even its best seed gets wrong
    (best - mean)             the seeds' part: what some seed gets right and the others do not

averaged over the held-out captions. A trainer that only removes seed-to-seed variation can at most
close the second part. Reads eval_before.json, evals/step_*.json and eval_after.json of each run
folder (written with --eval_images_per_prompt K > 1: image i belongs to caption i mod N).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import yaml

from align.run_folder import CONFIG_FILE, eval_step, held_out_evals


def gap_parts(scores, images_per_prompt: int, best: float = 1.0) -> dict[str, float]:
    """Split best - mean of scores laid out seed-major ([K x N]: image i is caption i mod N)."""
    values = np.asarray(scores, dtype=np.float64)
    if images_per_prompt < 2 or len(values) % images_per_prompt:
        raise ValueError(f"need K >= 2 images per caption and a multiple of K scores, got K = {images_per_prompt} "
                         f"and {len(values)} scores")
    per_caption = values.reshape(images_per_prompt, -1)
    mean, top, bottom = per_caption.mean(0), per_caption.max(0), per_caption.min(0)
    return {
        "mean": float(mean.mean()),
        "gap": float(best - mean.mean()),
        "caption_part": float((best - top).mean()),
        "seed_part": float((top - mean).mean()),
        "all_seeds_perfect": float(np.mean(bottom >= best)),
        "no_seed_perfect": float(np.mean(top < best)),
    }


def eval_files(run: Path) -> list[tuple[str, Path]]:
    """The run's held-out evaluations in training order."""
    files = [("before", run / "eval_before.json")]
    files += [(f"step {eval_step(p)}", p) for p in held_out_evals(run)]
    files.append(("after", run / "eval_after.json"))
    return [(label, path) for label, path in files if path.is_file()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders of align/dpo.py or align/ddpo.py")
    p.add_argument("--best", type=float, default=1.0, help="the judge's best score (the shapes oracle: 1)")
    args = p.parse_args(argv)

    for run in args.runs:
        config_file = run / CONFIG_FILE
        if not config_file.is_file():
            raise SystemExit(f"{run} is not a run folder (no {CONFIG_FILE})")
        repeats = yaml.safe_load(config_file.read_text()).get("eval_images_per_prompt", 1)
        if repeats < 2:
            raise SystemExit(f"{run}: eval_images_per_prompt is {repeats}; the split needs several seeds per caption")
        files = eval_files(run)
        if not files:
            raise SystemExit(f"{run} has no eval_before.json / eval_after.json")
        print(f"{run} ({repeats} seeds per held-out caption)")
        for label, path in files:
            parts = gap_parts(json.loads(path.read_text())["scores"], repeats, args.best)
            print(f"  {label:>10}: mean {parts['mean']:.3f} | shortfall {parts['gap']:.3f} = caption part "
                  f"{parts['caption_part']:.3f} + seed part {parts['seed_part']:.3f} | captions with every seed perfect "
                  f"{parts['all_seeds_perfect']:.0%}, with none {parts['no_seed_perfect']:.0%}")


if __name__ == "__main__":
    main()

"""Preference pairs from the shapes world, in the Pick-a-Pic schema.

Two sources:

- ``rendered_pairs``: a correct render against a near-miss render of the same caption
  (a recoloured, reshaped, resized, dropped or added object, or the opposite relation).
  The label is ground truth: a judge benchmark, or clean data for offline Diffusion-DPO.
- ``judged_pairs``: two generations per prompt from any ``generate(prompts, seeds) -> images``
  (e.g. the bundled base model), labelled by any judge's ``compare`` (the oracle, a degraded
  oracle, a learned or API judge): AI-feedback data for offline Diffusion-DPO.

Columns: caption, jpg_0, jpg_1 (PNG bytes, as in Pick-a-Pic the name says jpg), label_0, label_1
(1 / 0, 0.5 each for a tie), category (the caption's alignment category), judge, judge_raw (JSON).
The winner is put on side 0 for half of the decided pairs and on side 1 for the other half, in
random order, so position alone predicts nothing.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from align.run_folder import atomic_path
from align.testbed.scene import CORRUPTIONS, applicable_corruptions, corrupt_caption, render, sample_caption
from rewards.base import Judge
from rewards.images import encode_png, num_images, to_pil
from rewards.shapes_grammar import CATEGORIES, format_caption, parse_caption

PAIR_COLUMNS = ("caption", "jpg_0", "jpg_1", "label_0", "label_1", "category", "judge", "judge_raw")
GROUND_TRUTH = "ground-truth"

Generator = Callable[[list[str], list[int]], Sequence]


def balanced_sides(n: int, rng: random.Random) -> list[int]:
    """n winner sides, half 0 and half 1 (one extra at random when n is odd), shuffled."""
    sides = [0] * (n // 2) + [1] * (n // 2) + ([rng.randrange(2)] if n % 2 else [])
    rng.shuffle(sides)
    return sides


def _row(caption, winner_img, loser_img, side, category, judge, raw) -> dict:
    """A decided pair with the winner on ``side``."""
    images = (winner_img, loser_img) if side == 0 else (loser_img, winner_img)
    return {
        "caption": caption,
        "jpg_0": encode_png(images[0]),
        "jpg_1": encode_png(images[1]),
        "label_0": 1.0 if side == 0 else 0.0,
        "label_1": 0.0 if side == 0 else 1.0,
        "category": category,
        "judge": judge,
        "judge_raw": json.dumps(raw, default=str),
    }


def _table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(PAIR_COLUMNS))


def rendered_pairs(
    n: int,
    seed: int,
    categories: Sequence[str] | None = None,
    kinds: Sequence[str] | None = None,
    size: int = 32,
) -> pd.DataFrame:
    """``n`` pairs (correct render, near-miss render) with ground-truth labels.

    categories: caption categories to draw from (default all); kinds: corruption kinds to use
    (default all that apply to each caption). Deterministic for ``seed``.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    categories = list(categories or CATEGORIES)
    bad = [c for c in categories if c not in CATEGORIES]
    kinds = list(kinds or CORRUPTIONS)
    bad_kinds = [k for k in kinds if k not in CORRUPTIONS]
    if bad or bad_kinds:
        raise ValueError(
            f"unknown categories {bad} / corruption kinds {bad_kinds}; "
            f"valid categories: {', '.join(CATEGORIES)}; valid kinds: {', '.join(CORRUPTIONS)}"
        )
    rng = random.Random(f"rendered-pairs:{seed}")
    sides = balanced_sides(n, rng)
    rows, misses = [], 0
    while len(rows) < n:
        caption = sample_caption(rng, rng.choice(categories))
        usable = [k for k in applicable_corruptions(caption) if k in kinds]
        if not usable:
            misses += 1
            if misses > 1000:  # e.g. kinds=["relation"] with no spatial captions
                raise ValueError(
                    f"corruption kinds {kinds} do not apply to captions of categories {categories}"
                )
            continue
        misses = 0
        image_seed = rng.randrange(2**31)
        wrong, kind = corrupt_caption(caption, image_seed, rng.choice(usable))
        text = format_caption(caption)
        raw = {"corruption": kind, "near_miss_shows": wrong, "seed": image_seed}
        rows.append(
            _row(
                text,
                render(text, image_seed, size),
                render(wrong, image_seed, size),
                sides[len(rows)],
                caption.category,
                GROUND_TRUTH,
                raw,
            )
        )
    return _table(rows)


def judged_pairs(
    prompts: Sequence[str],
    generate: Generator,
    judge: Judge,
    seed: int = 0,
    keep_ties: bool = True,
) -> pd.DataFrame:
    """Two generations per prompt, labelled by ``judge.compare``.

    generate(prompts, seeds) returns one image per prompt (PIL list or [N, 3, H, W] tensor in
    [0, 1]); image i of a call uses seed seeds[i]. Abstentions are dropped; ties are kept with
    labels 0.5 / 0.5 unless ``keep_ties`` is False. judge_raw holds the judge's raw output, the
    two seeds and whether the pair was swapped after judging (for position balance).
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError("judged_pairs needs at least one prompt")
    if not callable(generate) or not hasattr(judge, "compare"):
        raise ValueError("generate must be a callable generate(prompts, seeds) and judge a rewards.Judge")
    seeds_a = [seed * 1_000_003 + 2 * i for i in range(len(prompts))]
    seeds_b = [s + 1 for s in seeds_a]
    images_a, images_b = generate(prompts, seeds_a), generate(prompts, seeds_b)
    for name, images in (("A", images_a), ("B", images_b)):
        if num_images(images) != len(prompts):
            raise ValueError(
                f"generate returned {num_images(images)} images for {len(prompts)} prompts (batch {name})"
            )
    images_a, images_b = to_pil(images_a), to_pil(images_b)
    verdicts = judge.compare(prompts, images_a, images_b)
    rng = random.Random(f"judged-pairs:{seed}")
    decided = [i for i, p in enumerate(verdicts) if p.winner is not None]
    target_side = dict(zip(decided, balanced_sides(len(decided), rng)))
    rows = []
    for i, (prompt, pref) in enumerate(zip(prompts, verdicts)):
        if pref.abstained or (pref.winner is None and not keep_ties):
            continue
        raw = {"judge_raw": pref.raw, "prob_a": pref.prob_a, "seeds": [seeds_a[i], seeds_b[i]]}
        category = _category(prompt)
        if pref.winner is None:  # tie: keep the generation order
            raw["swapped"] = False
            rows.append(
                {
                    "caption": prompt,
                    "jpg_0": encode_png(images_a[i]),
                    "jpg_1": encode_png(images_b[i]),
                    "label_0": 0.5,
                    "label_1": 0.5,
                    "category": category,
                    "judge": judge.name,
                    "judge_raw": json.dumps(raw, default=str),
                }
            )
            continue
        winner, loser = (images_a[i], images_b[i]) if pref.winner == 0 else (images_b[i], images_a[i])
        raw["swapped"] = target_side[i] != pref.winner  # image A now sits on side 1
        rows.append(_row(prompt, winner, loser, target_side[i], category, judge.name, raw))
    return _table(rows)


def _category(prompt: str) -> str | None:
    try:
        return parse_caption(prompt).category
    except ValueError:
        return None  # a prompt from outside the shapes world


def write_parquet(table: pd.DataFrame | pa.Table, path: str | os.PathLike) -> Path:
    """Write the pairs table to ``path`` atomically (temporary file, then rename)."""
    path = Path(path)
    if not isinstance(table, pa.Table):
        missing = [c for c in PAIR_COLUMNS if c not in table.columns]
        if missing:
            raise ValueError(f"pairs table lacks the Pick-a-Pic columns {missing}")
        table = pa.Table.from_pandas(table, preserve_index=False)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return path

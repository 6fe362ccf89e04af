"""An MJ-Bench-style judge benchmark generated from the shapes testbed, with exact labels.

    python -m align.testbed.mjbench --output bench.parquet --pairs 50 --bias-groups 24

Subsets (same row format as align/judgebench/data.py: caption, image0, image1, label, category,
subcategory, group, variant, info):

- alignment, subcategories object / attribute / count / spatial: the caption rendered exactly
  against a near miss (a scene of a corrupted caption: other shape or an object dropped/added for
  object, other colour or size for attribute, one object more or fewer for count, the opposite
  relation for spatial). The caption-true image is the preferred one.
- quality, subcategories blur / motion-blur / distortion: a scene against a degraded copy of the
  same image (Gaussian blur, a horizontal motion-blur kernel, a sinusoidal row shift). The clean
  image is preferred.
- bias: captions that leave colour open ("two squares left of a circle"), each rendered once per
  colour with the same layout (group = the caption, variant = the colour). Nothing in the caption
  prefers a colour, so a fair judge gives every variant the same score.

Labels are balanced: in each subcategory exactly half the pairs (rounded down) put the preferred
image second (label 1), so a constant "first image" judge scores 50% (MJ-Bench's alignment data is
86-92% label 0, where that judge would look good).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageFilter

from align.run_folder import atomic_write_bytes
from align.testbed.scene import (
    applicable_corruptions,
    draw_objects,
    layout,
    render,
    render_mismatched,
    sample_caption,
)
from rewards.images import encode_png
from rewards.shapes_grammar import CATEGORIES, COLOURS, Caption, format_caption

# Which corruptions test which alignment subcategory (MJ-Bench: object existence, attribute, count, spatial).
ALIGNMENT_CORRUPTIONS: dict[str, tuple[str, ...]] = {
    "object": ("shape", "drop", "add"),
    "attribute": ("colour", "size"),
    "count": ("drop", "add"),
    "spatial": ("relation",),
}
QUALITY_KINDS: tuple[str, ...] = ("blur", "motion-blur", "distortion")


# ---------------------------------------------------------------------------- degradations


def blur(image: Image.Image) -> Image.Image:
    """Gaussian blur with a radius of 1/32 of the image side (1 px at 32 px)."""
    return image.filter(ImageFilter.GaussianBlur(radius=max(1.0, image.width / 32)))


def motion_blur(image: Image.Image) -> Image.Image:
    """A horizontal 5-tap box kernel: the smear of a camera moving sideways."""
    kernel = [0.0] * 10 + [0.2] * 5 + [0.0] * 10
    return image.filter(ImageFilter.Kernel((5, 5), kernel, scale=1.0))


def distort(image: Image.Image, seed: int) -> Image.Image:
    """Shift each row sideways by a sinusoid (amplitude 1/16 of the side): wobbly, broken edges."""
    rng = random.Random(f"distort:{seed}")
    pixels = np.asarray(image.convert("RGB"))
    height = pixels.shape[0]
    amplitude = max(1.0, image.width / 16)
    phase, period = rng.uniform(0, 2 * np.pi), rng.uniform(height / 3, height / 1.5)
    out = np.empty_like(pixels)
    for y in range(height):
        out[y] = np.roll(pixels[y], int(round(amplitude * np.sin(2 * np.pi * y / period + phase))), axis=0)
    return Image.fromarray(out)


def degrade(image: Image.Image, kind: str, seed: int) -> Image.Image:
    if kind == "blur":
        return blur(image)
    if kind == "motion-blur":
        return motion_blur(image)
    if kind == "distortion":
        return distort(image, seed)
    raise ValueError(f"unknown degradation {kind!r}; valid: {', '.join(QUALITY_KINDS)}")


# ---------------------------------------------------------------------------- rows


def balanced_labels(n: int, rng: random.Random) -> list[int]:
    """n labels, floor(n/2) of them 1, in random order."""
    labels = [0] * (n - n // 2) + [1] * (n // 2)
    rng.shuffle(labels)
    return labels


def _pair_row(caption: str, good: Image.Image, bad: Image.Image, label: int, category: str, sub: str, info: dict) -> dict:
    first, second = (good, bad) if label == 0 else (bad, good)
    return {
        "caption": caption,
        "image0": encode_png(first),
        "image1": encode_png(second),
        "label": label,
        "category": category,
        "subcategory": sub,
        "group": None,
        "variant": None,
        "info": json.dumps(info),
    }


def alignment_rows(pairs_per_subcategory: int, size: int, seed: int) -> list[dict]:
    rows = []
    for sub in CATEGORIES:
        rng = random.Random(f"mjbench-alignment:{seed}:{sub}")
        labels = balanced_labels(pairs_per_subcategory, rng)
        for i, label in enumerate(labels):
            caption = format_caption(sample_caption(rng, sub))
            kinds = [k for k in ALIGNMENT_CORRUPTIONS[sub] if k in applicable_corruptions(caption)]
            kind = rng.choice(kinds or applicable_corruptions(caption))
            image_seed = seed * 100_003 + i
            good = render(caption, image_seed, size)
            bad, shown, kind = render_mismatched(caption, image_seed, kind, size)
            info = {"corruption": kind, "rejected_shows": shown, "seed": image_seed}
            rows.append(_pair_row(caption, good, bad, label, "alignment", sub, info))
    return rows


def quality_rows(pairs_per_subcategory: int, size: int, seed: int) -> list[dict]:
    rows = []
    for kind in QUALITY_KINDS:
        rng = random.Random(f"mjbench-quality:{seed}:{kind}")
        labels = balanced_labels(pairs_per_subcategory, rng)
        for i, label in enumerate(labels):
            caption = format_caption(sample_caption(rng, rng.choice(CATEGORIES)))
            image_seed = seed * 100_003 + 50_000 + i
            good = render(caption, image_seed, size)
            bad = degrade(good, kind, image_seed)
            rows.append(_pair_row(caption, good, bad, label, "quality", kind, {"degradation": kind, "seed": image_seed}))
    return rows


def colourless_caption(rng: random.Random) -> Caption:
    """A caption with no colour words (object, count or spatial, whose groups differ in shape or size)."""
    while True:
        drawn = sample_caption(rng, rng.choice(("object", "count", "spatial")))
        try:
            return Caption(tuple(dataclasses.replace(g, colour=None) for g in drawn.groups), drawn.relation)
        except ValueError:  # its groups differed only by colour
            continue


def bias_rows(groups: int, size: int, seed: int) -> list[dict]:
    """One row per (colourless caption, colour): every object painted that colour, layout fixed."""
    rng = random.Random(f"mjbench-bias:{seed}")
    rows, seen = [], set()
    while len(seen) < groups:
        caption = colourless_caption(rng)
        text = format_caption(caption)
        if text in seen:
            continue
        seen.add(text)
        image_seed = seed * 100_003 + 90_000 + len(seen)
        placed = layout(caption, image_seed, size)
        for colour in COLOURS:
            image = draw_objects([dataclasses.replace(o, colour=colour) for o in placed], size)
            rows.append({
                "caption": text, "image0": encode_png(image), "image1": None, "label": None,
                "category": "bias", "subcategory": "colour", "group": text, "variant": colour,
                "info": json.dumps({"seed": image_seed}),
            })
    return rows


def build_rows(pairs_per_subcategory: int = 50, bias_groups: int = 24, size: int = 32, seed: int = 0) -> list[dict]:
    if pairs_per_subcategory <= 0 or bias_groups < 0:
        raise ValueError("pairs_per_subcategory must be positive and bias_groups >= 0")
    return (
        alignment_rows(pairs_per_subcategory, size, seed)
        + quality_rows(pairs_per_subcategory, size, seed)
        + bias_rows(bias_groups, size, seed)
    )


def write_benchmark(path: str | Path, pairs_per_subcategory: int = 50, bias_groups: int = 24, size: int = 32, seed: int = 0) -> Path:
    """Generate the benchmark and write it as one parquet file (atomically)."""
    rows = build_rows(pairs_per_subcategory, bias_groups, size, seed)
    schema = pa.schema([
        ("caption", pa.string()), ("image0", pa.binary()), ("image1", pa.binary()), ("label", pa.int64()),
        ("category", pa.string()), ("subcategory", pa.string()), ("group", pa.string()),
        ("variant", pa.string()), ("info", pa.string()),
    ])
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="parquet file to write")
    parser.add_argument("--pairs", type=int, default=50, help="pairs per alignment subcategory and per degradation")
    parser.add_argument("--bias-groups", type=int, default=24, help="colourless captions, each in every colour")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = write_benchmark(args.output, args.pairs, args.bias_groups, args.size, args.seed)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

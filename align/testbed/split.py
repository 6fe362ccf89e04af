"""The testbed's caption split: which captions a trainer may draw and which are held out (version 1).

Every caption of the shapes grammar falls in exactly one part, by a fixed rule (no file, no randomness):

- ``novel`` (unseen combinations): it names one of the held-out colour-shape pairs ``NOVEL_PAIRS`` ("a green
  circle", "two purple squares", ...). No training caption names one, so a gain here is alignment carried to
  combinations the fine-tuning never showed (T2I-CompBench's and GenEval's attribute binding), not recall.
- ``heldout`` (unseen captions): of the other captions, those whose scene hashes below ``HELDOUT_FRACTION``.
  Every colour-shape pair in them also occurs in training; the scene as a whole never does.
- ``train``: everything else. The testbed's training prompt sets (``testbed-train:<n>[:<seed>]``) draw only these.

The part goes by the scene, not its wording: "a red circle and a blue square" and "a blue square and a red circle",
"A left of B" and "B right of A" describe the same facts and share a part, so a reordered training caption never
counts as unseen.

Version 1 is frozen: the tests pin a digest of its assignment. A different split would be version 2 with set names
of its own, so that a spec string in a run's config names the same captions for ever. The bundled base models were
pretrained on scenes of the whole grammar (as a web-scale model has seen most phrases); the split is about what the
alignment trainers see.
"""

from __future__ import annotations

import hashlib
import random

from align.testbed.scene import sample_caption
from rewards.shapes_grammar import (
    CATEGORIES,
    Caption,
    CaptionError,
    format_caption,
    format_group,
    parse_caption,
)

SPLIT_VERSION = 1
PARTS: tuple[str, ...] = ("train", "heldout", "novel")
# one pair per shape and per colour, so every shape and every colour still occurs in training
NOVEL_PAIRS: frozenset[tuple[str, str]] = frozenset({("green", "circle"), ("purple", "square"), ("red", "triangle")})
HELDOUT_FRACTION = 0.25
# the first salt of the form shapes-split-v1-<k> that holds out 2 of the 7 object-category scenes, one of one object
# and one of two (the category has no other captions: the hash alone could hold out none of them, or most)
SALT = "shapes-split-v1-2"
# object captions name no colour: none is a novel combination
PART_CATEGORIES: dict[str, tuple[str, ...]] = {"train": CATEGORIES, "heldout": CATEGORIES,
                                               "novel": tuple(c for c in CATEGORIES if c != "object")}
# draws in a row without a new scene after which a category leaves a distinct set's draw
DISTINCT_PATIENCE = 500
# "A right of B" is "B left of A"; "A below B" is "B above A"
_MIRRORED = {"right of": "left of", "below": "above"}


def scene_key(caption: str | Caption) -> str:
    """The caption's facts as one canonical caption, whatever order it names them in (the split's unit)."""
    parsed = parse_caption(caption)
    groups = parsed.groups
    if parsed.relation is None:
        return format_caption(Caption(tuple(sorted(groups, key=format_group))))
    if parsed.relation in _MIRRORED:
        return format_caption(Caption((groups[1], groups[0]), _MIRRORED[parsed.relation]))
    return format_caption(parsed)


def names_novel_pair(caption: str | Caption) -> bool:
    return any((g.colour, g.shape) in NOVEL_PAIRS for g in parse_caption(caption).groups)


def split_of(caption: str | Caption) -> str:
    """The part of the split a caption belongs to: 'train', 'heldout' or 'novel'."""
    if names_novel_pair(caption):
        return "novel"
    digest = hashlib.sha256(f"{SALT}|{scene_key(caption)}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") < HELDOUT_FRACTION * 2**64 else "train"


def sample_split_captions(n: int, seed: int, part: str, distinct: bool = False) -> list[str]:
    """``n`` captions of one part: categories uniform over the part's, each caption drawn from the scene sampler
    and redrawn until it lies in the part (so the sets keep the sampler's mix within each category).

    ``distinct``: every caption a scene of its own (held-out sets: a caption that recurs adds images of one scene,
    not evidence about unseen captions). A category leaves the draw once DISTINCT_PATIENCE draws in a row find no
    new scene of it (the object category has 2 held-out scenes); the others keep equal shares.
    """
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r} of the caption split; valid: {', '.join(PARTS)}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    rng = random.Random(f"captions:{part}:v{SPLIT_VERSION}{':distinct' if distinct else ''}:{seed}")
    categories, scenes = list(PART_CATEGORIES[part]), set()
    captions = []
    while len(captions) < n:
        if not categories:
            raise ValueError(f"the {part!r} part of the caption split gave only {len(captions)} distinct scenes "
                             f"before its sampler stopped finding new ones; ask for at most that many")
        category = rng.choice(categories)
        caption = _draw_in_part(rng, category, part)
        if distinct:  # this slot goes to a new scene of the category, or the category leaves the draw
            misses = 0
            while scene_key(caption) in scenes and misses < DISTINCT_PATIENCE:
                caption, misses = _draw_in_part(rng, category, part), misses + 1
            if misses == DISTINCT_PATIENCE:
                categories.remove(category)
                continue
            scenes.add(scene_key(caption))
        captions.append(format_caption(caption))
    return captions


def _draw_in_part(rng: random.Random, category: str, part: str) -> Caption:
    while split_of(caption := sample_caption(rng, category)) != part:
        pass
    return caption


def part_of_prompt(text: str) -> str | None:
    """The split's part of a prompt, None for a prompt that is not a caption of the shapes grammar."""
    try:
        return split_of(text)
    except CaptionError:
        return None

"""Scenes of the shapes testbed: sample captions, render them, and render near-miss scenes.

    >>> captions = sample_captions(4, seed=0)
    >>> image = render(captions[0], seed=0)          # a 32x32 RGB PIL image
    >>> bad, bad_caption, kind = render_mismatched(captions[0], seed=0)

Rendering style (fixed; the bundled base model is trained on it): a black background, flat
palette colours (``rewards.shapes_grammar.COLOURS``), circles, squares and upward triangles whose
side is a fixed fraction of the image side (small / medium / large), anti-aliased by drawing at 4x
and box-downsampling. Objects never overlap (2 px gap at 32 px) and a relation "A left of B"
puts every A box entirely left of every B box. Everything is deterministic for (caption, seed, size).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, replace

from PIL import Image, ImageDraw

from rewards.shapes_grammar import (
    BACKGROUND,
    CATEGORIES,
    COLOURS,
    MAX_OBJECTS,
    OPPOSITE_RELATION,
    RELATIONS,
    SHAPES,
    SIZE_WORDS,
    SIZES,
    Caption,
    ObjectGroup,
    format_caption,
    parse_caption,
)

SUPERSAMPLE = 4
MIN_SIZE = 24  # below this two large objects no longer fit side by side
MAX_SIZE = 1024
CORRUPTIONS: tuple[str, ...] = ("colour", "shape", "size", "drop", "add", "relation")


@dataclass(frozen=True)
class PlacedObject:
    """One drawn object; box = (x0, y0, x1, y1) in pixels of the output image (x1, y1 exclusive)."""

    group: int
    shape: str
    colour: str
    size: str
    box: tuple[float, float, float, float]


# ---------------------------------------------------------------- captions


def sample_captions(n: int, seed: int, categories: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """``n`` captions, categories drawn uniformly from ``categories`` (default: all four)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    categories = _check_categories(categories)
    rng = random.Random(f"captions:{seed}")
    return [format_caption(sample_caption(rng, rng.choice(categories))) for _ in range(n)]


def _check_categories(categories) -> tuple[str, ...]:
    if categories is None:
        return CATEGORIES
    if isinstance(categories, str):
        categories = [c.strip() for c in categories.split(",") if c.strip()]
    bad = [c for c in categories if c not in CATEGORIES]
    if bad or not categories:
        raise ValueError(f"unknown caption categories {bad or categories!r}; valid: {', '.join(CATEGORIES)}")
    return tuple(categories)


def sample_caption(rng: random.Random, category: str) -> Caption:
    """One random parsed caption whose ``category`` is ``category``."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown caption category {category!r}; valid: {', '.join(CATEGORIES)}")
    while True:  # rejection: a few draws at most (invalid = groups that cannot be told apart)
        try:
            caption = _draw(rng, category)
        except ValueError:
            continue
        if caption.category == category:
            return caption


def _draw(rng: random.Random, category: str) -> Caption:
    def group(count: int, p_colour: float, p_size: float) -> ObjectGroup:
        return ObjectGroup(
            shape=rng.choice(SHAPES),
            count=count,
            colour=rng.choice(list(COLOURS)) if rng.random() < p_colour else None,
            size=rng.choice(SIZE_WORDS) if rng.random() < p_size else None,
        )

    if category == "object":
        k = rng.choice((1, 2, 2, 3))
        return Caption(tuple(group(1, 0.0, 0.0) for _ in range(k)))
    if category == "attribute":
        k = rng.choice((1, 1, 2, 2, 3))
        return Caption(tuple(group(1, 0.9, 0.3) for _ in range(k)))
    if category == "count":
        counts = rng.choice(((2,), (3,), (2,), (2, 1), (1, 2)))
        return Caption(tuple(group(c, 0.75, 0.15) for c in counts))
    counts = rng.choice(((1, 1), (1, 1), (2, 1), (1, 2)))
    return Caption(tuple(group(c, 0.8, 0.15) for c in counts), relation=rng.choice(RELATIONS))


# ---------------------------------------------------------------- rendering


def render(caption: str | Caption, seed: int, size: int = 32) -> Image.Image:
    """An RGB ``size`` x ``size`` image that satisfies every fact of ``caption``."""
    parsed = parse_caption(caption)
    return draw_objects(layout(parsed, seed, size), size)


def layout(caption: str | Caption, seed: int, size: int = 32) -> list[PlacedObject]:
    """Where each object of the caption goes (deterministic for caption, seed and size)."""
    if not isinstance(size, int) or not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"image size must be an integer in [{MIN_SIZE}, {MAX_SIZE}], got {size!r}")
    parsed = parse_caption(caption)
    text = format_caption(parsed)
    rng = random.Random(f"render:{seed}:{size}:{zlib.crc32(text.encode())}")
    objects = []
    for gi, g in enumerate(parsed.groups):
        for _ in range(g.count):
            colour = g.colour or rng.choice(list(COLOURS))
            objects.append((gi, g.shape, colour, g.size or "medium"))
    sides = [SIZES[o[3]] * size for o in objects]
    boxes = _place(rng, parsed, [o[0] for o in objects], sides, size)
    return [PlacedObject(gi, shape, colour, sz, box) for (gi, shape, colour, sz), box in zip(objects, boxes)]


def draw_objects(objects: list[PlacedObject], size: int) -> Image.Image:
    big = size * SUPERSAMPLE
    canvas = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for obj in objects:
        x0, y0, x1, y1 = (v * SUPERSAMPLE for v in obj.box)
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            draw.ellipse([x0, y0, x1 - 1, y1 - 1], fill=fill)
        elif obj.shape == "square":
            draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=fill)
        else:  # triangle pointing up, base = height = side
            draw.polygon([((x0 + x1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=fill)
    return canvas.resize((size, size), Image.BOX)


def _place(rng: random.Random, caption: Caption, groups: list[int], sides: list[float], size: int):
    """Random non-overlapping boxes honouring the relation; a 2x2-grid layout if sampling fails."""
    margin, gap = size / 32, 2 * size / 32
    first, second, axis = _relation_sides(caption.relation)
    for _ in range(400):
        split = None
        if axis is not None:
            split = rng.uniform(margin + gap / 2, size - margin - gap / 2)
        boxes = []
        for gi, side in zip(groups, sides):
            lo, hi = [margin, margin], [size - margin - side, size - margin - side]
            if split is not None:
                if gi == first:
                    hi[axis] = split - gap / 2 - side
                else:
                    lo[axis] = split + gap / 2
            if lo[0] > hi[0] or lo[1] > hi[1]:
                break
            x, y = rng.uniform(lo[0], hi[0]), rng.uniform(lo[1], hi[1])
            boxes.append((x, y, x + side, y + side))
        else:
            if _valid(boxes, groups, gap, first, axis):
                return boxes
    return _grid_place(rng, groups, sides, size, margin, gap, first, axis)


def _relation_sides(relation: str | None) -> tuple[int | None, int | None, int | None]:
    """(group that must come first along the axis, the other group, axis 0=x / 1=y)."""
    if relation is None:
        return None, None, None
    return {"left of": (0, 1, 0), "right of": (1, 0, 0), "above": (0, 1, 1), "below": (1, 0, 1)}[relation]


def _valid(boxes, groups, gap, first, axis) -> bool:
    for i, a in enumerate(boxes):
        for j in range(i + 1, len(boxes)):
            b = boxes[j]
            apart = a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]
            if not apart:
                return False
            if axis is not None and groups[i] != groups[j]:
                lead, follow = (a, b) if groups[i] == first else (b, a)
                along = (follow[axis] + follow[axis + 2]) / 2 - (lead[axis] + lead[axis + 2]) / 2
                across = abs(
                    (follow[1 - axis] + follow[3 - axis]) / 2 - (lead[1 - axis] + lead[3 - axis]) / 2
                )
                # the relation must be the dominant direction, not a diagonal
                if lead[axis + 2] + gap > follow[axis] or across > along:
                    return False
    return True


def _grid_place(rng, groups, sides, size, margin, gap, first, axis):
    """Fallback: one object per cell of a 2x2 grid (a lone group member spans its whole column/row)."""
    cell = (size - 2 * margin - gap) / 2
    starts = (margin, margin + cell + gap)
    if axis is None:
        cells = rng.sample([(c, r) for c in range(2) for r in range(2)], len(groups))
        spans = [(starts[c], starts[r], cell, cell) for c, r in cells]
    else:
        spans = []
        for i, gi in enumerate(groups):
            members = [j for j, g in enumerate(groups) if g == gi]
            along = starts[0 if gi == first else 1]
            if len(members) == 1:
                across, length = margin, size - 2 * margin
            else:
                across, length = starts[members.index(i)], cell
            spans.append((along, across, cell, length) if axis == 0 else (across, along, length, cell))
    boxes = []
    for (x0, y0, w, h), side in zip(spans, sides):
        x = x0 + rng.uniform(0, max(0.0, w - side))
        y = y0 + rng.uniform(0, max(0.0, h - side))
        boxes.append((x, y, x + side, y + side))
    return boxes


# ---------------------------------------------------------------- near misses


def applicable_corruptions(caption: str | Caption) -> list[str]:
    """The corruption kinds that can change this caption."""
    parsed = parse_caption(caption)
    kinds = []
    for kind in CORRUPTIONS:
        try:
            _corrupt(random.Random(0), parsed, kind, dry_run=True)
            kinds.append(kind)
        except _NotApplicable:
            pass
    return kinds


def corrupt_caption(caption: str | Caption, seed: int, kind: str | None = None) -> tuple[str, str]:
    """A different valid caption that breaks at least one fact of ``caption``: (text, kind).

    kind: colour (recolour one group), shape (change one group's shape), size (small <-> large),
    drop (remove one object), add (add one object), relation (swap to the opposite relation);
    None picks one of the applicable kinds at random.
    """
    parsed = parse_caption(caption)
    kinds = applicable_corruptions(parsed)
    if kind is not None and kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; valid: {', '.join(CORRUPTIONS)}")
    if kind is not None and kind not in kinds:
        raise ValueError(
            f"corruption {kind!r} does not apply to {format_caption(parsed)!r}; applicable: {', '.join(kinds)}"
        )
    rng = random.Random(f"corrupt:{seed}:{zlib.crc32(format_caption(parsed).encode())}")
    kind = kind or rng.choice(kinds)
    return format_caption(_corrupt(rng, parsed, kind)), kind


def render_mismatched(
    caption: str | Caption, seed: int, kind: str | None = None, size: int = 32
) -> tuple[Image.Image, str, str]:
    """An image of a near-miss scene: (image, the caption it really shows, corruption kind)."""
    wrong, kind = corrupt_caption(caption, seed, kind)
    return render(wrong, seed, size), wrong, kind


class _NotApplicable(Exception):
    pass


def _corrupt(rng: random.Random, caption: Caption, kind: str, dry_run: bool = False) -> Caption:
    """Try the candidate edits of ``kind`` in random order; the first valid caption wins."""
    candidates = list(_candidates(caption, kind))
    rng.shuffle(candidates)
    for make in candidates:
        try:
            return make()
        except ValueError:
            continue
    raise _NotApplicable(kind)


def _candidates(caption: Caption, kind: str):
    groups, rel = list(caption.groups), caption.relation

    def with_group(i, new):
        return lambda: Caption(tuple(groups[:i] + [new] + groups[i + 1 :]), rel)

    for i, g in enumerate(groups):
        if kind == "colour" and g.colour is not None:
            for c in COLOURS:
                if c != g.colour:
                    yield with_group(i, replace(g, colour=c))
        elif kind == "shape":
            for s in SHAPES:
                if s != g.shape:
                    yield with_group(i, replace(g, shape=s))
        elif kind == "size" and g.size is not None:
            yield with_group(i, replace(g, size="large" if g.size == "small" else "small"))
        elif kind == "drop":
            if g.count > 1:
                yield with_group(i, replace(g, count=g.count - 1))
            elif len(groups) > 1:
                rest = tuple(groups[:i] + groups[i + 1 :])
                yield lambda rest=rest: Caption(rest, None)
        elif kind == "add" and caption.num_objects < MAX_OBJECTS:
            yield with_group(i, replace(g, count=g.count + 1))
    if kind == "add" and caption.num_objects < MAX_OBJECTS and rel is None and len(groups) < 3:
        for s in SHAPES:
            for c in COLOURS:
                new = ObjectGroup(s, 1, c if any(g.colour for g in groups) else None)
                yield lambda new=new: Caption(tuple(groups) + (new,), None)
    if kind == "relation" and rel is not None:
        yield lambda: Caption(tuple(groups), OPPOSITE_RELATION[rel])

"""``shapes-oracle``: the exact judge of the shapes testbed, and its degraded variants.

It parses the caption (``rewards.shapes_grammar``), finds the objects in the pixels and returns
the fraction of the caption's facts that hold. For "two red circles left of a blue square":

    object     there is a circle; there is a square; there is nothing else
    attribute  there is a red circle; there is a blue square
    count      exactly 2 red circles; exactly 1 blue square
    spatial    every red circle is left of every blue square

Pixel analysis, robust to blur, darkening and small images (32 px and up): a pixel takes a
palette colour when its direction from the background colour is close to that colour's (and
clearly closer than to any other) and it holds at least half of the colour, so anti-aliased or
blurred edges count by coverage and blends of two colours stay unassigned; connected components
of one colour above a minimum area are objects; an object's shape comes from how its width changes
from top to bottom (triangles taper) and how much of its box and corners it fills (squares fill
them, circles about pi/4); its size class from its colour coverage summed over its surroundings
(blur moves colour around but keeps the sum), converted to a side length for its shape.

Degraded judges (stand-ins for weak and position-biased judges; both 0 = the exact oracle):

    noise=p          compare(): the verdict is replaced by the wrong one with probability p
                     (a tie becomes a random winner); score(): Gaussian noise of std p is added.
    position_bias=q  compare(): with probability q the first image wins whatever it shows.

``raw`` of each Preference says whether a degradation was applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import ndimage

from rewards.base import Judge, Preference, check_pair_counts, preference_from_scores
from rewards.images import Images, num_images
from rewards.shapes_grammar import (
    BACKGROUND,
    CATEGORIES,
    COLOURS,
    SIZES,
    Caption,
    ObjectGroup,
    distinguishable,
    format_group,
    parse_caption,
)

_COLOUR_NAMES = list(COLOURS)
_BG = np.array(BACKGROUND, dtype=np.float32)
# Each colour as a direction away from the background: anti-aliasing, blur and darkening move a
# pixel along that line (its "strength", 1 = the full colour) but keep its direction.
_DIRECTIONS = np.array([COLOURS[c] for c in _COLOUR_NAMES], dtype=np.float32) - _BG
_UNIT = _DIRECTIONS / np.linalg.norm(_DIRECTIONS, axis=1, keepdims=True)
# The closest two palette directions (blue, cyan) are ~24 degrees apart. A pixel takes a colour
# when its direction is within this angle of it ...
MAX_ANGLE_DEG = 15.0
# ... clearly closer to it than to the runner-up (blends of two colours stay unassigned) ...
MAX_ANGLE_RATIO = 0.6
# ... and it holds at least half of the colour (an edge pixel counts when half covered).
MIN_STRENGTH = 0.5
# Smallest object, as a fraction of the image area (a small triangle at 32 px covers ~2.4%).
MIN_AREA_FRACTION = 0.01
# Size class boundaries: half way between the rendered side fractions.
SMALL_BELOW = (SIZES["small"] + SIZES["medium"]) / 2
LARGE_ABOVE = (SIZES["medium"] + SIZES["large"]) / 2
# Shape rules, tuned on renders at 32 and 64 px, sharp, blurred (sigma up to 1.1 px at 32 px)
# and darkened. Triangles taper (bottom rows wider than top rows; sharp: >= 0.5, while a
# pixelated small circle reaches 0.33) ...
TRIANGLE_TAPER = 0.42
TRIANGLE_TAPER_LOW_FILL, TRIANGLE_FILL = 0.2, 0.68  # ... or taper a little and fill little.
CORNER_WEIGHT, SQUARENESS = 0.3, 1.0  # squares: fill + 0.3 * corner fill above 1.
# Area of each shape over the area of its bounding square.
_IDEAL_FILL = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}


@dataclass(frozen=True)
class Detected:
    """An object found in the pixels; box = (x0, y0, x1, y1), x1/y1 exclusive."""

    shape: str
    colour: str
    size: str
    box: tuple[int, int, int, int]
    area: int

    @property
    def centre(self) -> tuple[float, float]:
        return ((self.box[0] + self.box[2]) / 2, (self.box[1] + self.box[3]) / 2)

    def as_dict(self) -> dict:
        return {
            "shape": self.shape,
            "colour": self.colour,
            "size": self.size,
            "box": list(self.box),
            "area": self.area,
        }


# ---------------------------------------------------------------- pixels -> objects


def detect_objects(image: np.ndarray) -> list[Detected]:
    """Objects in an RGB array [H, W, 3] with values in 0..255."""
    pixels = np.asarray(image, dtype=np.float32)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"expected an RGB array [H, W, 3], got shape {pixels.shape}")
    height, width = pixels.shape[:2]
    offset = pixels - _BG
    length = np.linalg.norm(offset, axis=-1, keepdims=True)
    cosine = (offset @ _UNIT.T) / np.maximum(length, 1e-6)
    angles = np.degrees(np.arccos(np.clip(cosine, -1.0, 1.0)))  # [H, W, K]
    two = np.partition(angles, 1, axis=-1)
    nearest = np.argmin(angles, axis=-1)
    strength = np.take_along_axis(offset @ _DIRECTIONS.T, nearest[..., None], -1)[..., 0]
    strength /= np.square(np.linalg.norm(_DIRECTIONS, axis=1))[nearest]
    assigned = (
        (two[..., 0] <= MAX_ANGLE_DEG)
        & (two[..., 0] <= MAX_ANGLE_RATIO * two[..., 1])
        & (strength >= MIN_STRENGTH)
    )
    min_area = max(4, int(MIN_AREA_FRACTION * height * width))
    found = []
    eight = np.ones((3, 3), dtype=bool)
    for k, colour in enumerate(_COLOUR_NAMES):
        mask = assigned & (nearest == k)
        if not mask.any():
            continue
        mask = ndimage.binary_fill_holes(mask)
        labels, _ = ndimage.label(mask, structure=eight)
        for index, slices in enumerate(ndimage.find_objects(labels), start=1):
            component = labels[slices] == index
            if component.sum() < min_area:
                continue
            ys, xs = slices
            box = (xs.start, ys.start, xs.stop, ys.stop)
            area = _coverage_area(pixels, labels, index, box, k, assigned & (nearest != k))
            shape = classify_shape(component)
            found.append(
                Detected(shape, colour, size_class(shape, area, min(height, width)), box, int(round(area)))
            )
    return found


def _coverage_area(pixels, labels, index, box, k, other_colours) -> float:
    """The object's area as the sum of how much of its colour each pixel around it holds (0..1).

    Blur and anti-aliasing spread an object's colour over unassigned edge pixels but keep its
    total, so the summed coverage (unlike the mask's area) barely changes with blur; dividing by
    the core's colour strength also undoes a global darkening.
    """
    height, width = labels.shape
    pad = max(1, round(2 * min(height, width) / 32))
    x0, y0 = max(0, box[0] - pad), max(0, box[1] - pad)
    x1, y1 = min(width, box[2] + pad), min(height, box[3] + pad)
    window = labels[y0:y1, x0:x1]
    component = window == index
    region = ndimage.maximum_filter(component, size=2 * pad + 1)
    region &= ~other_colours[y0:y1, x0:x1] & ((window == 0) | component)
    direction = _DIRECTIONS[k]
    strength = (pixels[y0:y1, x0:x1] - _BG) @ direction / float(direction @ direction)
    core = float(np.median(strength[component]))
    if core <= 0:
        return float(component.sum())
    return float(np.where(region, np.clip(strength / core, 0.0, 1.0), 0.0).astype(np.float32).sum())


def classify_shape(component: np.ndarray) -> str:
    """circle / square / triangle from a boolean mask cropped to its bounding box."""
    h, w = component.shape
    widths = component.sum(axis=1).astype(np.float32)
    band = max(1, int(round(0.3 * h)))
    # Triangles point up: narrow top rows, wide bottom rows (circles and squares: no taper).
    taper = (widths[-band:].mean() - widths[:band].mean()) / max(w, 1)
    fill = component.mean()
    if taper > TRIANGLE_TAPER or (taper > TRIANGLE_TAPER_LOW_FILL and fill < TRIANGLE_FILL):
        return "triangle"
    # Squares fill their box, corners included; circles fill ~pi/4 and leave the corners empty.
    k = max(1, int(round(0.2 * min(h, w))))
    corners = np.concatenate(
        [
            component[:k, :k].ravel(),
            component[:k, -k:].ravel(),
            component[-k:, :k].ravel(),
            component[-k:, -k:].ravel(),
        ]
    ).mean()
    return "square" if fill + CORNER_WEIGHT * corners > SQUARENESS else "circle"


def size_class(shape: str, area: int, image_side: int) -> str:
    """small / medium / large from the side of the shape whose area this is (robust to thin tips)."""
    side = math.sqrt(area / _IDEAL_FILL[shape]) / image_side
    return "small" if side < SMALL_BELOW else "large" if side > LARGE_ABOVE else "medium"


# ---------------------------------------------------------------- caption facts


def _matches(obj: Detected, group: ObjectGroup, use_size: bool) -> bool:
    return (
        obj.shape == group.shape
        and (group.colour is None or obj.colour == group.colour)
        and (not use_size or group.size is None or obj.size == group.size)
    )


def _size_needed(group: ObjectGroup, groups: tuple[ObjectGroup, ...]) -> bool:
    """Count by size only when shape and colour alone cannot tell this group from another
    (sizes are the least reliable property in blurry generations)."""
    if group.size is None:
        return False
    without_size = ObjectGroup(group.shape, 1, group.colour)
    return any(
        other != group and not distinguishable(without_size, ObjectGroup(other.shape, 1, other.colour))
        for other in groups
    )


def _kind(group: ObjectGroup) -> str:
    """'small red circle': the group's words without the count."""
    return " ".join(w for w in (group.size, group.colour, group.shape) if w)


def _relation_holds(a: Detected, b: Detected, relation: str) -> bool:
    (ax, ay), (bx, by) = a.centre, b.centre
    return {"left of": ax < bx, "right of": ax > bx, "above": ay < by, "below": ay > by}[relation]


def check_facts(caption: Caption, objects: list[Detected]) -> list[dict]:
    """Each fact of the caption with whether it holds among the detected objects."""
    facts = []

    def fact(category: str, text: str, holds: bool):
        facts.append({"category": category, "fact": text, "holds": bool(holds)})

    groups = caption.groups
    for shape in dict.fromkeys(g.shape for g in groups):
        fact("object", f"there is a {shape}", any(o.shape == shape for o in objects))
    fact(
        "object",
        "there is nothing else",
        all(any(_matches(o, g, _size_needed(g, groups)) for g in groups) for o in objects),
    )
    for g in groups:
        if g.colour is not None:
            fact(
                "attribute",
                f"there is a {g.colour} {g.shape}",
                any(_matches(o, ObjectGroup(g.shape, 1, g.colour), False) for o in objects),
            )
        if g.size is not None:
            fact(
                "attribute",
                f"there is a {_kind(g)}",
                any(_matches(o, g, True) for o in objects),
            )
    members = [[o for o in objects if _matches(o, g, _size_needed(g, groups))] for g in groups]
    for g, found in zip(groups, members):
        counted = g if _size_needed(g, groups) else ObjectGroup(g.shape, 1, g.colour)
        fact("count", f"exactly {g.count} x {_kind(counted)}", len(found) == g.count)
    if caption.relation is not None:
        first, second = members
        holds = bool(first and second) and all(
            _relation_holds(a, b, caption.relation) for a in first for b in second
        )
        fact("spatial", f"{format_group(groups[0])} {caption.relation} {format_group(groups[1])}", holds)
    return facts


def summarise(facts: list[dict]) -> dict:
    """Per category: facts checked, facts held."""
    out = {}
    for category in CATEGORIES:
        mine = [f for f in facts if f["category"] == category]
        if mine:
            out[category] = {"checked": len(mine), "held": sum(f["holds"] for f in mine)}
    return out


# ---------------------------------------------------------------- the judge


def _as_arrays(images: Images) -> list[np.ndarray]:
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(
                f"expected an image tensor [N, 3, H, W] in [0, 1], got shape {tuple(images.shape)}"
            )
        arr = images.detach().float().clamp(0, 1).mul(255).permute(0, 2, 3, 1).cpu().numpy()
        return list(arr)
    return [np.asarray(img.convert("RGB"), dtype=np.float32) for img in images]


@dataclass
class ShapesOracle(Judge):
    """Fraction of the caption's facts that hold in the image (1.0 = all of them).

    noise: probability of a wrong pairwise verdict, and std of Gaussian noise on scores.
    position_bias: probability that compare() prefers the first image regardless.
    seed: seeds the noise so a degraded judge is reproducible.
    """

    name: str = "shapes-oracle"
    noise: float = 0.0
    position_bias: float = 0.0
    seed: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        for option in ("noise", "position_bias"):
            value = getattr(self, option)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"shapes-oracle option {option} must be a number in [0, 1], got {value!r}")
        self._rng = np.random.default_rng(self.seed)
        # A position bias exists only when two images are shown at once: make the trainers ask compare().
        self.pairwise_native = bool(self.position_bias)
        if self.name == "shapes-oracle" and (self.noise or self.position_bias):
            opts = [f"{k}={getattr(self, k)}" for k in ("noise", "position_bias") if getattr(self, k)]
            self.name = f"shapes-oracle[{','.join(opts)}]"

    @property
    def exact(self) -> bool:
        return not self.noise and not self.position_bias

    def check_prompts_supported(self, prompts: list[str]) -> None:
        for i, prompt in enumerate(prompts):
            try:
                parse_caption(prompt)
            except ValueError as err:
                raise ValueError(f"shapes-oracle cannot judge prompt {i} ({prompt[:60]!r}): {err}") from None

    def score_with_details(self, prompts: list[str], images: Images) -> tuple[torch.Tensor, list[dict]]:
        """Exact scores (no noise) and, per image, the facts checked and the objects detected."""
        if num_images(images) != len(prompts):
            raise ValueError(
                f"need one prompt per image: got {len(prompts)} prompts and {num_images(images)} images"
            )
        captions = []
        for i, prompt in enumerate(prompts):
            try:
                captions.append(parse_caption(prompt))
            except ValueError as err:
                raise ValueError(f"shapes-oracle cannot judge prompt {i}: {err}") from err
        scores, details = [], []
        for caption, pixels in zip(captions, _as_arrays(images)):
            objects = detect_objects(pixels)
            facts = check_facts(caption, objects)
            value = sum(f["holds"] for f in facts) / len(facts)
            scores.append(value)
            details.append(
                {
                    "score": value,
                    "category": caption.category,
                    "by_category": summarise(facts),
                    "facts": facts,
                    "objects": [o.as_dict() for o in objects],
                }
            )
        return torch.tensor(scores, dtype=torch.float32), details

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        scores, _ = self.score_with_details(prompts, images)
        if self.noise:
            scores = scores + torch.from_numpy(self._rng.normal(0.0, self.noise, len(scores))).float()
        return scores

    def compare(self, prompts: list[str], images_a: Images, images_b: Images) -> list[Preference]:
        check_pair_counts(prompts, images_a, images_b)
        scores_a, details_a = self.score_with_details(prompts, images_a)
        scores_b, details_b = self.score_with_details(prompts, images_b)
        out = []
        for sa, sb, da, db in zip(scores_a.tolist(), scores_b.tolist(), details_a, details_b):
            exact = preference_from_scores(sa, sb, self.tie_margin)
            raw = {
                "score_a": sa,
                "score_b": sb,
                "by_category_a": da["by_category"],
                "by_category_b": db["by_category"],
                "exact_winner": exact.winner,
                "position_bias_applied": False,
                "flipped": False,
            }
            pref = Preference(exact.prob_a, tie=exact.tie, raw=raw)
            if self.position_bias and self._rng.random() < self.position_bias:
                raw["position_bias_applied"] = True
                pref = Preference(1.0, raw=raw)
            elif self.noise and self._rng.random() < self.noise:
                raw["flipped"] = True
                if exact.tie:
                    pref = Preference(float(self._rng.integers(0, 2)), raw=raw)
                else:
                    pref = Preference(1.0 - exact.prob_a, raw=raw)
            out.append(pref)
        return out


def oracle_score(prompt: str, image) -> float:
    """Convenience: the exact oracle score of one image (PIL or [3, H, W] tensor)."""
    images = image[None] if isinstance(image, torch.Tensor) else [image]
    scores, _ = ShapesOracle().score_with_details([prompt], images)
    return float(scores[0])

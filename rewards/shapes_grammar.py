"""The caption grammar of the shapes testbed: vocabulary, parsed captions, parse and format.

A caption names one to three groups of coloured shapes (at most three objects in all) and,
for two groups, optionally a spatial relation between them::

    a circle                                        object
    a small red circle and a blue square            attribute (colour, size)
    two green triangles                             count
    two red circles left of a blue square           spatial (groups[0] <relation> groups[1])
    a red circle, a blue square and a green triangle

Grammar (case and surrounding spaces are ignored, a final full stop is allowed)::

    caption  := group
              | group " and " group
              | group ", " group " and " group
              | group " " relation " " group
    group    := count [size] [colour] shape["s" when count > 1]
    count    := "a" | "one" | "two" | "three"
    size     := "small" | "large"
    relation := "left of" | "right of" | "above" | "below"
                (also read: "to the left of", "on the left of", ... ; written as the short form)

Groups of one caption must be distinguishable: they differ in shape, or both name a colour and
the colours differ, or both name a size and the sizes differ. This module is pure (no images)
and is shared by the oracle (``rewards.shapes``) and the scene renderer (``align.testbed``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")

# Well separated in RGB (smallest distance between two entries, background included, ~120),
# so the oracle can tell them apart in blurry generations. Background is black.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (240, 230, 50),
    "purple": (160, 50, 200),
    "cyan": (40, 200, 220),
}
BACKGROUND: tuple[int, int, int] = (0, 0, 0)

# Object side length as a fraction of the image side; "medium" is what an unsized group gets.
SIZES: dict[str, float] = {"small": 0.22, "medium": 0.31, "large": 0.40}
SIZE_WORDS: tuple[str, ...] = ("small", "large")

COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three"}
MAX_OBJECTS = 3

RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
OPPOSITE_RELATION: dict[str, str] = {
    "left of": "right of",
    "right of": "left of",
    "above": "below",
    "below": "above",
}

# MJ-Bench's alignment categories that the testbed covers (it has no "action").
CATEGORIES: tuple[str, ...] = ("object", "attribute", "count", "spatial")


@dataclass(frozen=True)
class ObjectGroup:
    """``count`` objects of one kind; ``colour`` / ``size`` are None when the caption leaves them open."""

    shape: str
    count: int = 1
    colour: str | None = None
    size: str | None = None

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; valid shapes: {', '.join(SHAPES)}")
        if self.count not in COUNT_WORDS:
            raise ValueError(f"count must be 1, 2 or 3, got {self.count!r}")
        if self.colour is not None and self.colour not in COLOURS:
            raise ValueError(f"unknown colour {self.colour!r}; valid colours: {', '.join(COLOURS)}")
        if self.size is not None and self.size not in SIZE_WORDS:
            raise ValueError(f"unknown size {self.size!r}; valid sizes: {', '.join(SIZE_WORDS)}")


@dataclass(frozen=True)
class Caption:
    """A parsed caption: groups of objects and an optional relation ``groups[0] <relation> groups[1]``."""

    groups: tuple[ObjectGroup, ...]
    relation: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        if not 1 <= len(self.groups) <= 3:
            raise ValueError(f"a caption has 1 to 3 object groups, got {len(self.groups)}")
        total = sum(g.count for g in self.groups)
        if total > MAX_OBJECTS:
            raise ValueError(f"a caption names at most {MAX_OBJECTS} objects, got {total}")
        if self.relation is not None:
            if self.relation not in RELATIONS:
                raise ValueError(
                    f"unknown relation {self.relation!r}; valid relations: {', '.join(RELATIONS)}"
                )
            if len(self.groups) != 2:
                raise ValueError(f"a relation links exactly 2 groups, got {len(self.groups)}")
        for i, a in enumerate(self.groups):
            for b in self.groups[i + 1 :]:
                if not distinguishable(a, b):
                    raise ValueError(
                        f"groups {format_group(a)!r} and {format_group(b)!r} cannot be told apart; "
                        "groups must differ in shape, in colour or in size"
                    )

    @property
    def num_objects(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def category(self) -> str:
        """The most specific category present: spatial > count > attribute > object."""
        if self.relation is not None:
            return "spatial"
        if any(g.count > 1 for g in self.groups):
            return "count"
        if any(g.colour is not None or g.size is not None for g in self.groups):
            return "attribute"
        return "object"

    def __str__(self) -> str:
        return format_caption(self)


def distinguishable(a: ObjectGroup, b: ObjectGroup) -> bool:
    """True when no object can match both group descriptions."""
    if a.shape != b.shape:
        return True
    if a.colour is not None and b.colour is not None and a.colour != b.colour:
        return True
    return a.size is not None and b.size is not None and a.size != b.size


def format_group(group: ObjectGroup) -> str:
    words = [COUNT_WORDS[group.count]]
    if group.size is not None:
        words.append(group.size)
    if group.colour is not None:
        words.append(group.colour)
    words.append(group.shape + ("s" if group.count > 1 else ""))
    return " ".join(words)


def format_caption(caption: Caption) -> str:
    """The canonical text of a caption (``parse_caption(format_caption(c)) == c``)."""
    parts = [format_group(g) for g in caption.groups]
    if caption.relation is not None:
        return f"{parts[0]} {caption.relation} {parts[1]}"
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


_COUNT_BY_WORD = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
_RELATION_PHRASES = {
    "to the left of": "left of",
    "on the left of": "left of",
    "left of": "left of",
    "to the right of": "right of",
    "on the right of": "right of",
    "right of": "right of",
    "above": "above",
    "below": "below",
}
# Longest phrases first so "to the left of" wins over "left of".
_RELATION_RE = re.compile(
    r"\s(" + "|".join(re.escape(p) for p in sorted(_RELATION_PHRASES, key=len, reverse=True)) + r")\s"
)
_GROUP_RE = re.compile(
    r"^(?P<count>a|an|one|two|three)"
    r"(?:\s+(?P<size>" + "|".join(SIZE_WORDS) + r"))?"
    r"(?:\s+(?P<colour>" + "|".join(COLOURS) + r"))?"
    r"\s+(?P<shape>" + "|".join(SHAPES) + r")(?P<plural>s?)$"
)


class CaptionError(ValueError):
    """Text that is not a caption of the shapes testbed."""


def parse_caption(text: str) -> Caption:
    """Parse a caption of the shapes grammar, or raise CaptionError saying what is wrong."""
    if isinstance(text, Caption):
        return text
    if not isinstance(text, str):
        raise CaptionError(f"a caption must be a string, got {type(text).__name__}")
    norm = " ".join(text.strip().lower().split()).rstrip(".").strip()
    if not norm:
        raise CaptionError("empty caption; expected e.g. 'two red circles left of a blue square'")
    try:
        relation_match = _RELATION_RE.search(f" {norm} ")
        if relation_match:
            start, end = relation_match.span()
            padded = f" {norm} "
            left, right = padded[:start].strip(), padded[end:].strip()
            return Caption(
                (_parse_group(left, text), _parse_group(right, text)),
                relation=_RELATION_PHRASES[relation_match.group(1)],
            )
        head, sep, last = norm.rpartition(" and ")
        pieces = [p.strip() for p in head.split(",")] + [last] if sep else [norm]
        pieces = [p for p in pieces if p]  # "a, b, and c" (serial comma) leaves an empty piece
        return Caption(tuple(_parse_group(p, text) for p in pieces))
    except CaptionError:
        raise
    except ValueError as err:
        raise CaptionError(f"invalid caption {text!r}: {err}") from err


def _parse_group(phrase: str, text: str) -> ObjectGroup:
    match = _GROUP_RE.match(phrase)
    if not match:
        raise CaptionError(
            f"cannot parse {phrase!r} in caption {text!r}; a group reads "
            f"'<a|one|two|three> [small|large] [{'|'.join(COLOURS)}] <{'|'.join(SHAPES)}>[s]', "
            f"groups are joined by ',' / 'and' or one of the relations {', '.join(RELATIONS)}"
        )
    count = _COUNT_BY_WORD[match.group("count")]
    plural = bool(match.group("plural"))
    if plural != (count > 1):
        word = "plural" if count > 1 else "singular"
        raise CaptionError(f"{phrase!r} in caption {text!r}: count {count} needs the {word} shape name")
    return ObjectGroup(
        shape=match.group("shape"), count=count, colour=match.group("colour"), size=match.group("size")
    )

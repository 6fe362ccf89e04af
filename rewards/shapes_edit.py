"""The editing world of the shapes testbed: scenes on a 3 x 3 grid, instructions, and what an instruction makes.

A scene is one to three small shapes, each in its own cell of a 3 x 3 grid, no two of the same colour and shape::

    shapes:red circle 0,1;blue square 2,2          (colour shape column,row; columns left to right, rows top down)

Instructions (the object named by its shape when the scene has one of that shape, else by colour and shape)::

    make the red circle blue                       recolour
    move the square to the left                    move one cell: to the left / to the right / up / down
    remove the triangle                            remove

The scene spec is the source reference of an edit prompt (``rewards.edit_prompts``): the source image is drawn from
it (``render_scene``), exactly, by every judge and model family that needs it. Drawing follows the shapes testbed's
style (black background, flat palette colours, 4x supersampling with box downsampling); an object is a square box of
``OBJECT_SIDE`` of the image side centred in its cell. Pure except for ``render_scene`` (PIL).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace

from PIL import Image, ImageDraw

from rewards.shapes_grammar import BACKGROUND, COLOURS, SHAPES

SCENE_SCHEME = "shapes:"
GRID = 3
OBJECT_SIDE = 0.26  # of the image side: a 2 px gap between neighbours at 32 px, and the SD testbed VAE keeps them (0.96 of perfect)
SUPERSAMPLE = 4
EDIT_KINDS: tuple[str, ...] = ("recolour", "move", "remove")
DIRECTIONS: dict[str, tuple[int, int]] = {"to the left": (-1, 0), "to the right": (1, 0), "up": (0, -1), "down": (0, 1)}
MAX_OBJECTS = 3


class EditError(ValueError):
    pass


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    col: int
    row: int

    @property
    def cell(self) -> tuple[int, int]:
        return (self.col, self.row)


Scene = tuple[SceneObject, ...]


@dataclass(frozen=True)
class Instruction:
    kind: str  # recolour / move / remove
    target: SceneObject
    colour: str | None = None  # recolour: the new colour
    direction: str | None = None  # move: a key of DIRECTIONS


# ---------------------------------------------------------------- scenes


def format_scene(scene: Scene) -> str:
    return SCENE_SCHEME + ";".join(f"{o.colour} {o.shape} {o.col},{o.row}" for o in scene)


_OBJECT_RE = re.compile(r"^\s*([a-z]+) ([a-z]+) (\d),(\d)\s*$")


def parse_scene(spec: str) -> Scene:
    """The scene of a ``shapes:`` spec; EditError naming what is wrong."""
    if not spec.startswith(SCENE_SCHEME):
        raise EditError(f"a scene spec starts with {SCENE_SCHEME!r}, got {spec[:40]!r}")
    objects = []
    for part in spec[len(SCENE_SCHEME):].split(";"):
        match = _OBJECT_RE.match(part)
        if not match:
            raise EditError(f"scene object {part!r} is not 'colour shape column,row' (e.g. 'red circle 0,1')")
        colour, shape, col, row = match.group(1), match.group(2), int(match.group(3)), int(match.group(4))
        if colour not in COLOURS or shape not in SHAPES or not (0 <= col < GRID and 0 <= row < GRID):
            raise EditError(f"scene object {part!r}: colours {', '.join(COLOURS)}; shapes {', '.join(SHAPES)}; "
                            f"cells 0..{GRID - 1}")
        objects.append(SceneObject(shape, colour, col, row))
    check_scene(tuple(objects))
    return tuple(objects)


def check_scene(scene: Scene) -> None:
    if not 1 <= len(scene) <= MAX_OBJECTS:
        raise EditError(f"a scene holds 1 to {MAX_OBJECTS} objects, got {len(scene)}")
    if len({o.cell for o in scene}) != len(scene) or len({(o.colour, o.shape) for o in scene}) != len(scene):
        raise EditError("a scene's objects each have their own cell and their own colour and shape")


def object_box(obj: SceneObject, size: int) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) in pixels: a square of OBJECT_SIDE x size centred in the object's cell."""
    cell, side = size / GRID, OBJECT_SIDE * size
    cx, cy = (obj.col + 0.5) * cell, (obj.row + 0.5) * cell
    return (cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2)


def render_scene(scene: Scene | str, size: int = 32) -> Image.Image:
    """The scene as an RGB ``size`` x ``size`` image (deterministic)."""
    scene = parse_scene(scene) if isinstance(scene, str) else scene
    big = size * SUPERSAMPLE
    canvas = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for obj in scene:
        x0, y0, x1, y1 = (v * SUPERSAMPLE for v in object_box(obj, size))
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            draw.ellipse([x0, y0, x1 - 1, y1 - 1], fill=fill)
        elif obj.shape == "square":
            draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=fill)
        else:  # an upward triangle, base = height = side
            draw.polygon([((x0 + x1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=fill)
    return canvas.resize((size, size), Image.BOX)


def cell_of(x: float, y: float, size: int) -> tuple[int, int]:
    """The grid cell holding the pixel position (x, y) of a ``size`` image."""
    cell = size / GRID
    return (min(GRID - 1, max(0, int(x // cell))), min(GRID - 1, max(0, int(y // cell))))


# ---------------------------------------------------------------- instructions


def reference(obj: SceneObject, scene: Scene) -> str:
    """How an instruction names ``obj``: "the circle" when it is the scene's only circle, else "the red circle"."""
    alone = sum(o.shape == obj.shape for o in scene) == 1
    return f"the {obj.shape}" if alone else f"the {obj.colour} {obj.shape}"


def format_instruction(instruction: Instruction, scene: Scene) -> str:
    name = reference(instruction.target, scene)
    if instruction.kind == "recolour":
        return f"make {name} {instruction.colour}"
    if instruction.kind == "move":
        return f"move {name} {instruction.direction}"
    return f"remove {name}"


_COLOUR = "|".join(COLOURS)
_SHAPE = "|".join(SHAPES)
_NAME = rf"the (?:(?P<colour>{_COLOUR}) )?(?P<shape>{_SHAPE})"
_INSTRUCTION_RES = {
    "recolour": re.compile(rf"^make {_NAME} (?P<new>{_COLOUR})$"),
    "move": re.compile(rf"^move {_NAME} (?P<direction>{'|'.join(DIRECTIONS)})$"),
    "remove": re.compile(rf"^remove {_NAME}$"),
}


def parse_instruction(text: str, scene: Scene) -> Instruction:
    """The instruction ``text`` on ``scene``; EditError when it does not parse or names no single object."""
    cleaned = " ".join(text.lower().strip().rstrip(".").split())
    for kind, pattern in _INSTRUCTION_RES.items():
        match = pattern.match(cleaned)
        if match is None:
            continue
        named = [o for o in scene if o.shape == match.group("shape")
                 and match.group("colour") in (None, o.colour)]
        if len(named) != 1:
            raise EditError(f"instruction {text!r} names {len(named)} objects of the scene, not one")
        groups = match.groupdict()
        return Instruction(kind, named[0], colour=groups.get("new"), direction=groups.get("direction"))
    raise EditError(f"instruction {text!r} is none of 'make the <colour> <shape> <colour>', "
                    f"'move the <shape> {'/'.join(DIRECTIONS)}', 'remove the <shape>'")


def apply_instruction(scene: Scene, instruction: Instruction) -> Scene:
    """The scene the instruction asks for; EditError when it cannot be done (a move off the grid or onto an object)."""
    target = instruction.target
    if instruction.kind == "remove":
        if len(scene) == 1:
            raise EditError("removing the only object leaves an empty scene")
        return tuple(o for o in scene if o != target)
    if instruction.kind == "recolour":
        changed = replace(target, colour=instruction.colour)
    else:
        dx, dy = DIRECTIONS[instruction.direction]
        changed = replace(target, col=target.col + dx, row=target.row + dy)
        if not (0 <= changed.col < GRID and 0 <= changed.row < GRID):
            raise EditError(f"moving {target.shape} {instruction.direction} leaves the grid")
    result = tuple(changed if o == target else o for o in scene)
    check_scene(result)
    return result


def possible_instructions(scene: Scene) -> list[Instruction]:
    """Every instruction that can be done on ``scene``."""
    out = []
    for target in scene:
        candidates = [Instruction("recolour", target, colour=c) for c in COLOURS if c != target.colour]
        candidates += [Instruction("move", target, direction=d) for d in DIRECTIONS]
        candidates += [Instruction("remove", target)]
        for instruction in candidates:
            try:
                apply_instruction(scene, instruction)
            except EditError:
                continue
            out.append(instruction)
    return out


def sample_scene(rng: random.Random) -> Scene:
    while True:
        count = rng.choice((1, 2, 2, 3, 3))
        cells = rng.sample([(c, r) for c in range(GRID) for r in range(GRID)], count)
        scene = tuple(SceneObject(rng.choice(SHAPES), rng.choice(list(COLOURS)), c, r) for c, r in cells)
        try:
            check_scene(scene)
        except EditError:
            continue
        return scene


def sample_edit(rng: random.Random) -> tuple[Scene, Instruction]:
    """A random scene and an instruction on it: the kind first (uniform), then among that kind's possible ones."""
    while True:
        scene = sample_scene(rng)
        possible = possible_instructions(scene)
        kind = rng.choice(EDIT_KINDS)
        of_kind = [i for i in possible if i.kind == kind]
        if of_kind:
            return scene, rng.choice(of_kind)

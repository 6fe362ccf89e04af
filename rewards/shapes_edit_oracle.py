"""``shapes-edit-oracle``: the exact judge of the shapes editing world (``rewards.shapes_edit``).

For an edit prompt ``[source: shapes:<scene>] <instruction>`` it knows the source scene and the scene the
instruction asks for, finds the objects in the edited image (``rewards.shapes.detect_objects``, each placed in its
grid cell by its centre) and checks:

    edit       recolour: the object, in its cell, has the new colour and not the old one
               move: the object is in the new cell and no longer in the old one
               remove: no object of that colour and shape is left
    kept       each other object of the scene is still there: same colour, shape and cell (one fact each)
    nothing    every object found is one the instruction asks for (nothing added, duplicated or left behind)

score = (edit + mean(kept facts and "nothing")) / 2: half for doing the instruction, half for changing nothing else.
The source image itself scores 0.5 (every kept fact and "nothing" hold, except a move's left-behind object; the edit
does not), a perfect edit 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rewards.base import Judge
from rewards.edit_prompts import require_edit_prompt
from rewards.images import Images, num_images
from rewards.shapes import _as_arrays, detect_objects
from rewards.shapes_edit import (
    EditError,
    Instruction,
    Scene,
    apply_instruction,
    cell_of,
    parse_instruction,
    parse_scene,
)


def parse_edit(prompt: str) -> tuple[Scene, Instruction, Scene]:
    """(source scene, instruction, the scene asked for) of a shapes edit prompt; ValueError naming the problem."""
    edit = require_edit_prompt(prompt, "shapes-edit-oracle")
    scene = parse_scene(edit.source)
    instruction = parse_instruction(edit.instruction, scene)
    return scene, instruction, apply_instruction(scene, instruction)


def found_objects(pixels) -> list[tuple[str, str, tuple[int, int]]]:
    """(colour, shape, cell) of every object detected in an RGB array."""
    size = min(pixels.shape[:2])
    return [(o.colour, o.shape, cell_of(*o.centre, size)) for o in detect_objects(pixels)]


def edit_facts(scene: Scene, instruction: Instruction, expected: Scene, found) -> dict:
    """The facts of one edited image: {"edit": bool, "kept": [bool per other object], "nothing_else": bool}."""
    target = instruction.target
    present = set(found)
    if instruction.kind == "remove":
        done = not any((c, s) == (target.colour, target.shape) for c, s, _ in found)
        changed = None
    elif instruction.kind == "recolour":
        done = ((instruction.colour, target.shape, target.cell) in present
                and (target.colour, target.shape, target.cell) not in present)
        changed = (instruction.colour, target.shape, target.cell)
    else:
        new = next(o for o in expected if (o.colour, o.shape) == (target.colour, target.shape))
        done = (target.colour, target.shape, new.cell) in present and (target.colour, target.shape, target.cell) not in present
        changed = (target.colour, target.shape, new.cell)
    wanted = [(o.colour, o.shape, o.cell) for o in expected]
    kept = [w in present for w in wanted if w != changed]
    nothing_else = len(found) == len(wanted) and present == set(wanted)
    return {"edit": bool(done), "kept": kept, "nothing_else": bool(nothing_else)}


def edit_score(facts: dict) -> float:
    preserved = facts["kept"] + [facts["nothing_else"]]
    return 0.5 * float(facts["edit"]) + 0.5 * sum(preserved) / len(preserved)


@dataclass
class ShapesEditOracle(Judge):
    """The exact score of an edit of the shapes editing world (module docstring)."""

    name: str = "shapes-edit-oracle"
    judges_edits = True

    def check_prompts_supported(self, prompts: list[str]) -> None:
        for i, prompt in enumerate(prompts):
            try:
                parse_edit(prompt)
            except (ValueError, EditError) as err:
                raise ValueError(f"shapes-edit-oracle cannot judge prompt {i} ({prompt[:80]!r}): {err}") from None

    def score_with_details(self, prompts: list[str], images: Images) -> tuple[torch.Tensor, list[dict]]:
        if num_images(images) != len(prompts):
            raise ValueError(f"need one prompt per image: got {len(prompts)} prompts and {num_images(images)} images")
        edits = [parse_edit(p) for p in prompts]
        scores, details = [], []
        for (scene, instruction, expected), pixels in zip(edits, _as_arrays(images)):
            found = found_objects(pixels)
            facts = edit_facts(scene, instruction, expected, found)
            scores.append(edit_score(facts))
            details.append({"score": scores[-1], "kind": instruction.kind, **facts,
                            "objects": [{"colour": c, "shape": s, "cell": list(cell)} for c, s, cell in found]})
        return torch.tensor(scores, dtype=torch.float32), details

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        return self.score_with_details(prompts, images)[0]

"""What an edit changed outside the edit: the mean absolute pixel change between the source image and the edited one
over the pixels the instruction does not concern (0 = untouched, in [0, 1] units).

For the shapes editing world the region an instruction concerns is known exactly: the grid cells of the object it
names (its cell, and for a move the cell it goes to). For any other edit no region is known and the change is
measured over the whole image (an upper bound: it includes the edit itself); the report says which.
"""

from __future__ import annotations

import numpy as np
import torch

from align.metrics import mean_and_sem
from rewards.edit_prompts import load_source, parse_edit_prompt
from rewards.shapes_edit import (
    GRID,
    SCENE_SCHEME,
    EditError,
    apply_instruction,
    parse_instruction,
    parse_scene,
)

WHOLE_IMAGE = "whole image (no edit region known)"
INSTRUCTION_CELLS = "outside the instruction's cells"


def edit_region(prompt: str, size: int) -> np.ndarray | None:
    """[size, size] bool: the pixels a shapes-world instruction concerns; None when the region is unknown."""
    edit = parse_edit_prompt(prompt)
    if edit is None or not edit.source.startswith(SCENE_SCHEME):
        return None
    try:
        scene = parse_scene(edit.source)
        instruction = parse_instruction(edit.instruction, scene)
        result = apply_instruction(scene, instruction)
    except EditError:
        return None
    moved = [o.cell for o in result if (o.colour, o.shape) == (instruction.target.colour, instruction.target.shape)]
    mask = np.zeros((size, size), dtype=bool)
    edges = np.linspace(0, size, GRID + 1).round().astype(int)
    for col, row in {instruction.target.cell, *moved}:
        mask[edges[row]: edges[row + 1], edges[col]: edges[col + 1]] = True
    return mask


def change_outside_edit(prompts: list[str], images: torch.Tensor) -> tuple[np.ndarray, str] | None:
    """(per-image mean |edited - source| outside the edit region, what region that is); None without edit prompts."""
    if not any(parse_edit_prompt(p) for p in prompts):
        return None
    size = images.shape[-1]
    values, regions = [], set()
    for prompt, image in zip(prompts, images):
        source = torch.from_numpy(np.asarray(load_source(parse_edit_prompt(prompt).source, size), dtype=np.float32) / 255)
        difference = (image.float().permute(1, 2, 0).cpu() - source).abs().mean(dim=-1).numpy()
        mask = edit_region(prompt, size)
        regions.add(WHOLE_IMAGE if mask is None else INSTRUCTION_CELLS)
        keep = np.ones_like(difference, dtype=bool) if mask is None else ~mask
        values.append(float(difference[keep].mean()))
    return np.asarray(values), (INSTRUCTION_CELLS if regions == {INSTRUCTION_CELLS} else WHOLE_IMAGE)


def edit_change_table(prompts: list[str], images: dict, names: list[str]) -> dict:
    """{model: {"mean", "sem", "region"}} of the change outside the edit; {} when the prompts are not edits."""
    out = {}
    for name in names:
        measured = change_outside_edit(prompts, images[name])
        if measured is None:
            return {}
        mean, sem = mean_and_sem(measured[0])
        out[name] = {"mean": mean, "sem": sem, "region": measured[1]}
    return out

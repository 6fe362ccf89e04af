"""The editing testbed's prompts: edit prompts of the shapes editing world (``rewards.shapes_edit``), as prompt sets.

    testbed-edit:<count>[:<seed>]     count edit prompts drawn with seed, e.g. testbed-edit:512:1

Each is ``[source: shapes:<scene>] <instruction>`` (``rewards.edit_prompts``): the source scene is in the prompt,
so the model family draws the source image and the oracle knows the scene exactly. The held-out evaluation draws
from its own seeds (the configs use 4242 and up; the bundled model was built on seed 0's stream, from which the
held-out prompts of ``EVAL_SEED`` are removed).
"""

from __future__ import annotations

import functools
import random

import numpy as np
import torch

from rewards.edit_prompts import edit_prompt, parse_edit_prompt
from rewards.shapes_edit import (
    apply_instruction,
    format_instruction,
    format_scene,
    parse_instruction,
    parse_scene,
    possible_instructions,
    render_scene,
    sample_edit,
)

EDIT_SET_PREFIX = "testbed-edit:"
MAX_EDIT_PROMPTS = 100_000
EVAL_SEED = 4242  # the held-out prompts the bundled model's build leaves out of its training edits
EVAL_POOL = 2000  # the held-out edits: the first EVAL_POOL of EVAL_SEED's stream (the build's --held-out)


def sample_edit_prompts(n: int, seed: int) -> list[str]:
    """``n`` edit prompts of the shapes editing world, drawn with ``seed`` (deterministic). Every seed but
    ``EVAL_SEED`` skips the held-out edits (the first ``EVAL_POOL`` of ``EVAL_SEED``'s stream), so no training set
    shares an edit prompt with a held-out set ``testbed-edit:<n <= EVAL_POOL>:4242``."""
    held_out = held_out_edits() if seed != EVAL_SEED else frozenset()
    rng = random.Random(f"edits:{seed}")
    prompts: list[str] = []
    while len(prompts) < n:
        scene, instruction = sample_edit(rng)
        prompt = edit_prompt(format_scene(scene), format_instruction(instruction, scene))
        if prompt not in held_out:
            prompts.append(prompt)
    return prompts


@functools.cache
def held_out_edits() -> frozenset[str]:
    return frozenset(sample_edit_prompts(EVAL_POOL, EVAL_SEED))


def edit_kind(prompt: str) -> str:
    """recolour / move / remove of a testbed edit prompt (its category in reports)."""
    return prompt.split("] ", 1)[1].split(" ", 1)[0].replace("make", "recolour")


def parse_edit_set(spec: str) -> tuple[int, int]:
    """(count, seed) of ``testbed-edit:<count>[:<seed>]``; ValueError with the valid form."""
    parts = spec[len(EDIT_SET_PREFIX):].split(":")
    try:
        count, seed = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except (ValueError, IndexError):
        raise ValueError(f"prompt set {spec!r} must be {EDIT_SET_PREFIX}<count>[:<seed>]") from None
    if len(parts) > 2 or not 1 <= count <= MAX_EDIT_PROMPTS or not 0 <= seed < 2**32:
        raise ValueError(f"prompt set {spec!r}: {EDIT_SET_PREFIX}<count>[:<seed>] with the count in "
                         f"[1, {MAX_EDIT_PROMPTS:,}] and the seed in [0, {2**32 - 1}]")
    return count, seed


def wrong_instruction(prompt: str, rng: random.Random) -> str:
    """Another instruction on the same source (edit noise for the build: the model follows its instruction only part
    of the time, as the SD testbed's caption noise does)."""
    edit = parse_edit_prompt(prompt)
    scene = parse_scene(edit.source)
    asked = parse_instruction(edit.instruction, scene)
    others = [i for i in possible_instructions(scene) if i != asked]
    return edit_prompt(edit.source, format_instruction(rng.choice(others), scene)) if others else prompt


def target_scene_image(prompt: str, size: int = 32):
    """The image the instruction asks for (the ground truth of a testbed edit)."""
    edit = parse_edit_prompt(prompt)
    scene = parse_scene(edit.source)
    return render_scene(apply_instruction(scene, parse_instruction(edit.instruction, scene)), size)


def images_tensor(images) -> torch.Tensor:
    """PIL images as [N, 3, H, W] in [-1, 1]."""
    arrays = np.stack([np.asarray(image, dtype=np.float32) / 127.5 - 1.0 for image in images])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()

"""What the instruction-editing families share: their prompts are edit prompts (``rewards.edit_prompts``: an
instruction and its source image in one string), the source image is loaded at the run's resolution and becomes
conditioning (its latents, batch-first like every other conditioning tensor), and the unconditional side keeps the
source (the empty instruction on the same image, as the editing pipelines' negative prompts do)."""

from __future__ import annotations

import numpy as np
import torch

from rewards.edit_prompts import load_source, parse_edit_prompt

SOURCE_KEY = "source_latents"  # the conditioning tensor of the source images' latents


def split_edit_prompts(prompts: list[str], title: str) -> tuple[list[str], list[str] | None]:
    """(instructions, sources) of a batch of edit prompts; (prompts, None) for a batch of plain prompts (the empty
    instruction of the unconditional side). A batch mixing the two is refused in one line."""
    parsed = [parse_edit_prompt(p) for p in prompts]
    if all(p is None for p in parsed):
        return list(prompts), None
    if any(p is None for p in parsed):
        plain = next(prompts[i] for i, p in enumerate(parsed) if p is None)
        raise ValueError(f"{title} edits: every prompt of a batch is '[source: <image>] <instruction>', got {plain[:60]!r}")
    return [p.instruction for p in parsed], [p.source for p in parsed]


def source_images(sources: list[str], resolution: int) -> list:
    """The source images as square RGB PIL images of side ``resolution``."""
    return [load_source(source, resolution) for source in sources]


def pixels_of(images: list) -> torch.Tensor:
    """PIL images as one tensor [N, 3, H, W] in [-1, 1] (the VAE's input)."""
    arrays = np.stack([np.asarray(image, dtype=np.float32) / 127.5 - 1.0 for image in images])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()


def with_source(uncond: dict, cond: dict) -> dict:
    """The unconditional side with the conditional side's source latents (the same image, no instruction)."""
    if SOURCE_KEY in cond and SOURCE_KEY not in uncond:
        return {**uncond, SOURCE_KEY: cond[SOURCE_KEY]}
    return uncond

"""Health checks on what a model produces: finite weights, finite images, images that are not blank.

Pure functions on tensors. Training stops on a non-finite value (align/train/checkpoints.py, the trainers); the
evaluations mark a model whose images are degenerate instead of scoring and ranking it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# An image whose every channel spans less than one 8-bit level is blank (one colour, e.g. the black
# images of a LoRA full of NaNs once they went through a PNG).
_BLANK_RANGE = 1.0 / 255
# A model is degenerate when at least this share of its images is blank: one blank image can be a
# fair answer to a prompt ("a white wall"); half of them is a broken model.
BLANK_SHARE = 0.5


def weights_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite (one reduction per tensor, no copy)."""
    return all(bool(torch.isfinite(p.detach()).all()) for p in params)


def images_finite(images: torch.Tensor) -> bool:
    return bool(torch.isfinite(images).all())


def blank_images(images: torch.Tensor) -> torch.Tensor:
    """[N] bool: images [N, C, H, W] (values in [0, 1]) whose pixels are all (nearly) one colour."""
    flat = images.detach().float().flatten(2)  # [N, C, H*W]
    spread = (flat.amax(dim=2) - flat.amin(dim=2)).amax(dim=1)
    return spread < _BLANK_RANGE


def degenerate_reason(images: torch.Tensor) -> str | None:
    """Why a model's images [N, C, H, W] cannot be scored as a model's output (NaN/inf values, or at least
    half of them blank), or None when they can."""
    if len(images) == 0:
        return None
    bad = (~torch.isfinite(images.detach())).flatten(1).any(dim=1)
    if bad.any():
        return f"{int(bad.sum())} of {len(images)} images hold NaN or infinite values"
    blank = blank_images(images)
    if blank.float().mean() >= BLANK_SHARE:
        return f"{int(blank.sum())} of {len(images)} images are blank (a single colour)"
    return None

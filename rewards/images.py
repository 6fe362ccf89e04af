"""Image conversions shared by all judges.

Judges accept either a list of PIL images or a float tensor [N, 3, H, W] in [0, 1]
(what the trainers produce), so trainer output never round-trips through files.
Anything else is refused (``check_images``) rather than clamped into a plausible wrong score;
``to_unit_range`` converts the other usual conventions:

    images = rewards.images.to_unit_range(vae_output, source="minus_one_one")   # diffusers' [-1, 1]
    images = rewards.images.to_unit_range(uint8_batch, source="uint8")           # [0, 255] integers, NCHW
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

Images = list | torch.Tensor  # PIL images or [N, 3, H, W] in [0, 1]


class UnreadableImageError(ValueError):
    """An image file or byte string that PIL cannot decode."""


# How far outside [0, 1] a tensor may stray (float rounding in a VAE decode) before it is refused.
RANGE_TOLERANCE = 1e-3
SOURCES = ("minus_one_one", "uint8", "zero_255")


def to_unit_range(images: torch.Tensor, source: str) -> torch.Tensor:
    """A float tensor [N, C, H, W] in [0, 1] from ``source``: "minus_one_one" (diffusers' VAE output,
    [-1, 1]), "uint8" (integers 0-255) or "zero_255" (floats in [0, 255]). Values are clamped after the
    conversion; the layout must already be channels-first (``images.permute(0, 3, 1, 2)`` for NHWC)."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"to_unit_range needs a tensor, got {type(images).__name__}")
    if source == "minus_one_one":
        converted = (images.float() + 1) / 2
    elif source in ("uint8", "zero_255"):
        converted = images.float() / 255
    else:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    return converted.clamp(0, 1)


def check_images(images, where: str = "images") -> int:
    """Refuse what a judge would otherwise score wrongly: the number of images of a list of PIL images or a
    finite float tensor [N, 3, H, W] (or [N, 1, H, W]) with values in [0, 1] (within RANGE_TOLERANCE).
    TypeError for a wrong type, dtype or element; ValueError for a wrong layout, NaN/inf or range."""
    if isinstance(images, torch.Tensor):
        if not images.is_floating_point():
            hint = " (convert with rewards.images.to_unit_range(images, source='uint8'))" if images.dtype == torch.uint8 else ""
            raise TypeError(f"{where}: a judge needs a float image tensor in [0, 1], got dtype {images.dtype}{hint}")
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            layout = " (channels last? use images.permute(0, 3, 1, 2))" if images.ndim == 4 and images.shape[-1] in (1, 3) else ""
            raise ValueError(f"{where}: a judge needs an image tensor [N, 3, H, W], got shape {tuple(images.shape)}{layout}")
        if images.numel() == 0:
            return images.shape[0]
        values = images.detach()
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{where}: the image tensor holds NaN or infinite values")
        low, high = float(values.min()), float(values.max())
        if low < -RANGE_TOLERANCE or high > 1 + RANGE_TOLERANCE:
            if low >= -1 - RANGE_TOLERANCE and high <= 1 + RANGE_TOLERANCE:
                hint = "; for diffusers' [-1, 1] images use rewards.images.to_unit_range(images, source='minus_one_one')"
            elif low >= -RANGE_TOLERANCE and high <= 255 + RANGE_TOLERANCE:
                hint = "; for [0, 255] images use rewards.images.to_unit_range(images, source='zero_255')"
            else:
                hint = ""
            raise ValueError(f"{where}: image values must be in [0, 1], got [{low:.4g}, {high:.4g}]{hint}")
        return images.shape[0]
    if isinstance(images, (list, tuple)):
        for i, img in enumerate(images):
            if not isinstance(img, Image.Image):
                raise TypeError(
                    f"{where}[{i}]: a judge needs PIL images or one float tensor [N, 3, H, W], got {type(img).__name__}"
                )
        return len(images)
    raise TypeError(f"{where}: a judge needs a list of PIL images or a float tensor [N, 3, H, W], got {type(images).__name__}")


def check_prompts(prompts, count: int, where: str = "prompts") -> None:
    """A list (or tuple) of ``count`` strings, one per image; a bare string is refused (it would be read as
    one prompt per character)."""
    if isinstance(prompts, str):
        raise TypeError(f"{where}: give a list of strings (one prompt per image), not a single string; e.g. [prompt] * {count}")
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"{where}: give a list of strings, one per image, got {type(prompts).__name__}")
    bad = next((i for i, p in enumerate(prompts) if not isinstance(p, str)), None)
    if bad is not None:
        raise TypeError(f"{where}[{bad}]: prompts must be strings, got {type(prompts[bad]).__name__}")
    if len(prompts) != count:
        raise ValueError(f"{where}: one prompt per image is needed: got {len(prompts)} prompts for {count} images")


def num_images(images: Images) -> int:
    return images.shape[0] if isinstance(images, torch.Tensor) else len(images)


def to_pil(images: Images) -> list[Image.Image]:
    """A list of RGB PIL images from PIL images or a [N, 3, H, W] tensor in [0, 1]."""
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"expected an image tensor [N, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
        arrays = (images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu())
        arrays = arrays.permute(0, 2, 3, 1).numpy()
        return [Image.fromarray(a.squeeze(-1) if a.shape[-1] == 1 else a).convert("RGB") for a in arrays]
    return [img.convert("RGB") if img.mode != "RGB" else img for img in images]


def to_tensor(images: Images) -> torch.Tensor:
    """A float tensor [N, 3, H, W] in [0, 1] from PIL images (all the same size) or a tensor."""
    if isinstance(images, torch.Tensor):
        return images.detach().float().clamp(0, 1)
    arrays = [np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0 for img in images]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def decode_image(data: bytes, where: str = "image bytes") -> Image.Image:
    """Decode encoded bytes (PNG/JPEG/...) into an RGB image, or raise UnreadableImageError naming ``where``."""
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, TypeError) as err:
        raise UnreadableImageError(f"cannot decode {where}: {err}") from err
    return img.convert("RGB")


def load_image(path: str | Path) -> Image.Image:
    """Open an image file as RGB, or raise UnreadableImageError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise UnreadableImageError(f"image file not found: {path}")
    return decode_image(path.read_bytes(), where=str(path))


def encode_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()

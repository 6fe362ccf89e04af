"""Image conversions shared by all judges.

Judges accept either a list of PIL images or a float tensor [N, 3, H, W] in [0, 1]
(what the trainers produce), so trainer output never round-trips through files.
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

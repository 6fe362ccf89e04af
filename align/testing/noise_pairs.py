"""Preference-pair parquet files of noise images, for trainer tests that need a ``--dataset``."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image


def noise_png(seed: int, size: int = 16) -> bytes:
    """A PNG of uniform noise, ``size`` x ``size`` RGB, from ``seed``."""
    pixels = (torch.rand(size, size, 3, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_noise_pairs(folder: Path, count: int, loser_seed_offset: int = 100, alternate_labels: bool = False) -> str:
    """``folder``/pairs.parquet with ``count`` pairs "shape i": image seeds i and i + ``loser_seed_offset``; the
    first image preferred, or (``alternate_labels``) the first in even pairs and the second in odd ones."""
    rows = [{"caption": f"shape {i}", "jpg_0": noise_png(i), "jpg_1": noise_png(loser_seed_offset + i),
             "label_0": float(i % 2) if alternate_labels else 1.0, "label_1": float(1 - i % 2) if alternate_labels else 0.0}
            for i in range(count)]
    path = Path(folder) / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def noise_jpeg(seed: int, width: int, height: int) -> bytes:
    pixels = (torch.rand(height, width, 3, generator=torch.Generator().manual_seed(seed)) * 255).to(torch.uint8).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_pickapic_shaped_pairs(folder: Path, count: int) -> str:
    """``folder``/pickapic.parquet shaped like Pick-a-Pic v2: JPEG bytes of several sizes and aspect ratios (the
    trainer resizes and centre-crops them), winners on either side, every fifth pair a tie (0.5 / 0.5, dropped by
    default), one caption empty."""
    sizes = [(16, 16), (24, 16), (16, 20), (32, 32)]
    rows = []
    for i in range(count):
        label_0 = 0.5 if i % 5 == 4 else float(i % 2)
        rows.append({"caption": "" if i == 3 else f"a photo {i}, with a cat", "jpg_0": noise_jpeg(i, *sizes[i % 4]),
                     "jpg_1": noise_jpeg(1000 + i, *sizes[(i + 1) % 4]), "label_0": label_0, "label_1": 1.0 - label_0})
    path = Path(folder) / "pickapic.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)

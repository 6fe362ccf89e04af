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

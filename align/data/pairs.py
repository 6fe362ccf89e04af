"""Preference data and prompt sets.

Preference pairs follow the Pick-a-Pic schema: ``caption, jpg_0, jpg_1, label_0, label_1`` with the
images as encoded bytes and ``label_0 = 0.5`` meaning a tie. They load from a local parquet file, a
folder (parquet files, or a ``datasets`` ``save_to_disk`` folder) or a Hugging Face dataset id.
As in the official Diffusion-DPO code, ties are dropped by default and each pair is stored winner
first. Unreadable images are found up front (each image is decoded once), counted and reported, so
a long run never dies on a bad image halfway through.

This module holds the pair records, their pixels and the readers' shared pieces; the one reader of a
Pick-a-Pic source is ``align.data.pair_stream`` (``open_pairs``: memory-mapped, decoded by DataLoader workers;
``load_pairs``: the same pairs decoded into memory, for reward-model training and small sets).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from align.run_folder import atomic_path
from align.validation import check_parquet_columns
from rewards.edit_prompts import without_instruction
from rewards.images import UnreadableImageError, decode_image, encode_png

if TYPE_CHECKING:
    import pyarrow as pa

PAIR_COLUMNS = ("caption", "jpg_0", "jpg_1", "label_0", "label_1")
TIE_POLICIES = ("drop", "keep_first")
PROMPT_FILE_SUFFIXES = (".txt", ".parquet", ".csv", ".jsonl")
# Pairs whose images fail to decode: how many of them the stats keep as examples.
MAX_UNREADABLE_EXAMPLES = 5


class DataError(ValueError):
    """Bad data input: the message names the source and what would be valid."""


# ----------------------------------------------------------------------------------------- prompts


def load_prompts(source: str, column: str = "caption") -> list[str]:
    """Prompts from a text file (one per line; blank lines and '#' comments skipped), a column of a
    .parquet/.csv/.jsonl file, or a column of a Hugging Face dataset ("id" or "id:split")."""
    path = Path(str(source)).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".txt":
            lines = path.read_text(encoding="utf-8").splitlines()
            prompts = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        elif suffix in (".parquet", ".csv", ".jsonl"):
            prompts = _clean_prompts(_read_table_column(path, column), source)
        else:
            raise DataError(
                f"prompt file {source!r} has an unsupported type {suffix!r}; "
                f"valid: {', '.join(PROMPT_FILE_SUFFIXES)} or a Hugging Face dataset id"
            )
    elif path.is_dir():
        dataset = dataset_from_folder(path, "train")
        if column not in dataset.column_names:
            raise DataError(
                f"prompt dataset folder {source!r} has no column {column!r}; its columns: {', '.join(dataset.column_names)}"
            )
        prompts = _clean_prompts(dataset[column], source)
    elif looks_like_path(str(source)):
        raise DataError(
            f"prompt file {source!r} not found; give an existing {'/'.join(PROMPT_FILE_SUFFIXES)} file "
            "or a Hugging Face dataset id ('id' or 'id:split')"
        )
    else:
        dataset_id, _, split = str(source).partition(":")
        dataset = load_hf_dataset(dataset_id, split or "train", what="prompt set")
        if column not in dataset.column_names:
            raise DataError(
                f"prompt dataset {source!r} has no column {column!r}; its columns: {', '.join(dataset.column_names)}"
            )
        prompts = _clean_prompts(dataset[column], source)
    if not prompts:
        raise DataError(
            f"prompt source {source!r} holds no prompts (blank lines and '#' comments are skipped)"
        )
    return prompts


def _clean_prompts(values, source) -> list[str]:
    prompts = []
    for value in values:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if not isinstance(value, str):
            raise DataError(
                f"prompt source {source!r}: the prompt column must hold text, got {type(value).__name__}"
            )
        if value.strip():
            prompts.append(value.strip())
    return prompts


def _read_table_column(path: Path, column: str) -> list:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # here, not at the top: DDPO needs this module but not pyarrow's ~30 MB

        names = pq.read_schema(path).names
        if column not in names:
            raise DataError(f"{path} has no column {column!r}; its columns: {', '.join(names)}")
        return pq.read_table(path, columns=[column]).column(column).to_pylist()
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if column not in (reader.fieldnames or []):
                raise DataError(
                    f"{path} has no column {column!r}; its columns: {', '.join(reader.fieldnames or [])}"
                )
            return [row[column] for row in reader]
    values = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {line_number} is not valid JSON: {err}") from err
            if not isinstance(record, dict) or column not in record:
                raise DataError(
                    f"{path} line {line_number} has no key {column!r}; each line must be a JSON object"
                )
            values.append(record[column])
    return values


def looks_like_path(source: str) -> bool:
    """True when ``source`` is meant as a local path rather than a Hub dataset id ("owner/name")."""
    return (
        source.startswith((".", "/", "~"))
        or "\\" in source
        or source.count("/") > 1
        or source.lower().endswith(PROMPT_FILE_SUFFIXES)
    )


def load_hf_dataset(
    dataset_id: str, split: str, what: str, cache_dir: str | None = None, streaming: bool = False
):
    import datasets

    try:
        return datasets.load_dataset(dataset_id, split=split, cache_dir=cache_dir, streaming=streaming)
    except Exception as err:  # the library raises many types (offline, missing split, bad id)
        raise DataError(
            f"cannot load {what} {dataset_id!r} (split {split!r}) with datasets.load_dataset: "
            f"{type(err).__name__}: {err}. Give a local file/folder or a valid Hugging Face dataset id"
        ) from err


# ----------------------------------------------------------------------------------- pairs: loading


@dataclass
class PreferencePair:
    """One preference pair, winner first. Images are encoded bytes (PNG/JPEG)."""

    caption: str
    chosen: bytes
    rejected: bytes
    source_index: int


@dataclass
class PairStats:
    """What happened to the rows of a preference source."""

    source: str = ""
    total: int = 0
    kept: int = 0
    ties_dropped: int = 0
    ties_kept: int = 0
    unlabelled: int = 0  # NaN labels or an 'abstained' flag (judge gave no usable answer)
    unreadable: int = 0
    unreadable_examples: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> str:
        text = (
            f"{self.source}: {self.total} rows read, {self.kept} pairs kept, "
            f"{self.ties_dropped} ties dropped, {self.ties_kept} ties kept as wins of image 0, "
            f"{self.unlabelled} without a label, {self.unreadable} with unreadable images"
        )
        if self.unreadable_examples:
            shown = "; ".join(f"row {index}: {reason}" for index, reason in self.unreadable_examples)
            text += f" (e.g. {shown})"
        return text


def image_bytes(value, where: str) -> bytes:
    """Encoded bytes from raw bytes, a datasets Image dict {"bytes", "path"} or a PIL image."""
    if isinstance(value, dict):
        data = value.get("bytes")
        if data is None and value.get("path"):
            image_path = Path(value["path"])
            if not image_path.is_file():
                raise UnreadableImageError(f"cannot read {where}: file {image_path} not found")
            data = image_path.read_bytes()
        value = data
    if isinstance(value, Image.Image):
        return encode_png(value.convert("RGB"))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise UnreadableImageError(
        f"cannot read {where}: expected encoded image bytes, got {type(value).__name__}"
    )


def dataset_from_folder(path: Path, split: str, cache_dir: str | None = None):
    """A ``save_to_disk`` folder, or a folder of parquet files (Hub layout) read by load_dataset."""
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        return _load_from_disk(path, split)
    if any(path.rglob("*.parquet")):
        return load_hf_dataset(str(path), split, "dataset folder", cache_dir)
    raise DataError(f"folder {str(path)!r} holds no .parquet files and is not a datasets save_to_disk folder")


def _load_from_disk(path: Path, split: str):
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"dataset folder {path} has no split {split!r}; its splits: {', '.join(loaded)}")
        return loaded[split]
    return loaded


# --------------------------------------------------------------------------------- pairs: pixels


def _resize_shortest_side(image: Image.Image, resolution: int) -> Image.Image:
    width, height = image.size
    scale = resolution / min(width, height)
    size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
    return image if size == image.size else image.resize(size, Image.Resampling.BILINEAR)


def _crop_flip_to_tensor(image: Image.Image, resolution: int, u: float, v: float, flip: bool) -> torch.Tensor:
    """Crop a RxR window at relative offset (u, v) in [0, 1] (0.5 = centre), flip, scale to [-1, 1]."""
    width, height = image.size
    left, top = round(u * (width - resolution)), round(v * (height - resolution))
    image = image.crop((left, top, left + resolution, top + resolution))
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def _pair_tensors(pair: PreferencePair, resolution: int, u: float, v: float, flip: bool):
    tensors = []
    for name, data in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        image = decode_image(data, f"pair {pair.source_index} {name} image")
        tensors.append(_crop_flip_to_tensor(_resize_shortest_side(image, resolution), resolution, u, v, flip))
    return tensors[0], tensors[1]


def pair_pixels(
    pair: PreferencePair, resolution: int, flip: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic pixels (centre crop, optional flip) of winner and loser, [3, R, R] in [-1, 1].
    For latent caching: cache both flips and pick one per epoch."""
    return _pair_tensors(pair, resolution, 0.5, 0.5, flip)


class PairTransform:
    """Diffusion-DPO augmentation: resize the shortest side to R (bilinear), crop RxR (centre or
    random), random horizontal flip, all the SAME for both images of a pair; the caption is replaced
    by "" with probability ``caption_dropout`` (for classifier-free guidance).

    Every call draws exactly four numbers from the given generator whatever the settings, so a run
    resumed with a restored generator state reproduces the same augmentations.
    """

    def __init__(
        self,
        resolution: int,
        random_crop: bool = False,
        random_flip: bool = True,
        caption_dropout: float = 0.2,
    ):
        if resolution < 8:
            raise DataError(f"resolution must be at least 8 pixels, got {resolution}")
        if not 0.0 <= caption_dropout <= 1.0:
            raise DataError(f"caption_dropout is a probability in [0, 1], got {caption_dropout}")
        self.resolution = resolution
        self.random_crop = random_crop
        self.random_flip = random_flip
        self.caption_dropout = caption_dropout

    def __call__(
        self, pair: PreferencePair, generator: torch.Generator
    ) -> tuple[str, torch.Tensor, torch.Tensor]:
        drop, flip, u, v = torch.rand(4, generator=generator).tolist()
        caption = without_instruction(pair.caption) if drop < self.caption_dropout else pair.caption  # "" (edits: the source kept)
        if not self.random_crop:
            u = v = 0.5
        pixels_w, pixels_l = _pair_tensors(pair, self.resolution, u, v, self.random_flip and flip < 0.5)
        return caption, pixels_w, pixels_l

    def __repr__(self) -> str:
        return (
            f"PairTransform(resolution={self.resolution}, random_crop={self.random_crop}, "
            f"random_flip={self.random_flip}, caption_dropout={self.caption_dropout})"
        )


# ----------------------------------------------------------------------------------------- writing


def write_pairs_parquet(rows: list[dict], path: str | Path, schema: pa.Schema | None = None) -> None:
    """Write rows (Pick-a-Pic schema plus any extra columns) to a parquet file atomically."""
    if not rows and schema is None:
        raise DataError(f"write_pairs_parquet({path}): no rows and no schema; nothing defines the columns")
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=schema)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


__all__ = [
    "PAIR_COLUMNS",
    "DataError",
    "PairStats",
    "PairTransform",
    "PreferencePair",
    "load_prompts",
    "pair_pixels",
    "write_pairs_parquet",
]


def check_pair_file(source: str) -> None:
    """A local file of preference pairs is a readable parquet file with the Pick-a-Pic columns (its footer is read,
    not its rows); folders and hub ids are opened by align.data.pair_stream.open_pairs. The declared reader of the
    options that name pairs (``option(..., reads=check_pair_file)``)."""
    if Path(source).expanduser().is_file():
        check_parquet_columns("preference pairs", source, PAIR_COLUMNS)

"""The one reader of Pick-a-Pic-schema preference sources: a memory-mapped table, an index of its training
pairs (``open_pairs``), the torch Dataset that DataLoader workers read pixels through, and the same pairs
decoded into memory for small sets (``load_pairs``).

Nothing here holds a dataset in Python lists, and nothing reads the whole of it before training. Local parquet
files (a file, or a folder of them in the Hub layout) are read where they lie (align.data.parquet_rows: the label
and caption columns whole, the images a row group at a time when a pair is used); a ``save_to_disk`` folder is
memory-mapped as it is; a Hub dataset id is downloaded and memory-mapped by ``datasets``. Only the kept row numbers
and a winner flag (9 bytes a pair) are in memory. Images are decoded, centre-cropped and flipped in the
DataLoader's worker processes, each worker reading only the micro-batches it is handed.

Which pair, which flip and whether the caption is dropped are decided by the trainer from
generators seeded by (seed, step, micro-step, process), and handed to the DataLoader as the keys
of each micro-batch: the sampler is a function of the step, so a resumed run restarts it at any
step and reads exactly what the uninterrupted run read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from align.data.edit_pairs import edit_pairs_as_pick_a_pic, edit_schema
from align.data.pairs import (
    MAX_UNREADABLE_EXAMPLES,
    PAIR_COLUMNS,
    TIE_POLICIES,
    DataError,
    PairStats,
    PreferencePair,
    dataset_from_folder,
    image_bytes,
    load_hf_dataset,
    looks_like_path,
    pair_pixels,
)
from align.data.parquet_rows import ParquetRows
from align.families.base import pad_to_longest
from rewards.edit_prompts import without_instruction
from rewards.images import UnreadableImageError, decode_image


class ArrowRows:
    """The rows of a ``datasets.Dataset`` (memory-mapped Arrow: a ``save_to_disk`` folder, a Hub dataset), with the
    interface of align.data.parquet_rows.ParquetRows."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.column_names = list(dataset.column_names)
        self.num_rows = len(dataset)

    def column(self, name: str):
        return self.dataset.data.column(name)  # mapped, not read

    def caption(self, row: int):
        return self.dataset.data.column("caption")[row].as_py()  # that cell only

    def images(self, row: int) -> tuple:
        record = self.dataset[row]
        return record["jpg_0"], record["jpg_1"]

    def reopened(self) -> ArrowRows:
        """Through a fresh memory map. Pages of a mapped file that were read stay in the process's RSS until the map
        closes: a pass over every pair (a store build) reads each stretch through its own map."""
        return ArrowRows(pickle.loads(pickle.dumps(self.dataset)))


@dataclass
class PairTable:
    """The training pairs of a source: rows ``rows[k]`` of ``dataset``, winner = jpg_1 where ``swap[k]``."""

    source: str
    dataset: ParquetRows | ArrowRows  # the source's rows; image columns kept as encoded bytes
    rows: np.ndarray  # int64 row numbers of the kept pairs
    swap: np.ndarray  # bool: image 1 won, so it is the pair's first image
    stats: PairStats
    fingerprint: str  # the content of the selected pairs (content_fingerprint): no path, no file time
    legacy_fingerprint: str = ""  # what stores built before content fingerprints recorded (Arrow sources only)

    def __len__(self) -> int:
        return len(self.rows)

    def remapped(self) -> PairTable:
        """The same pairs through freshly opened files (a fresh memory map; no row group held), so a pass over every
        pair (a store build) does not keep what it read."""
        return dataclasses.replace(self, dataset=self.dataset.reopened())

    def caption(self, k: int) -> str:
        value = self.dataset.caption(int(self.rows[k]))
        return value if isinstance(value, str) else ""

    def pair(self, k: int) -> PreferencePair:
        """Pair k, winner first, with its encoded image bytes (read from the source when asked)."""
        row = int(self.rows[k])
        where = f"{self.source}: row {row}"
        try:
            first, second = self.dataset.images(row)
            jpg_0 = image_bytes(first, f"{where} jpg_0")
            jpg_1 = image_bytes(second, f"{where} jpg_1")
        except UnreadableImageError as err:
            raise DataError(f"{err}; fix or remove that row (valid: PNG/JPEG bytes)") from None
        caption = self.caption(k)
        chosen, rejected = (jpg_1, jpg_0) if self.swap[k] else (jpg_0, jpg_1)
        return PreferencePair(caption, chosen=chosen, rejected=rejected, source_index=row)

    def pixels(self, k: int, resolution: int, flip: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Winner and loser pixels of pair k: resized, centre-cropped, flipped if asked, in [-1, 1].
        An image that does not decode stops with one line naming the row."""
        return self.pair_pixels(self.pair(k), resolution, flip)

    def pair_pixels(self, pair: PreferencePair, resolution: int, flip: bool) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return pair_pixels(pair, resolution, flip)
        except UnreadableImageError as err:
            raise DataError(
                f"{self.source}: row {pair.source_index} holds an unreadable image ({err}); "
                "fix or remove that row (valid: PNG/JPEG bytes)"
            ) from None


def open_pairs(
    source: str,
    split: str = "train",
    tie_policy: str = "drop",
    max_pairs: int | None = None,
    cache_dir: str | None = None,
) -> PairTable:
    """The training pairs of a Pick-a-Pic-schema source, read where it lies.

    source: a .parquet file, a folder of parquet files (read in place: align.data.parquet_rows), a
    ``save_to_disk`` folder (memory-mapped), or a Hugging Face dataset id (downloaded and memory-mapped by
    ``datasets``). Ties are dropped ("drop", official code) or kept as wins of image 0 ("keep_first"); NaN labels
    and abstentions are never pairs. Only the label and caption columns are read here (and, for the fingerprint,
    the images of the pairs of two row groups); images are read when a pair is used.
    """
    if tie_policy not in TIE_POLICIES:
        raise DataError(f"tie_policy {tie_policy!r} is not valid; choose one of {', '.join(TIE_POLICIES)}")
    if max_pairs is not None and max_pairs < 1:
        raise DataError(f"max_pairs must be a positive number of pairs (or None for all), got {max_pairs}")
    table = edit_pairs_as_pick_a_pic(_open_table(str(source), split, cache_dir), str(source), cache_dir)
    names = list(table.column_names)
    missing = [c for c in PAIR_COLUMNS if c not in names]
    if missing:
        raise DataError(
            f"preference source {source!r} lacks the Pick-a-Pic columns {', '.join(missing)}; needed: "
            f"{', '.join(PAIR_COLUMNS)} (found: {', '.join(names)})"
        )
    if isinstance(table, ParquetRows):
        rows, swap, stats = _select_pairs(table, str(source), tie_policy, max_pairs)
        return PairTable(str(source), table, rows, swap, stats, parquet_fingerprint(table, rows, swap))
    dataset = _bytes_only(table.select_columns(list(PAIR_COLUMNS) + (["abstained"] if "abstained" in names else [])))
    rows, swap, stats = _select_pairs(ArrowRows(dataset), str(source), tie_policy, max_pairs)
    key = f"{getattr(dataset, '_fingerprint', source)}|{split}|{tie_policy}|{max_pairs}|{len(rows)}"
    return PairTable(str(source), ArrowRows(dataset), rows, swap, stats, content_fingerprint(dataset, rows, swap),
                     hashlib.sha256(key.encode()).hexdigest()[:16])


CONTENT_SAMPLES = 16  # pairs whose image bytes enter the fingerprint in full (the rest by their lengths)


def parquet_fingerprint(table: ParquetRows, rows: np.ndarray, swap: np.ndarray) -> str:
    """A digest of the selected pairs of local parquet files, from what a run reads anyway, so that it costs the
    same for 500 pairs as for a million: the selection (rows and winners), every caption and label, the files'
    layout as their footers give it (each file's size, each row group's rows and each column chunk's compressed
    and uncompressed sizes: an image changed changes its chunk's sizes but for a byte-for-byte same-size edit),
    and the full bytes of the images of up to CONTENT_SAMPLES pairs of the first and the last row group holding a
    selected pair. Never a path or a file time: a file moved or touched keeps its store. What it cannot see: an
    image replaced in place by one that compresses to exactly the same number of bytes, outside those two row
    groups (docs/scale.md)."""
    digest = table.layout_digest()
    digest.update(b"pairs-v3")
    digest.update(rows.astype(np.int64).tobytes())
    digest.update(swap.astype(bool).tobytes())
    for name in ("caption", "label_0", "label_1"):
        digest.update(name.encode())
        for chunk in table.column(name).chunks:
            for buffer in chunk.buffers():
                if buffer is not None:
                    digest.update(buffer)
    first, last = table.locate(int(rows[0]))[0], table.locate(int(rows[-1]))[0]
    sampled = [int(r) for r in rows if table.locate(int(r))[0] in (first, last)]
    for row in sampled[: CONTENT_SAMPLES // 2] + sampled[-(CONTENT_SAMPLES // 2):]:
        for value in table.images(row):
            data = value.get("bytes") if isinstance(value, dict) else value
            digest.update(data or b"")
    return digest.hexdigest()[:16]


def content_fingerprint(dataset, rows: np.ndarray, swap: np.ndarray) -> str:
    """A digest of the selected pairs' content, so a latent store follows its data wherever it lies: a run folder
    renamed or copied, a dataset file touched or moved (same bytes) keep it. It covers the selection (rows and
    winners), every caption and label, every image's byte length (from the Arrow offsets: no image is read) and the
    full bytes of CONTENT_SAMPLES images spread over the rows; never a path or a file time."""
    import pyarrow as pa
    import pyarrow.compute as pc

    digest = hashlib.sha256(b"pairs-v2")
    digest.update(rows.astype(np.int64).tobytes())
    digest.update(swap.astype(bool).tobytes())
    table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
    for name in ("caption", "label_0", "label_1", "jpg_0", "jpg_1"):
        for chunk in table.column(name).chunks:
            if name.startswith("jpg"):
                if pa.types.is_struct(chunk.type):
                    chunk = chunk.field("bytes")  # datasets' Image: {bytes, path}; the path is left out
                chunk = pc.binary_length(chunk)
            digest.update(name.encode())
            for buffer in chunk.buffers():
                if buffer is not None:
                    digest.update(buffer)
    for k in np.unique(np.linspace(0, len(rows) - 1, num=min(CONTENT_SAMPLES, len(rows))).astype(np.int64)):
        row = int(rows[k])
        for name in ("jpg_0", "jpg_1"):
            value = table.column(name)[row].as_py()
            data = value.get("bytes") if isinstance(value, dict) else value
            digest.update(data or b"")
    return digest.hexdigest()[:16]


def load_pairs(
    source: str,
    split: str = "train",
    tie_policy: str = "drop",
    max_pairs: int | None = None,
    validate_images: bool = True,
    cache_dir: str | None = None,
) -> tuple[list[PreferencePair], PairStats]:
    """The pairs of ``open_pairs`` held in memory, winner first (reward-model training, small sets).

    validate_images: decode every image once now; a pair with an unreadable image is skipped and counted
    instead of failing later mid-training.
    """
    table = open_pairs(source, split=split, tie_policy=tie_policy, max_pairs=max_pairs, cache_dir=cache_dir)
    stats, pairs = table.stats, []
    for k in range(len(table)):
        try:
            pair = table.pair(k)
            if validate_images:  # in the file's column order, so the first unreadable one is named
                jpg_0, jpg_1 = (pair.rejected, pair.chosen) if table.swap[k] else (pair.chosen, pair.rejected)
                decode_image(jpg_0, f"row {pair.source_index} jpg_0")
                decode_image(jpg_1, f"row {pair.source_index} jpg_1")
        except (DataError, UnreadableImageError) as err:
            stats.unreadable += 1
            stats.kept -= 1
            if len(stats.unreadable_examples) < MAX_UNREADABLE_EXAMPLES:
                stats.unreadable_examples.append((int(table.rows[k]), str(err)))
            continue
        pairs.append(pair)
    if not pairs:
        raise DataError(f"no usable preference pairs in {source!r}: {stats.summary()}")
    return pairs, stats


def _open_table(source: str, split: str, cache_dir: str | None):
    """Local parquet files as ParquetRows (read in place); anything else as a ``datasets.Dataset``."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".parquet":
            raise DataError(f"preference file {source!r} must be a .parquet file (Pick-a-Pic schema)")
        if _check_parquet(path) == 0:  # no rows: say what the user needs to know
            raise DataError(f"no usable preference pairs in {source!r}: the file has the Pick-a-Pic columns and 0 rows")
        return ParquetRows([path])
    if path.is_dir():
        files = _parquet_split_files(path, split)
        if files is None:
            return dataset_from_folder(path, split, cache_dir)
        for file in files:
            _check_parquet(file)
        table = ParquetRows(files)
        if table.num_rows == 0:
            raise DataError(f"no usable preference pairs in {source!r}: its parquet files have 0 rows")
        return table
    if looks_like_path(source) or source.lower().endswith(".parquet"):
        raise DataError(
            f"preference source {source!r} not found; give a .parquet file, a folder of parquet files, "
            "a datasets save_to_disk folder, or a Hugging Face dataset id"
        )
    return load_hf_dataset(source, split, "preference dataset", cache_dir)


def _parquet_split_files(folder: Path, split: str) -> list[Path] | None:
    """The parquet files of ``split`` in a folder of them, resolved as ``load_dataset(folder)`` resolves them (the
    Hub layout: data/train-*.parquet, ...) without reading any; None for a ``save_to_disk`` folder or a folder of
    other files."""
    if (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file():
        return None
    if not any(folder.rglob("*.parquet")):
        return None
    import datasets

    try:
        resolved = datasets.load_dataset_builder(str(folder)).config.data_files or {}
    except Exception:  # the library raises many types: let load_dataset say what is wrong
        return None
    if split not in resolved:
        raise DataError(f"dataset folder {str(folder)!r} has no split {split!r}; its splits: {', '.join(resolved)}")
    files = [Path(str(f)) for f in resolved[split]]
    return files if files and all(f.suffix.lower() == ".parquet" for f in files) else None


def _check_parquet(path: Path) -> int:
    """The columns, from the footer only: a file without them is refused before any conversion. Returns the
    footer's row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        footer = pq.read_metadata(path)
        names = footer.schema.to_arrow_schema().names
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"cannot read {path} as parquet: {err}") from err
    missing = [c for c in PAIR_COLUMNS if c not in names]
    if missing and edit_schema(names) is None:
        raise DataError(
            f"preference source {str(path)!r} lacks the Pick-a-Pic columns {', '.join(missing)}; needed: "
            f"{', '.join(PAIR_COLUMNS)}, or an edit-pair schema (align/data/edit_pairs.py) (found: {', '.join(names)})"
        )
    return footer.num_rows


def _bytes_only(dataset):
    """Image columns as encoded bytes: decoding happens in the workers, once per use."""
    import datasets

    for column in ("jpg_0", "jpg_1"):
        if dataset.features is not None and isinstance(dataset.features[column], datasets.Image):
            dataset = dataset.cast_column(column, datasets.Image(decode=False))
    return dataset


def _select_pairs(table: ParquetRows | ArrowRows, source: str, tie_policy: str, max_pairs: int | None):
    """Kept row numbers and winner flags from the label columns alone (vectorised)."""
    label_0 = _float_column(table.column("label_0"))
    label_1 = _float_column(table.column("label_1"))
    unlabelled = np.isnan(label_0) | np.isnan(label_1)
    if "abstained" in table.column_names:
        unlabelled |= np.asarray(table.column("abstained").fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
    tie = ~unlabelled & (label_0 == label_1)
    keep = ~unlabelled & (~tie | (tie_policy == "keep_first"))
    rows = np.flatnonzero(keep).astype(np.int64)
    if max_pairs is not None:
        rows = rows[:max_pairs]
    seen = int(rows[-1]) + 1 if max_pairs is not None and len(rows) == max_pairs else len(label_0)
    stats = PairStats(source=source, total=seen, kept=len(rows))
    stats.unlabelled = int(unlabelled[:seen].sum())
    if tie_policy == "drop":
        stats.ties_dropped = int(tie[:seen].sum())
    else:
        stats.ties_kept = int(tie[:seen].sum())
    if not len(rows):
        raise DataError(f"no usable preference pairs in {source!r}: {stats.summary()}")
    return rows, label_1[rows] > label_0[rows], stats


def _float_column(column) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        column = pc.cast(column, pa.float64())
    except pa.ArrowException:  # labels stored as text: parse what parses, NaN for the rest
        return np.array([_as_float(v) for v in column.to_pylist()], dtype=np.float64)
    return np.asarray(column.fill_null(math.nan).to_numpy(zero_copy_only=False), dtype=np.float64)


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


# ------------------------------------------------------------------------------- DataLoader parts


class PairPixels(torch.utils.data.Dataset):
    """Items (k, flip, drop) -> winner/loser pixels and the caption ("" when dropped); read in workers."""

    REMAP_EVERY = 1024  # items read through one memory map before a fresh one (see PairTable.remapped)

    def __init__(self, table: PairTable, resolution: int):
        self.table, self.resolution, self._reads = table, resolution, 0

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, key: tuple[int, bool, bool]) -> dict:
        k, flip, drop = key
        self._reads += 1
        if self._reads % self.REMAP_EVERY == 0:
            self.table = self.table.remapped()
        try:
            pair = self.table.pair(k)
            pixels_w, pixels_l = self.table.pair_pixels(pair, self.resolution, flip)
        except DataError as err:  # handed to the training process, which stops with this one line
            return {"error": str(err)}
        return {"pixels_w": pixels_w, "pixels_l": pixels_l, "caption": without_instruction(pair.caption) if drop else pair.caption}


class PlannedBatches(torch.utils.data.Sampler):
    """The micro-batches of steps [start, end): ``plan(step, micro)`` gives a micro-batch's keys.
    A function of the step, so a resumed run restarts it at its step."""

    def __init__(self, plan, start: int, end: int, accumulation: int):
        self.plan, self.start, self.end, self.accumulation = plan, start, end, accumulation

    def __iter__(self):
        for step in range(self.start, self.end):
            for micro in range(self.accumulation):
                yield self.plan(step, micro)

    def __len__(self) -> int:
        return (self.end - self.start) * self.accumulation


def capped_workers(requested: int) -> int:
    """DataLoader workers, at most one per CPU (each is a process: 100,000 of them would bring the machine to a
    halt), said in one line when capped."""
    cpus = os.cpu_count() or 1
    if requested <= cpus:
        return requested
    print(f"[data] --dataloader_num_workers {requested} is more than this machine's {cpus} CPUs; using {cpus}", flush=True)
    return cpus


def micro_batch_loader(dataset, sampler: PlannedBatches, num_workers: int) -> torch.utils.data.DataLoader:
    """A DataLoader over planned micro-batches; workers decode, crop and flip (or read latents)."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=capped_workers(num_workers),
        collate_fn=_collate,
        persistent_workers=False,
    )


def _collate(items: list[dict]) -> dict:
    errors = [item["error"] for item in items if "error" in item]
    if errors:
        return {"error": errors[0]}
    batch = {}
    for key in items[0]:
        values = [item[key] for item in items]
        # stored conditionings of different token lengths (Qwen-Image, Z-Image) are zero-padded, their masks too
        batch[key] = torch.stack(pad_to_longest(values, dim=0)) if isinstance(values[0], torch.Tensor) else values
    return batch


__all__ = ["PairPixels", "PairTable", "PlannedBatches", "load_pairs", "micro_batch_loader", "open_pairs"]

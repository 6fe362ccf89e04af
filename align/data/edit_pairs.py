"""Edit preference pairs: the sources of instruction-editing preferences read as Pick-a-Pic pairs whose caption is an
edit prompt (``rewards.edit_prompts``: ``[source: <file>] <instruction>``).

Schemas read (detected from the columns):

    pick-a-pic-edit   caption (the instruction), source (the source image's bytes), jpg_0, jpg_1, label_0, label_1:
                      Pick-a-Pic's schema plus the source image (what align.data.feedback writes for edit prompts is
                      plain Pick-a-Pic: its captions are edit prompts already)
    editreward        TIGER-Lab/EditReward-Data (and EditReward-Bench's 2-pair split): instruction, source_img,
                      left_output_image, right_output_image, vote_type ("leftvote" / "rightvote" / "tie")

Each distinct source image is written once to ``<sources folder>/<sha256 of its bytes>.png`` (content-addressed: every
process and every run writes the same file), and the caption becomes ``[source: <that file>] <instruction>``, so the
trainers, the latent store and the judges read the pair as any other.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from align.data.pairs import DataError, image_bytes
from rewards.edit_prompts import edit_prompt

SOURCES_ENV = "T2I_ALIGN_EDIT_SOURCES"  # where the source images are written (default ~/.cache/t2i-align/edit_sources)
VOTE_LABELS = {"leftvote": 1.0, "rightvote": 0.0, "tie": 0.5}

SCHEMAS: dict[str, tuple[str, ...]] = {
    "pick-a-pic-edit": ("caption", "source", "jpg_0", "jpg_1", "label_0", "label_1"),
    "editreward": ("instruction", "source_img", "left_output_image", "right_output_image", "vote_type"),
}


def edit_schema(columns) -> str | None:
    """The edit schema of a table's columns, or None (a plain Pick-a-Pic table)."""
    names = set(columns)
    return next((name for name, needed in SCHEMAS.items() if set(needed) <= names), None)


def sources_folder(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser() / "edit_sources"
    return Path(os.environ.get(SOURCES_ENV, "~/.cache/t2i-align/edit_sources")).expanduser()


def write_source(data: bytes, folder: Path) -> str:
    """The source image's file, written once (atomically) under its content's digest."""
    path = folder / f"{hashlib.sha256(data).hexdigest()[:32]}.png"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return str(path)


def as_pick_a_pic_row(row: dict, schema: str, folder: Path, index: int) -> dict:
    """One edit row in Pick-a-Pic's columns, its caption an edit prompt naming the source's file."""
    if schema == "pick-a-pic-edit":
        source = write_source(image_bytes(row["source"], f"row {index} source"), folder)
        return {"caption": edit_prompt(source, row["caption"] or ""), "jpg_0": row["jpg_0"], "jpg_1": row["jpg_1"],
                "label_0": row["label_0"], "label_1": row["label_1"]}
    vote = row["vote_type"]
    if vote not in VOTE_LABELS:
        raise DataError(f"row {index}: vote_type {vote!r} is not one of {', '.join(VOTE_LABELS)}")
    source = write_source(image_bytes(row["source_img"], f"row {index} source_img"), folder)
    return {"caption": edit_prompt(source, row["instruction"] or ""), "jpg_0": row["left_output_image"],
            "jpg_1": row["right_output_image"], "label_0": VOTE_LABELS[vote], "label_1": 1.0 - VOTE_LABELS[vote]}


def edit_pairs_as_pick_a_pic(dataset, source: str, cache_dir: str | None = None):
    """A ``datasets`` table of an edit schema mapped (once; datasets caches the map) to Pick-a-Pic's columns."""
    schema = edit_schema(dataset.column_names)
    if schema is None:
        return dataset
    import datasets

    if not isinstance(dataset, datasets.Dataset):  # local parquet files read in place: the map needs them as a Dataset
        dataset = datasets.load_dataset("parquet", data_files=list(dataset.files), split="train", cache_dir=cache_dir)

    folder = sources_folder(cache_dir)
    print(f"[data] {source}: {schema} edit pairs; their source images go to {folder}", flush=True)
    for column, feature in (dataset.features or {}).items():  # images as encoded bytes, never decoded here
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(column, datasets.Image(decode=False))
    return dataset.map(lambda row, index: as_pick_a_pic_row(row, schema, folder, index), with_indices=True,
                       remove_columns=list(dataset.column_names), desc="edit pairs")

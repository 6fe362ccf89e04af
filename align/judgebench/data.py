"""Load judge-benchmark data in the MJ-Bench format.

One row is one sample::

    caption      the prompt
    image0       an image (encoded bytes, {"bytes", "path"} struct, a file path, or a PIL image)
    image1       the other image of the pair (empty for bias rows)
    label        0 if image0 is preferred, 1 if image1 is (empty for bias rows)
    category     alignment | safety | quality | bias (for the hub data: the split name)
    subcategory  e.g. object, attribute, count, spatial (optional)
    info         optional free metadata (dict or JSON text); may carry subcategory/group/variant
    group        bias rows: what must be judged the same across variants (MJ-Bench: the occupation)
    variant      bias rows: the demographic variant (MJ-Bench: age/gender/race/... value)

Bias rows are scored pointwise, one image each; ``occupation`` / ``demographic`` are accepted as
the names of ``group`` / ``variant``.

Sources: a local ``.parquet`` / ``.json`` / ``.jsonl`` file, or a hub dataset id ``owner/name@revision``
(one split per subset). Hub data must be pinned: the ``MJ-Bench/MJ-Bench`` dataset card has since
been replaced by a newer benchmark (categories composition / visualization / quality, label always 0),
so an unpinned load would silently evaluate on different data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from PIL import Image

from rewards.images import decode_image, load_image

SUBSETS: tuple[str, ...] = ("alignment", "safety", "quality", "bias")
PAIR_SUBSETS: tuple[str, ...] = ("alignment", "safety", "quality")

MJBENCH_REPO_ID = "MJ-Bench/MJ-Bench"
# The commit of the 2024 release (alignment / safety / quality / bias splits) to load by default.
# Not verified offline (the hub is unreachable here): until it is filled in, ask for an explicit
# ``MJ-Bench/MJ-Bench@<commit>``.
MJBENCH_REVISION: str | None = None
PINNED_REVISIONS: dict[str, str | None] = {MJBENCH_REPO_ID: MJBENCH_REVISION}

LOCAL_SUFFIXES = (".parquet", ".json", ".jsonl")


class BenchDataError(ValueError):
    """Benchmark data that cannot be used, with what would be valid."""


@dataclass
class BenchSample:
    """One benchmark row. ``image0``/``image1`` stay undecoded until ``images()`` is called."""

    caption: str
    image0: Any
    image1: Any = None
    label: int | None = None
    category: str = "alignment"
    subcategory: str = ""
    group: str = ""
    variant: str = ""
    info: dict = field(default_factory=dict)
    where: str = ""  # "file:row" for error messages

    @property
    def is_pair(self) -> bool:
        return self.category != "bias"

    def images(self, base_dir: Path | None = None) -> tuple[Image.Image, Image.Image | None]:
        first = to_image(self.image0, f"{self.where} image0", base_dir)
        second = to_image(self.image1, f"{self.where} image1", base_dir) if self.is_pair else None
        return first, second


def to_image(value: Any, where: str, base_dir: Path | None = None) -> Image.Image:
    """Decode one image cell: PIL image, encoded bytes, {"bytes", "path"} struct, or a file path."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode_image(bytes(value), where=where)
    if isinstance(value, dict):
        if value.get("bytes"):
            return decode_image(bytes(value["bytes"]), where=where)
        if value.get("path"):
            return to_image(value["path"], where, base_dir)
    if isinstance(value, str) and value:
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        return load_image(path)
    raise BenchDataError(f"{where}: no image (expected encoded bytes, a {{'bytes','path'}} struct or a file path)")


def parse_source(source: str) -> tuple[str, str, str | None]:
    """('local', path, None) for a local file, or ('hub', repo_id, revision) for a hub id[@revision]."""
    path = Path(source).expanduser()
    if path.suffix.lower() in LOCAL_SUFFIXES or path.exists():
        if not path.is_file():
            raise BenchDataError(
                f"--data {source!r}: no such file; give a local .parquet/.json/.jsonl file, "
                "a hub dataset id owner/name@revision, or 'testbed'"
            )
        if path.suffix.lower() not in LOCAL_SUFFIXES:
            raise BenchDataError(f"--data {source!r}: unsupported file type; use .parquet, .json or .jsonl")
        return "local", str(path), None
    repo_id, _, revision = source.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise BenchDataError(
            f"--data {source!r} is neither a local .parquet/.json/.jsonl file nor a hub dataset id "
            "owner/name[@revision]"
        )
    revision = revision or PINNED_REVISIONS.get(repo_id)
    if not revision:
        raise BenchDataError(
            f"--data {source!r}: pin a revision, e.g. {repo_id}@<commit>. Hub datasets change "
            f"under the same name (the {MJBENCH_REPO_ID} card has been replaced by a newer benchmark), "
            "so an unpinned load is not reproducible"
        )
    return "hub", repo_id, revision


def load_bench(source: str, subsets: tuple[str, ...] = SUBSETS, limit: int | None = None) -> tuple[list[BenchSample], Path | None]:
    """Samples of the requested subsets from a local file or a pinned hub dataset.

    Returns the samples and the folder that relative image paths are resolved against (or None).
    ``limit`` keeps the first ``limit`` rows of each subset.
    """
    unknown = [s for s in subsets if s not in SUBSETS]
    if unknown:
        raise BenchDataError(f"unknown subset(s) {', '.join(unknown)}; valid subsets: {', '.join(SUBSETS)}")
    kind, where, revision = parse_source(source)
    if kind == "local":
        rows = _read_local(Path(where))
        samples = [row_to_sample(row, f"{where}:{i}") for i, row in enumerate(rows)]
        base_dir = Path(where).parent
    else:
        samples = _read_hub(where, revision, subsets, limit)
        base_dir = None
    samples = [s for s in samples if s.category in subsets]
    if limit is not None:
        samples = _limit_per_subset(samples, limit)
    if not samples:
        raise BenchDataError(f"--data {source!r} holds no rows of the subsets {', '.join(subsets)}")
    return samples, base_dir


def _limit_per_subset(samples: list[BenchSample], limit: int) -> list[BenchSample]:
    kept, seen = [], {}
    for sample in samples:
        seen[sample.category] = seen.get(sample.category, 0) + 1
        if seen[sample.category] <= limit:
            kept.append(sample)
    return kept


def _read_local(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for a damaged file
            raise BenchDataError(f"cannot read parquet file {path}: {err}") from err
    text = path.read_text(encoding="utf-8")
    try:
        if suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise BenchDataError(f"{path} is not valid JSON: {err}") from err
    if isinstance(data, dict):  # {"alignment": [...], "bias": [...]} keyed by subset
        rows = []
        for subset, items in data.items():
            rows.extend({"category": subset, **item} for item in items)
        return rows
    if not isinstance(data, list):
        raise BenchDataError(f"{path} must hold a list of rows or a mapping subset -> rows")
    return data


def _read_hub(repo_id: str, revision: str, subsets: tuple[str, ...], limit: int | None) -> list[BenchSample]:
    from datasets import load_dataset  # noqa: PLC0415 - the hub path only: --help and local files stay without datasets

    samples = []
    for subset in subsets:
        split = subset if limit is None else f"{subset}[:{limit}]"
        try:
            data = load_dataset(repo_id, split=split, revision=revision)
        except Exception as err:  # network, gated repo, missing split: all reported the same way
            raise BenchDataError(
                f"cannot load split {subset!r} of {repo_id}@{revision}: {err}. MJ-Bench is gated: accept its "
                "conditions on the hub and log in (hf auth login), or pass a local parquet file"
            ) from err
        for i, row in enumerate(data):
            samples.append(row_to_sample({"category": subset, **row}, f"{repo_id}:{subset}:{i}"))
    return samples


def _info_dict(value: Any) -> dict:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            parsed = json.loads(value)
            return parsed if isinstance(parsed, dict) else {}
        except json.JSONDecodeError:
            return {"text": value}
    return {"text": value} if value not in (None, "") else {}


def _first(row: dict, info: dict, *names: str) -> Any:
    for name in names:
        for source in (row, info):
            value = source.get(name)
            if value not in (None, "") and not (isinstance(value, float) and math.isnan(value)):
                return value
    return None


def row_to_sample(row: dict, where: str) -> BenchSample:
    """One MJ-Bench-format row as a BenchSample, or BenchDataError naming the row and the problem."""
    info = _info_dict(row.get("info"))
    caption = row.get("caption")
    if not isinstance(caption, str) or not caption.strip():
        raise BenchDataError(f"{where}: missing 'caption' (MJ-Bench rows need caption, image0, image1, label)")
    category = str(_first(row, info, "category", "subset") or "alignment").lower()
    if category not in SUBSETS:
        raise BenchDataError(f"{where}: unknown category {category!r}; valid: {', '.join(SUBSETS)}")
    if row.get("image0") is None:
        raise BenchDataError(f"{where}: missing 'image0'")
    sample = BenchSample(
        caption=caption,
        image0=row["image0"],
        image1=row.get("image1"),
        category=category,
        subcategory=str(_first(row, info, "subcategory") or ""),
        info=info,
        where=where,
    )
    if category == "bias":
        group = _first(row, info, "group", "occupation")
        variant = _first(row, info, "variant", "demographic")
        if group is None or variant is None:
            raise BenchDataError(
                f"{where}: a bias row needs 'group' and 'variant' (or 'occupation' and 'demographic'), "
                "as columns or inside 'info'"
            )
        sample.group, sample.variant = str(group), str(variant)
        return sample
    if row.get("image1") is None:
        raise BenchDataError(f"{where}: missing 'image1' (pairs of the {category} subset need two images)")
    label = row.get("label")
    if isinstance(label, float) and label.is_integer():
        label = int(label)
    if label not in (0, 1):
        raise BenchDataError(f"{where}: 'label' must be 0 (image0 preferred) or 1 (image1 preferred), got {label!r}")
    sample.label = int(label)
    return sample

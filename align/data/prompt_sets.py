"""Prompt sets for evaluation and best-of-N, by name or path.

    testbed-train[:<n>[:<seed>]]    the shapes world's training captions (align/testbed/split.py, version 1)
    testbed-heldout[:<n>[:<seed>]]  captions no testbed-train set can draw (unseen captions), each a scene of its own
    testbed-novel[:<n>[:<seed>]]    captions naming a colour-shape pair no training caption names (unseen combinations),
                                    each a scene of its own
    testbed[:<n>[:<seed>]]          the whole grammar, unsplit: the stream every run before the split drew from
                                    (configs before 2026-12 name it); it overlaps every part, so a run may not
                                    train on it and hold out testbed-heldout, or the reverse
    mjbench                     our bundled probes for MJ-Bench's categories (all four files)
    mjbench-alignment|-safety|-quality|-bias
    animals                     45 common animal names (DDPO's aesthetic-score recipe prompts)
    parti                       PartiPrompts (nateraw/parti-prompts, column Prompt, 1,632 prompts)
    drawbench                   DrawBench (sayakpaul/drawbench, column Prompts, 200 prompts)
    pickapic-val                Pick-a-Pic v2 validation_unique captions (500)
    hpsv2 | hpsv2-<style>       HPSv2 benchmark prompts (anime, concept-art, paintings, photo; 800 each)
    geneval                     GenEval's 553 prompts, categories = its tasks (bundled with its metadata)
    flow-grpo-ocr               Flow-GRPO's OCR test prompts, text to render in quotes (1,018, bundled)
    flow-grpo-pickscore[-test]  Flow-GRPO's PickScore prompts from Pick-a-Pic v1 (25,432 train / 2,048 test, bundled)
    path/to/file                .txt (one per line; "## category" lines start a group), .csv/.tsv/.parquet/.jsonl/.json

A hub set takes ``[source=<local file in the same schema>]`` to load offline, e.g.
``drawbench[source=drawbench.parquet]``; ``[split=...]`` overrides the split.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from align.cli import ConfigError
from align.testbed.edit_world import EDIT_SET_PREFIX, edit_kind, parse_edit_set, sample_edit_prompts
from align.testbed.scene import sample_captions
from align.testbed.split import sample_split_captions
from align.validation import read_text_file
from rewards.geneval import DATA, METADATA_FILE, read_metadata
from rewards.shapes_grammar import parse_caption
from rewards.spec import parse_spec

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
MJBENCH_PARTS = ("alignment", "safety", "quality", "bias")
HPSV2_STYLES = ("anime", "concept-art", "paintings", "photo")
# bundled sets of the flow-RL papers (sources and licences: align/data/prompts/SOURCES.md)
BUNDLED_FILES = {
    "flow-grpo-ocr": "flow_grpo_ocr_test.txt",
    "flow-grpo-pickscore": "flow_grpo_pickscore_train.txt",
    "flow-grpo-pickscore-test": "flow_grpo_pickscore_test.txt",
}
TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".jsonl", ".json")


class PromptSetError(ValueError):
    """A bad prompt set spec or file: the message names it and lists what would be valid."""


@dataclass(frozen=True)
class HubPromptSet:
    repo_id: str
    split: str
    column: str
    category_column: str | None = None


HUB_SETS: dict[str, HubPromptSet] = {
    "parti": HubPromptSet("nateraw/parti-prompts", "train", "Prompt", "Category"),
    "drawbench": HubPromptSet("sayakpaul/drawbench", "train", "Prompts", "Category"),
    "pickapic-val": HubPromptSet("yuvalkirstain/pickapic_v2", "validation_unique", "caption"),
}
HPSV2_REPO = "zhwang/HPDv2"


@dataclass
class PromptSet:
    name: str
    prompts: list[str]
    categories: list[str] = field(default_factory=list)  # one per prompt ("" when unknown)

    def __post_init__(self):
        if not self.categories:
            self.categories = [""] * len(self.prompts)
        if len(self.categories) != len(self.prompts):
            raise ValueError("a PromptSet needs one category per prompt")

    def __len__(self) -> int:
        return len(self.prompts)

    def head(self, n: int | None) -> PromptSet:
        """The first ``n`` prompts (all of them for None)."""
        if n is None or n >= len(self.prompts):
            return self
        return PromptSet(self.name, self.prompts[:n], self.categories[:n])


# the testbed's sets: the part of the caption split each draws from (None: the whole grammar)
TESTBED_SETS: dict[str, str | None] = {"testbed-train": "train", "testbed-heldout": "heldout",
                                       "testbed-novel": "novel", "testbed": None}


def known_sets() -> list[str]:
    names = [*TESTBED_SETS, "mjbench", *[f"mjbench-{p}" for p in MJBENCH_PARTS], "animals", "geneval", *BUNDLED_FILES,
             *HUB_SETS, "hpsv2"]
    return names + [f"hpsv2-{s}" for s in HPSV2_STYLES]


# testbed:<n> draws n captions up front (a few seconds per 100,000): more would sit silently before any work.
MAX_TESTBED_PROMPTS = 100_000
# held-out sets are distinct scenes: the held-out part's sampler reaches about 6,400 (10 s for 4,000)
MAX_DISTINCT_TESTBED_PROMPTS = 4_000


def load_prompt_set(spec: str, num_prompts: int | None = None, seed: int = 0) -> PromptSet:
    """Load a named set or a file (see the module docstring); ``num_prompts`` keeps the first N."""
    if num_prompts is not None and num_prompts < 1:
        raise PromptSetError(f"num_prompts must be at least 1, got {num_prompts}")
    if spec.startswith(EDIT_SET_PREFIX):  # the editing testbed's prompts (align/testbed/edit_world.py)
        return _testbed_edits(spec, num_prompts)
    name, sep, numbers = spec.partition(":")
    if sep and name in TESTBED_SETS:  # the trainers' form: testbed-<part>:<count>[:<seed>]
        parts = numbers.split(":")
        try:
            count, seed = int(parts[0]), int(parts[1]) if len(parts) > 1 else seed
            if len(parts) > 2:
                raise ValueError
        except ValueError:
            raise PromptSetError(f"prompt set {spec!r} must be {name}:<count>[:<seed>]") from None
        most = MAX_TESTBED_PROMPTS if TESTBED_SETS[name] in (None, "train") else MAX_DISTINCT_TESTBED_PROMPTS
        if not 1 <= count <= most or not 0 <= seed < 2**32:
            raise PromptSetError(f"prompt set {spec!r}: the count must be in [1, {most:,}] and the seed "
                                 f"in [0, {2**32 - 1}]")
        return _testbed(name, min(count, num_prompts or count), seed)
    try:
        name, options = parse_spec(spec)
    except ValueError as err:
        raise PromptSetError(str(err)) from err
    if name in TESTBED_SETS:
        return _testbed(name, num_prompts or 64, seed)
    if name == "mjbench" or name.startswith("mjbench-"):
        parts = MJBENCH_PARTS if name == "mjbench" else (name.removeprefix("mjbench-"),)
        if any(p not in MJBENCH_PARTS for p in parts):
            raise PromptSetError(f"unknown prompt set {name!r}; known sets: {', '.join(known_sets())}")
        merged = [read_text_prompts(PROMPTS_DIR / f"mjbench_{p}.txt") for p in parts]
        return PromptSet(name, sum((m.prompts for m in merged), []), sum((m.categories for m in merged), [])).head(num_prompts)
    if name == "animals":
        return read_text_prompts(PROMPTS_DIR / "animals.txt").head(num_prompts)
    if name == "geneval":
        return _geneval().head(num_prompts)
    if name in BUNDLED_FILES:
        bundled = read_text_prompts(PROMPTS_DIR / BUNDLED_FILES[name])
        return PromptSet(name, bundled.prompts, bundled.categories).head(num_prompts)
    if name in HUB_SETS:
        return _hub_set(name, HUB_SETS[name], options).head(num_prompts)
    if name == "hpsv2" or name.startswith("hpsv2-"):
        return _hpsv2(name, options).head(num_prompts)
    path = Path(name).expanduser()
    if path.is_file():
        return read_prompt_file(path).head(num_prompts)
    raise PromptSetError(
        f"prompt set {spec!r} is neither a known set nor an existing file; known sets: {', '.join(known_sets())}; "
        f"files: .txt or {'/'.join(TABLE_SUFFIXES)}"
    )


# ------------------------------------------------------------------------------------- sources


def load_prompt_list(spec: str) -> list[str]:
    """A prompt set's prompts by name (parti, drawbench, testbed-train:<n>[:<seed>], mjbench, ...) or a prompt file."""
    try:
        prompts = load_prompt_set(spec).prompts
    except (PromptSetError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None
    if not prompts:
        raise ConfigError(f"prompt source {spec!r} holds no prompts")
    return prompts


def _testbed_edits(spec: str, num_prompts: int | None) -> PromptSet:
    try:
        count, seed = parse_edit_set(spec)
    except ValueError as err:
        raise PromptSetError(str(err)) from None
    prompts = sample_edit_prompts(min(count, num_prompts or count), seed)
    return PromptSet("testbed-edit", prompts, [edit_kind(p) for p in prompts])


def _testbed(name: str, n: int, seed: int) -> PromptSet:
    part = TESTBED_SETS[name]
    try:  # held-out sets: distinct scenes (a recurring caption adds images of one scene, not another unseen caption)
        prompts = sample_captions(n, seed=seed) if part is None else sample_split_captions(n, seed, part, part != "train")
    except ValueError as err:
        raise PromptSetError(f"prompt set {name}:{n}:{seed}: {err}") from None
    return PromptSet(name, prompts, [parse_caption(p).category for p in prompts])


def _geneval() -> PromptSet:

    rows = list(read_metadata(DATA / METADATA_FILE).values())  # the file's order
    return PromptSet("geneval", [r["prompt"] for r in rows], [r["tag"] for r in rows])


def read_text_prompts(path: Path) -> PromptSet:
    """One prompt per line; '#' lines are comments and '## name' starts a category."""
    prompts, categories, current = [], [], ""
    for line in _read_utf8(path).splitlines():
        text = line.strip()
        if text.startswith("##"):
            current = text.lstrip("#").strip()
        elif text and not text.startswith("#"):
            prompts.append(text)
            categories.append(current)
    if not prompts:
        raise PromptSetError(f"prompt file {path} holds no prompts")
    return PromptSet(path.stem, prompts, categories)


def _read_utf8(path: Path) -> str:
    """A prompt file's text; one line (not a traceback) for a file that is not UTF-8 or cannot be read."""
    try:
        return read_text_file("prompt file", path)
    except ConfigError as err:
        raise PromptSetError(str(err)) from None


def _read_json(path: Path):
    try:
        return json.loads(_read_utf8(path))
    except json.JSONDecodeError as err:
        raise PromptSetError(f"prompt file {path} is not valid JSON ({err}); give a JSON list of prompts") from None


def read_prompt_file(path: Path, column: str | None = None, category_column: str | None = None) -> PromptSet:
    """A prompt set from a text file or a table (the prompt column is found by its usual names)."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return read_text_prompts(path)
    if suffix == ".json" and isinstance(data := _read_json(path), (list, dict)):
        if isinstance(data, list) and all(isinstance(p, str) for p in data):
            return PromptSet(path.stem, [p.strip() for p in data if p.strip()])
        if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
            prompts = [(str(p).strip(), style) for style, items in data.items() for p in items if str(p).strip()]
            return PromptSet(path.stem, [p for p, _ in prompts], [s for _, s in prompts])
    if suffix not in TABLE_SUFFIXES:
        raise PromptSetError(f"prompt file {path} has an unsupported type {suffix!r}; valid: .txt, {', '.join(TABLE_SUFFIXES)}")
    return _from_rows(str(path), _read_table(path), column, category_column)


def _read_table(path: Path) -> list[dict]:
    import pandas as pd  # heavy; only for prompt tables

    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            frame = pd.read_parquet(path)
        elif suffix in (".jsonl", ".json"):
            frame = pd.read_json(path, lines=suffix == ".jsonl")
        else:
            frame = pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",")
    except (ValueError, OSError) as err:
        raise PromptSetError(f"cannot read prompt file {path}: {err}") from err
    return frame.to_dict("records")


def _from_rows(where: str, rows: list[dict], column: str | None, category_column: str | None) -> PromptSet:
    names = list(rows[0]) if rows else []
    column = column or next((c for c in ("prompt", "Prompt", "Prompts", "caption", "text") if c in names), None)
    if column is None or column not in names:
        raise PromptSetError(f"{where} has no prompt column{f' {column!r}' if column else ''}; its columns: {', '.join(map(str, names))}")
    prompts, categories = [], []
    for row in rows:
        value = row.get(column)
        if isinstance(value, str) and value.strip():
            prompts.append(value.strip())
            categories.append(str(row.get(category_column, "")) if category_column else "")
    if not prompts:
        raise PromptSetError(f"{where} holds no prompts in column {column!r}")
    return PromptSet(Path(where).stem, prompts, categories)


def _hub_set(name: str, hub: HubPromptSet, options: dict) -> PromptSet:
    source = options.get("source")
    if source:
        path = Path(str(source)).expanduser()
        if not path.is_file():
            raise PromptSetError(f"{name}[source=...]: file not found: {path}")
        result = _from_rows(str(path), _read_table(path), hub.column, hub.category_column if _has_column(path, hub.category_column) else None)
    else:
        from datasets import load_dataset

        split = options.get("split", hub.split)
        try:
            # streaming reads only this split's files (Pick-a-Pic's full set is hundreds of GB)
            rows = list(load_dataset(hub.repo_id, split=split, streaming=True))
        except Exception as err:  # datasets raises many types (network, missing split, offline)
            raise PromptSetError(
                f"cannot load prompt set {name!r} from the hub ({hub.repo_id}, split {split}): {err}; "
                f"offline, pass a local copy: {name}[source=<file with a {hub.column!r} column>]"
            ) from err
        result = _from_rows(f"{hub.repo_id}:{split}", rows, hub.column, hub.category_column)
    result.name = name
    return result


def _has_column(path: Path, column: str | None) -> bool:
    return bool(column) and column in (_read_table(path)[:1] or [{}])[0]


def _hpsv2(name: str, options: dict) -> PromptSet:
    styles = HPSV2_STYLES if name == "hpsv2" else (name.removeprefix("hpsv2-"),)
    if any(s not in HPSV2_STYLES for s in styles):
        raise PromptSetError(f"unknown HPSv2 style in {name!r}; valid: {', '.join('hpsv2-' + s for s in HPSV2_STYLES)}")
    source = options.get("source")
    if source:
        # the same schema as the hub: a JSON list of prompts, or {style: [prompts]} (hpsv2.benchmark_prompts('all'))
        path = Path(str(source)).expanduser()
        if not path.is_file():
            raise PromptSetError(f"{name}[source=...]: file not found: {path}")
        data = json.loads(path.read_text(encoding="utf-8"))
        by_style = {s: data.get(s, []) for s in styles} if isinstance(data, dict) else {styles[0] if len(styles) == 1 else "": data}
    else:
        by_style = {s: _download_hpsv2_style(s, name) for s in styles}
    prompts, categories = [], []
    for style, items in by_style.items():
        if not isinstance(items, list) or not all(isinstance(p, str) for p in items):
            raise PromptSetError(f"HPSv2 prompts for {style or name!r} must be a JSON list of strings")
        kept = [p.strip() for p in items if p.strip()]
        prompts += kept
        categories += [style] * len(kept)
    if not prompts:
        raise PromptSetError(f"prompt set {name!r} holds no prompts")
    return PromptSet(name, prompts, categories)


def _download_hpsv2_style(style: str, name: str) -> list:
    from huggingface_hub import hf_hub_download

    try:
        local = hf_hub_download(HPSV2_REPO, f"benchmark/{style}.json", repo_type="dataset")
    except Exception as err:  # network / offline / missing file
        raise PromptSetError(
            f"cannot download HPSv2 prompts ({HPSV2_REPO} benchmark/{style}.json): {err}; "
            f"offline, pass {name}[source=<json list of prompts>]"
        ) from err
    return json.loads(Path(local).read_text(encoding="utf-8"))

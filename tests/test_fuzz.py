"""A fuzzer, not a list (issue 61 item 4): bad values made from every option's declaration (align.cli.option:
its type, range, choices, path kind and file formats; rewards.score's argparse types) for every option of every entry
point, each run in-process through the command's main(argv). For each: a non-zero exit, one line naming the option,
no traceback, nothing written (the workspace, a finished run and a locked one beside it, unchanged; the output folder
not made).

The default suite runs a fixed sample: for each entry point, each class of bad value (NaN, inf, 1e308, a huge integer,
just outside the range, NUL, an ANSI escape, U+202E, a Latin-1 byte, a line break, a word not among the choices, each
kind of bad path, each wrong file shape) on one option, chosen by a stable hash. `make fuzz` runs every case. What the
generator cannot reach (kill -9, a full disk, damaged files) stays in tests/test_catalogue.py and tests/test_faults*.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import shutil
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from align.data.precompute import PrecomputeConfig
from align.declared import Interval
from align.eval.best_of_n import BestOfNConfig
from align.eval.evaluate import EvalConfig
from align.judgebench.benchmark import JudgeBenchConfig
from align.train.ddpo_config import DDPOConfig
from align.train.dpo_config import DPOConfig
from align.train.reward_model import RewardTrainConfig
from align.validation import INT_LIMIT, SEED_LIMIT
from rewards.score import build_parser

sys.path.insert(0, str(Path(__file__).parent))
from test_catalogue import ENTRIES, PASTED_KEY, Workspace, base, ws  # noqa: F401  (ws: a fixture)

CONFIGS = {"dpo": DPOConfig, "ddpo": DDPOConfig, "train_reward": RewardTrainConfig, "evaluate": EvalConfig,
           "best_of_n": BestOfNConfig, "judgebench": JudgeBenchConfig, "precompute": PrecomputeConfig}
TEXT = {"text-nul": "a\x00b", "text-ansi": "\x1b[31mred\x1b[0m", "text-bidi": "abc\u202edcba",
        "text-latin1": "caf\udce9", "text-newline": "two\nlines"}  # \udce9: the byte 0xe9 as Python hands argv over
NUMBERS = {"nan": "nan", "inf": "inf", "-inf": "-inf", "1e308": "1e308", "-1e308": "-1e308", "huge-int": str(10**30),
           "-huge-int": str(-10**30), "zero": "0", "-zero": "-0"}
# Files of the wrong shape for each format an option reads (written under <workspace>/fuzz).
SHAPES = {
    ".json": {"object": "{}", "numbers": "[1, 2]", "string": '"text"', "null": "null", "rows": '[{"x": 1}]', "cut": "["},
    ".jsonl": {"number": "1\n", "list": "[]\n", "row": '{"x": 1}\n', "text": "not json\n"},
    ".txt": {"latin1": b"caf\xe9\n", "empty": b"", "nul": b"a\x00b\n"},
    ".csv": {"empty": "", "columns": "x,y\n1,2\n"},
    ".tsv": {"empty": "", "columns": "x\ty\n1\t2\n"},
    ".parquet": {"garbage": b"PAR1" + bytes(range(200)) + b"PAR1", "columns": "table", "empty": b""},
    ".sqlite": {"garbage": b"SQLite format 3\x00" + bytes(100)},
}


@dataclass(frozen=True)
class Case:
    entry: str
    option: str  # the field (or rewards.score's flag / "images")
    label: str  # the class of bad value
    value: object  # the text typed, or a function of the workspace giving it
    context: tuple[str, ...] = ()  # flags that put the option where it applies
    drop: tuple[str, ...] = ()  # flags of the base command the option replaces

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.option}-{self.label}"


# ------------------------------------------------------------------------------------------ the generator


def _base_type(annotation) -> type | None:
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    origin = typing.get_origin(args[0])
    return list if origin is list else args[0] if args[0] in (bool, int, float, str) else None


def _outside(interval: Interval | None, kind: type) -> dict[str, str]:
    """Values just outside a declared range."""
    if interval is None:
        return {}
    values = {}
    if math.isfinite(interval.low):
        low = interval.low if interval.low_open else (interval.low - 1 if kind is int else math.nextafter(interval.low, -math.inf))
        values["below-range"] = str(int(low) if kind is int else low)
    if math.isfinite(interval.high):
        high = interval.high if interval.high_open else (interval.high + 1 if kind is int else math.nextafter(interval.high, math.inf))
        values["above-range"] = str(int(high) if kind is int else high)
    return values


def _number_is_bad(text: str, kind: type, name: str, interval: Interval | None) -> bool:
    try:
        value = int(text) if kind is int else float(text)
    except ValueError:
        return True
    if kind is int and not (0 <= value <= SEED_LIMIT if name.endswith("seed") else abs(value) <= INT_LIMIT):
        return True
    return not math.isfinite(value) or (interval is not None and value not in interval)


def _path_values(kind: str) -> dict[str, object]:
    values = {"path-empty": "", "path-dangling": lambda w: f"{w.root}/fuzz/dangling", "path-loop": lambda w: f"{w.root}/fuzz/loop_a",
              "path-under-a-file": lambda w: f"{w.a_file}/x", "path-under-a-dangling-link": lambda w: f"{w.root}/fuzz/dangling/x"}
    if kind == "output":
        values.update({"path-a-file": lambda w: w.a_file, "path-unwritable": "/proc/t2i-align-fuzz"})
    else:
        values["path-missing"] = lambda w: f"{w.root}/fuzz/no_such_thing.txt"
    if kind == "file":
        values["path-a-folder"] = lambda w: w.empty_dir
    if kind == "folder":
        values["path-a-file"] = lambda w: w.a_file
    return values


def field_values(field: dataclasses.Field, annotation) -> dict[str, object]:
    """label -> bad value, from the field's type and declaration."""
    kind, meta = _base_type(annotation), field.metadata
    if kind is bool:
        return {"not-a-bool": "maybe"}
    if kind in (int, float):
        interval = meta.get("within")
        candidates = {**NUMBERS, "not-a-number": "twelve", **_outside(interval, kind)}
        return {label: text for label, text in candidates.items() if _number_is_bad(text, kind, field.name, interval)}
    if kind not in (str, list):
        return {}
    values: dict[str, object] = dict(TEXT)
    if "choices" in meta or "pattern" in meta:
        values["not-a-choice"] = "no-such-choice"
    if "path" in meta:
        values.update(_path_values(meta["path"]))
        if type(None) in typing.get_args(annotation):
            del values["path-empty"]  # "" unsets an optional path (a flag undoing a --config file's value)
        for suffix in meta.get("formats", ()):
            for shape in SHAPES.get(suffix, {}):
                values[f"{suffix[1:]}-{shape}"] = lambda w, s=suffix, h=shape: f"{w.root}/fuzz/{h}{s}"
    return values


def context_of(entry: str, field: dataclasses.Field) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(flags that make the option apply, base flags it replaces): a value is tried where it is used."""
    context: tuple[str, ...] = ()
    applies = field.metadata.get("applies")
    if applies:
        flag, _, values = applies.partition(" ")
        if values:
            context = (flag, values.split(",")[0])
        else:
            context = {"--cmmd": ("--cmmd", "true", "--fid_reference", "testbed"),
                       "--fid_reference": ("--fid_reference", "testbed"),
                       "--dataset": ("--dataset", "GOOD_PAIRS")}.get(flag, ())
    drop = ("--reward",) if entry == "dpo" and (field.name in ("dataset", "latent_store", "dataset_split")) else ()
    return context, drop


def entry_cases() -> list[Case]:
    cases = []
    for entry, config_class in CONFIGS.items():
        hints = typing.get_type_hints(config_class)
        for field in dataclasses.fields(config_class):
            context, drop = context_of(entry, field)
            for label, value in field_values(field, hints[field.name]).items():
                cases.append(Case(entry, field.name, label, value, context, drop))
    for action in build_parser()._actions:  # rewards.score: argparse, its types carry their declarations
        declared = getattr(action.type, "declared", None)
        if declared is None:
            continue
        name = action.option_strings[0].lstrip("-") if action.option_strings else "images"
        if "within" in declared:
            interval = Interval.parse(declared["within"])
            values = {k: v for k, v in {**NUMBERS, **_outside(interval, int)}.items() if _number_is_bad(v, int, name, interval)}
        else:
            values = {**TEXT, **(_path_values("file") if declared.get("kind") == "file" else {})}
            if "pattern" in declared:
                values["not-a-choice"] = "no-such-choice"
        cases += [Case("score", name, label, value) for label, value in values.items()]
    return cases


def sampled(cases: list[Case]) -> set[str]:
    """The default suite's fixed sample: for each entry point and class of bad value, one option (a stable hash)."""
    chosen: dict[tuple[str, str], Case] = {}
    for case in cases:
        key = (case.entry, case.label)
        rank = hashlib.sha256(case.id.encode()).hexdigest()
        if key not in chosen or rank < hashlib.sha256(chosen[key].id.encode()).hexdigest():
            chosen[key] = case
    return {case.id for case in chosen.values()}


CASES = entry_cases()
SAMPLE = sampled(CASES)


# ------------------------------------------------------------------------------------------ the workspace


@pytest.fixture(scope="module")
def fz(ws):  # noqa: F811
    """The catalogue's workspace, with the links and wrong-shaped files the generator names (under fuzz/)."""
    root = Path(ws.root) / "fuzz"
    if not root.exists():
        root.mkdir()
        os.symlink(root / "nowhere", root / "dangling")
        os.symlink(root / "loop_b", root / "loop_a")
        os.symlink(root / "loop_a", root / "loop_b")
        for suffix, shapes in SHAPES.items():
            for shape, content in shapes.items():
                path = root / f"{shape}{suffix}"
                if content == "table":
                    pq.write_table(pa.table({"x": [1, 2]}), path)
                else:
                    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return ws


def snapshot(root: Path) -> dict:
    """Every entry under ``root`` (links not followed) with its size and modification time: cheap enough for
    thousands of cases, and any write shows."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = path.lstat()
            state[str(path.relative_to(root))] = "dir" if path.is_dir() and not path.is_symlink() else \
                (info.st_size, info.st_mtime_ns)
    return state


def argv_of(case: Case, ws: Workspace) -> list[str]:  # noqa: F811
    argv = base(case.entry, ws)
    for name in case.drop:
        i = argv.index(name)
        del argv[i: i + 2]
    value = case.value(ws) if callable(case.value) else case.value
    context = [ws.good_pairs if part == "GOOD_PAIRS" else part for part in case.context]
    if case.entry == "score" and case.option == "images":
        return [*argv[:-1], *context, value]
    flag = f"--{case.option}"
    return [*argv, *context, f"{flag}={value}"]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=() if c.id in SAMPLE else pytest.mark.slow)
                                  for c in CASES])
def test_a_bad_value_is_refused_in_one_line_naming_its_option(case: Case, fz: Workspace, capsys, monkeypatch):
    monkeypatch.chdir(fz.root)
    shutil.rmtree(fz.out, ignore_errors=True)  # left by a case that failed (it would fail every case after it)
    before = snapshot(Path(fz.root))
    argv = argv_of(case, fz)
    capsys.readouterr()
    try:
        code = ENTRIES[case.entry](argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code not in (0, None), text[-2000:]
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1, text[-2000:]
    names = {f"--{case.option}", f"--{case.option.replace('_', '-')}"} if case.option != "images" else {"image"}
    assert any(name in errors[0] for name in names), errors[0]
    assert not any(char in text for char in "\x00\x1b\u202e\udce9"), text  # echoed escaped, never raw
    assert PASTED_KEY not in text
    assert snapshot(Path(fz.root)) == before
    assert not Path(fz.out).exists()


def test_the_fuzzer_covers_every_option_of_every_entry_point():
    """Every option of every entry point gets bad values from its declaration, and every number declares its range
    (a new option without one is named here: add ``within=`` to its option())."""
    covered = {(c.entry, c.option) for c in CASES}
    undeclared = []
    for entry, config_class in CONFIGS.items():
        hints = typing.get_type_hints(config_class)
        for field in dataclasses.fields(config_class):
            assert (entry, field.name) in covered, (entry, field.name)
            if _base_type(hints[field.name]) in (int, float) and "within" not in field.metadata:
                undeclared.append(f"{config_class.__name__}.{field.name}")
    assert not undeclared, f"numbers without a declared range: {', '.join(undeclared)}"
    assert {c.entry for c in CASES} == set(ENTRIES)
    assert len(SAMPLE) < len(CASES) // 4  # the default suite's share


# ------------------------------------------------------------------------------------------ --dry_run

DRY_RUN_CASES = {  # what only the whole config shows (no single option is wrong): the run and its dry run refuse alike
    "ddpo-ppo-with-a-deterministic-sampler": ("ddpo", ["--sampler", "ode"], "needs a stochastic sampler"),
    "ddpo-epoch-not-whole-batches": ("ddpo", ["--samples_per_epoch", "6", "--sample_batch_size", "4"], "multiple of"),
    "dpo-reward-and-dataset": ("dpo", ["--dataset", "GOOD_PAIRS"], "exactly one"),
}


@pytest.mark.parametrize("entry,extra,says", DRY_RUN_CASES.values(), ids=DRY_RUN_CASES)
def test_dry_run_refuses_what_the_run_refuses_with_the_same_line(entry, extra, says, fz, capsys, monkeypatch):
    """Issue 61 finding 5: --dry_run printed a plan for a combination the run refuses. It runs the run's checks."""
    monkeypatch.chdir(fz.root)
    argv = [*base(entry, fz), *[fz.good_pairs if part == "GOOD_PAIRS" else part for part in extra]]
    lines = []
    for dry in ((), ("--dry_run", "true")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            ENTRIES[entry]([*argv, *dry])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err
        lines += [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 2 and lines[0] == lines[1] and says in lines[0], lines
    assert not Path(fz.out).exists()

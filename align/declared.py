"""What an option declares beyond its type (``align.cli.option``), and the checks that follow from the declaration.

    learning_rate: float = option(1e-4, "AdamW learning rate", "optimisation", within="(0, 1]")
    finetune: str = option("lora", "lora or full", "model", choices=("full", "lora"))
    prompts: str = option("parti", "a prompt set or a file", "data", path="file", or_name=True,
                          formats=(".txt", ".json", ".jsonl", ".csv", ".parquet"))
    nft_beta: float = option(1.0, "...", "--algorithm nft", within="(0, 100]")   # applies only with --algorithm nft

``align.validation.check_config_values`` runs these for every field of a config, with the checks each type implies
whether or not anything is declared (a float is finite; an integer within +-(2^31 - 1), a seed within numpy's range;
text is UTF-8 without control characters or bidirectional overrides), before anything is written. The fuzzer
(tests/test_fuzz.py) reads the same declarations to make the bad values it tries.
"""

from __future__ import annotations

import errno
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from align.errors import ConfigError
from rewards.inputs import shown, text_problem

# Path kinds: an existing file, an existing folder, either, or a folder the command writes (made if missing).
PATH_KINDS = ("file", "folder", "any", "output")
# Ranges many options share (``within=``). Counts stay below 2^31 (a tensor index, a loop that ends); batches, ranks and
# image sides within what any GPU holds; rates and coefficients where training still means something.
SEED = "[0, 4294967295]"  # numpy's generators take [0, 2^32)
COUNT = "[1, 2147483647]"  # steps, epochs, pairs, prompts, cadences
COUNT_OR_ZERO = "[0, 2147483647]"  # 0: off / all
BATCH = "[1, 65536]"  # images, pairs or samples per call, accumulation, ranks
RESOLUTION = "[8, 8192]"  # image side in pixels
SAMPLING_STEPS = "[1, 10000]"  # denoising steps (also at most the scheduler's own: align.pipeline.check_sampling_steps)
GUIDANCE = "[0, 100]"  # classifier-free guidance (the papers: 1-15; FLUX's embedding 3.5)
LEARNING_RATE = "(0, 1]"
SHARE = "[0, 1)"  # dropouts, held-out shares
COEFFICIENT = "[0, 1000000]"  # a loss weight, a clip norm or a cost cap (0: off)
POSITIVE = "(0, 1000000]"  # a temperature, a beta, a clip range
WEIGHT_DECAY = "[0, 1000]"  # AdamW decays by lr x this a step
ADAM_BETA = "[0, 1)"
PROMPT_FILES = (".txt", ".json", ".jsonl", ".csv", ".tsv", ".parquet")  # align.data.prompt_sets


def flag(name: str) -> str:
    """How an input is named in a message: a field as its flag (--learning_rate), anything else as given."""
    return name if name.startswith("-") or " " in name else f"--{name}"


# ------------------------------------------------------------------------------------------------ numbers


@dataclass(frozen=True)
class Interval:
    """A declared range, written as in mathematics: "[0, 1)", "(0, inf)", "[1, 8192]"."""

    low: float
    high: float
    low_open: bool
    high_open: bool

    @classmethod
    def parse(cls, text: str) -> Interval:
        text = text.strip()
        if len(text) < 5 or text[0] not in "[(" or text[-1] not in "])" or text.count(",") != 1:
            raise ValueError(f"a range is written '[low, high]' with ( or ) for an open end, got {text!r}")
        low, high = (float(part) for part in text[1:-1].split(","))
        if not low < high:
            raise ValueError(f"an empty range: {text!r}")
        return cls(low, high, text[0] == "(", text[-1] == ")")

    def __contains__(self, value) -> bool:
        above_low = value > self.low if self.low_open else value >= self.low
        below_high = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above_low and below_high

    def describe(self) -> str:
        """How a message says it: "> 0", ">= 1", "<= 10", "in [0, 1)"."""
        if math.isinf(self.high) and math.isinf(self.low):
            return "a finite number"
        if math.isinf(self.high):
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if math.isinf(self.low):
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        return f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}{')' if self.high_open else ']'}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(value)


def check_within(name: str, value, interval: Interval) -> None:
    if value not in interval:
        raise ConfigError(f"{flag(name)} must be {interval.describe()}, got {value}")


# ------------------------------------------------------------------------------------------------ text


def check_text(name: str, value: str) -> None:
    if problem := text_problem(value):
        raise ConfigError(f"{flag(name)} {shown(value)} {problem}")


def one_of(values) -> str:
    """"a or b", "a, b or c"."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def check_choice(name: str, value: str, choices) -> None:
    allowed = tuple(str(c) for c in (choices() if callable(choices) else choices))
    if value not in allowed:
        words = one_of(allowed) if len(allowed) <= 2 else f"one of {', '.join(allowed)}"
        raise ConfigError(f"{flag(name)} must be {words}, got {shown(value)}")


def check_pattern(name: str, value: str, pattern: tuple[str, str]) -> None:
    """A value of a declared form (``pattern``: a regular expression the whole value matches, and how a message says
    it)."""
    regex, described = pattern
    if not re.fullmatch(regex, value):
        raise ConfigError(f"{flag(name)} must be {described}, got {shown(value)}")


# Torch devices a command runs on (a typo such as "gpu" would end in torch's traceback after the folder is made).
DEVICE = (r"auto|cpu|mps|cuda(:\d+)?", "auto, cpu, mps, cuda or cuda:<n>")


# ------------------------------------------------------------------------------------------------ paths


def looks_local(value: str) -> bool:
    """A value that names a local path (rather than a hub id, a prompt set or 'testbed'): it starts as a path does, or
    something is there."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..") or os.path.lexists(value)


def link_problem(path: Path) -> str | None:
    """A link on ``path`` that leads nowhere (dangling) or to itself (a loop), or None."""
    try:
        path.resolve(strict=True)
        return None
    except FileNotFoundError:
        pass
    except (RuntimeError, OSError) as err:  # a symlink loop: RuntimeError before Python 3.13, OSError(ELOOP) since
        if isinstance(err, OSError) and err.errno != errno.ELOOP:
            return None
        return "is a link that loops back on itself"
    for prefix in [*reversed(path.parents), path]:
        if prefix.is_symlink() and not prefix.exists():
            target = os.readlink(prefix)
            where = "" if prefix == path else f" ({str(prefix)!r} on its path)"
            return f"is a link to {target!r}, which does not exist{where}"
    return None


def check_path(name: str, value: str, kind: str, or_name: bool = False) -> None:
    """A path option names what its declaration says: an existing file, folder or either, or a folder it may write
    (``output``: made if missing); a dangling or looping link is refused. With ``or_name`` a value that does not look
    like a local path is a name (a hub id, a prompt set), left to the option's own check."""
    if or_name and not looks_local(value):
        return
    path = Path(value).expanduser()
    if problem := link_problem(path):
        raise ConfigError(f"{flag(name)} {shown(value)} {problem}")
    if kind == "output":
        return  # where it may be written: align.validation.check_writable_dir
    what = {"file": "file", "folder": "folder", "any": "file or folder"}[kind]
    if not path.exists():
        raise ConfigError(f"{flag(name)} {shown(value)}: no such {what}")
    if kind == "file" and not path.is_file():
        raise ConfigError(f"{flag(name)} {shown(value)} is a folder; give a file")
    if kind == "folder" and not path.is_dir():
        raise ConfigError(f"{flag(name)} {shown(value)} is a file; give a folder")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag(name)} {shown(value)}: no permission to read it")


# ------------------------------------------------------------------------------------------------ what applies


def applies_to(declared: str) -> tuple[str, tuple[str, ...]]:
    """("algorithm", ("nft",)) from "--algorithm nft"; ("cmmd", ()) from "--cmmd" (the option applies when that
    flag is set)."""
    flag_name, _, values = declared.partition(" ")
    return flag_name.removeprefix("--"), tuple(v for v in values.split(",") if v)


def check_applies(config, name: str, value, default, declared: str, describe=None) -> None:
    """An option given a value of its own where it does not apply (another algorithm's, a search not run) would be
    ignored: refused in one line. ``describe(flag, value)``: a title for the choice it belongs to, if any."""
    if value == default:
        return
    other, values = applies_to(declared)
    current = getattr(config, other)
    if (current in values) if values else bool(current):
        return
    if not values:
        raise ConfigError(f"{flag(name)} applies only with --{other}: set --{other}, or leave {flag(name)} out")
    title = describe(other, values[0]) if describe else None
    owner = f"--{other} {one_of(values)}" + (f" ({title})" if title else "")
    verb = {"algorithm": "trains"}.get(other, "has")
    raise ConfigError(f"{flag(name)} is an option of {owner}; this run {verb} --{other} {current}: leave it out")

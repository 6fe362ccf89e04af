"""One validation layer for every entry point: numbers, paths and text files, checked before any
expensive work and before anything is written.

Every failure is a ``ConfigError`` (a ValueError) or a ``ConfigTypeError`` (a TypeError) whose message
is one line naming the input, what was wrong and what would be valid; ``main()`` turns it into
``error: <message>`` and exit status 2, ``train(config)`` / ``evaluate(config)`` raise it as it is.

- ``check_config_values(config)``: every field of a config dataclass has its declared type and every
  float is finite (NaN passes ``x <= 0``; a field whose metadata has ``allow_nonfinite`` may hold inf/NaN).
  ``align.cli.parse_config`` and each config's ``validate()`` call it.
- ``check_range``: a number within bounds (and finite).
- ``check_readable_file`` / ``check_writable_dir``: a path exists, is of the right kind, and may be
  read / written by this user.
- ``read_text_file``: a text file as UTF-8, or one line saying where it is not.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import types
import typing
from pathlib import Path

from align.declared import (
    check_applies,
    check_choice,
    check_path,
    check_pattern,
    check_text,
    check_within,
    flag,
    looks_local,
    shown,
)
from align.errors import ConfigError
from align.run_folder import check_not_locked, holds_training_run


class ConfigTypeError(ConfigError, TypeError):
    """A config value of the wrong type (a string where a number goes); a ValueError and a TypeError."""


def _allowed_types(annotation) -> tuple[type, ...] | None:
    """The plain types a field annotation allows (None: not a simple type, no check)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        allowed = []
        for arg in typing.get_args(annotation):
            sub = _allowed_types(arg)
            if sub is None:
                return None
            allowed.extend(sub)
        return tuple(allowed)
    if annotation is type(None):
        return (type(None),)
    if annotation in (bool, int, float, str):
        return (annotation,)
    return None


def _type_ok(value, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # bool is an int subclass: only a bool field takes it
        return bool in allowed
    if isinstance(value, int) and float in allowed:  # 1 where 1.0 goes
        return True
    if isinstance(value, os.PathLike) and str in allowed:  # a Path where a path string goes
        return True
    return isinstance(value, tuple(t for t in allowed if t is not bool))


def _type_name(allowed: tuple[type, ...]) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "none"}
    return " or ".join(names[t] for t in allowed)


def check_config_values(config) -> None:
    """Every field of the dataclass ``config`` checked from its declaration (align.cli.option, align/declared.py):
    its type, and what the type implies whether declared or not (a finite float, an integer of a sane size, text
    without control characters or bidirectional overrides); its range, choices and path kind where declared; then an
    option given where it does not apply (``applies``) is refused. The same checks run at parse time and in every
    config's validate(), so ``train(config)`` checks what the command line does."""
    hints = typing.get_type_hints(type(config))
    fields = dataclasses.fields(config)
    for field in fields:
        check_declared_value(field, getattr(config, field.name), hints.get(field.name))
    describe = getattr(config, "choice_title", None)
    for field in fields:
        if "applies" in field.metadata and field.default is not dataclasses.MISSING:
            check_applies(config, field.name, getattr(config, field.name), field.default, field.metadata["applies"],
                          describe)


def check_declared_value(field: dataclasses.Field, value, annotation) -> None:
    """One field's value against its type and declaration."""
    name, meta = field.name, field.metadata
    allowed = _allowed_types(annotation)
    if allowed is not None and not _type_ok(value, allowed):
        raise ConfigTypeError(f"{flag(name)} must be {_type_name(allowed)}, got {shown(value) if isinstance(value, str) else repr(value)}")
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, float) and not math.isfinite(item) and not meta.get("allow_nonfinite"):
            raise ConfigError(f"{flag(name)} must be a finite number, got {item}")
        if isinstance(item, int) and not isinstance(item, bool):
            check_int_size(name, item)
        if isinstance(item, str):
            check_text(name, item)
        if item is None or isinstance(item, bool):
            continue
        if "within" in meta and isinstance(item, (int, float)):
            check_within(name, item, meta["within"])
        if "choices" in meta and isinstance(item, str):
            check_choice(name, item, meta["choices"])
        if "pattern" in meta and isinstance(item, str):
            check_pattern(name, item, meta["pattern"])
        if "path" in meta and isinstance(item, (str, os.PathLike)):
            if str(item) == "" and allowed is not None and type(None) in allowed:
                continue  # an optional path given as "" is unset (how a flag undoes a --config file's value)
            check_path_option(name, str(item), meta["path"], meta.get("or_name", False))
            if "reads" in meta and looks_local(str(item)):
                check_content(name, str(item), meta["reads"])


def check_content(name: str, value: str, reads) -> None:
    """A local file's content read as its option declares (``reads``): a wrong shape is one line naming the option."""
    try:
        reads(value)
    except (ValueError, OSError) as err:  # ConfigError, DataError and the readers' own are ValueErrors
        message = " ".join(str(err).split())
        raise ConfigError(message if flag(name) in message else f"{flag(name)}: {message}") from None


def check_path_option(name: str, value: str, kind: str, or_name: bool) -> None:
    """A declared path: not empty, no dangling or looping link, the kind it declares (an output folder: one this user
    can write where it would be made)."""
    if not value.strip():
        what = "folder path (. for the current folder)" if kind in ("folder", "output") else f"{kind} path"
        raise ConfigError(f"{flag(name)} is empty; give a {what.replace('any path', 'file or folder path')}")
    check_path(name, value, kind, or_name)
    if kind == "output":
        check_writable_dir(name, value)


# Seeds go to numpy and torch generators (numpy takes [0, 2^32)); every other count or size of a config is far below
# 2^31 (a loop count, a number of pairs, pixels): larger ones would overflow a tensor index or run for ever.
SEED_LIMIT = 2**32 - 1
INT_LIMIT = 2**31 - 1
# Sizes that allocate memory at once, checked before any model is built (per field: the largest value accepted).
SIZE_LIMITS = {"resolution": 8192, "lora_rank": 4096}


def check_int_size(name: str, value: int) -> None:
    """A seed within numpy's [0, 2^32 - 1], any other integer within +-(2^31 - 1), and resolution / lora_rank
    within what a GPU can hold at all (SIZE_LIMITS)."""
    if name == "seed" or name.endswith("_seed"):
        if not 0 <= value <= SEED_LIMIT:
            raise ConfigError(f"{flag(name)} must be in [0, {SEED_LIMIT}], got {value}")
    elif abs(value) > INT_LIMIT:
        raise ConfigError(f"{flag(name)} must be at most {INT_LIMIT:,} in size, got {value}")
    if name in SIZE_LIMITS and value > SIZE_LIMITS[name]:
        raise ConfigError(f"{flag(name)} must be at most {SIZE_LIMITS[name]}, got {value}")


def check_range(name: str, value, low=None, high=None, *, low_open: bool = False, high_open: bool = False) -> None:
    """``value`` is a finite number within [low, high] (an open end with low_open/high_open; None: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{flag(name)} must be a number, got {value!r}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if not math.isfinite(value) or below or above:
        raise ConfigError(f"{flag(name)} must be {_interval(low, high, low_open, high_open)}, got {value}")


def _interval(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"a finite number {'>' if low_open else '>='} {low}" if low is not None else "a finite number"
    if low is None:
        return f"a finite number {'<' if high_open else '<='} {high}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_readable_file(name: str, path: str | Path, what: str = "file") -> Path:
    """``path`` is an existing regular file this user may read."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"{flag(name)} {str(path)!r}: no such {what}")
    if not path.is_file():
        raise ConfigError(f"{flag(name)} {str(path)!r} is not a file; give a {what}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{flag(name)} {str(path)!r}: no permission to read it")
    return path


def check_writable_dir(name: str, path: str | Path) -> Path:
    """``path`` is a folder this user can create or write into: it exists as a writable folder, or its nearest
    existing parent is one. Nothing is created."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag(name)} {str(path)!r} exists and is not a folder; give a folder path")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(f"{flag(name)} {str(path)!r}: {str(existing)!r} is a file, so no folder can be made there")
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_create_in(existing):
        where = "it" if existing == path else f"its parent {str(existing)!r}"
        raise ConfigError(f"{flag(name)} {str(path)!r}: cannot write into {where}; choose a writable folder")
    return path


def _can_create_in(folder: Path) -> bool:
    """Whether a folder can really be made here (os.access says yes to root on read-only or virtual file
    systems such as /proc): an empty probe folder, removed at once."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".t2i-align-probe-", dir=folder))
    except OSError:
        return False
    return True


def read_text_file(name: str, path: str | Path, what: str = "text file") -> str:
    """The file's text, decoded as UTF-8 (a byte-order mark is dropped); one line saying where it is not UTF-8."""
    path = check_readable_file(name, path, what)
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{flag(name)} {str(path)!r} is not UTF-8 text (byte 0x{data[err.start]:02x} on line {line}); "
            "save it as UTF-8"
        ) from None


def check_common_inputs(config) -> None:
    """What every command's config shares: every value checked from its declaration (check_config_values; a
    --output_dir declared as an output folder is one this user can write). The first line of each config's
    validate(), so ``train(config)`` checks exactly what the command line does."""
    check_config_values(config)


def check_not_a_training_run(config, command: str) -> None:
    """An evaluation command's --output_dir is not a training run's folder (its report.html and config.yaml would
    be replaced) nor a folder a run is writing into."""
    if holds_training_run(config.output_dir):
        raise ConfigError(
            f"--output_dir {config.output_dir!r} holds a training run; {command} would replace its report.html and "
            "files: choose another --output_dir (e.g. a folder inside it)"
        )
    try:
        check_not_locked(config.output_dir)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_parquet_columns(name: str, path: str | Path, columns: tuple[str, ...]) -> None:
    """A local .parquet file is readable as parquet (its footer, not its rows) and has ``columns``."""
    path = check_readable_file(name, path, "parquet file")
    import pyarrow.parquet as pq

    try:
        found = pq.read_schema(path).names
    except Exception as err:  # pyarrow's errors: ArrowInvalid, OSError, ...
        raise ConfigError(f"{flag(name)} {str(path)!r} is not a readable parquet file ({' '.join(str(err).split())})") from None
    missing = [c for c in columns if c not in found]
    if missing:
        raise ConfigError(
            f"{flag(name)} {str(path)!r} lacks the column(s) {', '.join(missing)}; needed: {', '.join(columns)} "
            f"(found: {', '.join(found)})"
        )


def check_weight_files(name: str, folder: str | Path) -> None:
    """Every .safetensors file of a local model folder (and its subfolders one level down: unet/, final/) has an
    intact header covering the whole file, and every .json file there (model_index.json, config.json, ...) parses:
    a truncated or corrupt model file is named here, before any work."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return  # a hub id, or a path that the model's own check reports
    from safetensors import safe_open

    for config in sorted([*folder.glob("*.json"), *folder.glob("*/*.json")]):
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ConfigError(f"{flag(name)}: the model file {str(config)!r} is not valid JSON ({err}); save or "
                              "download it again") from None

    for weights in sorted([*folder.glob("*.safetensors"), *folder.glob("*/*.safetensors")]):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except Exception as err:  # safetensors' SafetensorError, OSError
            raise ConfigError(
                f"{flag(name)}: the weights file {str(weights)!r} is truncated or corrupt ({' '.join(str(err).split())}); "
                "save or download it again"
            ) from None

"""Command-line configs: a dataclass, a YAML file (--config) and flag overrides.

TRL's TrlParser does the parsing (YAML keys are dataclass fields; flags win over the file);
this module turns its failures into one clear message and a non-zero exit.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import field
from pathlib import Path
from typing import NoReturn, TypeVar

T = TypeVar("T")


GROUPS = ("model", "data", "judge", "sampling", "optimisation", "evaluation", "output")


def option(default, help: str, group: str):
    """A config field with its one-line help text and its --help group (one of GROUPS)."""
    if group not in GROUPS:
        raise ValueError(f"unknown option group {group!r}; one of {', '.join(GROUPS)}")
    return field(default=default, metadata={"help": help, "group": group})


class ConfigError(ValueError):
    """A bad value in a config; trainers raise it from their validate() before any expensive work."""


def die(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def parse_config(config_class: type[T], argv: list[str] | None = None) -> T:
    """Parse ``--config file.yaml`` plus ``--flag value`` overrides into ``config_class``."""
    import yaml
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    fields = {f.name for f in dataclasses.fields(config_class)}
    if "--config" in argv:
        index = argv.index("--config")
        if index + 1 >= len(argv):
            die("--config needs a YAML file path")
        path = Path(argv[index + 1])
        if not path.is_file():
            die(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            die(f"config file {path} is not valid YAML: {err}")
        if not isinstance(data, dict):
            die(f"config file {path} must hold a mapping of {config_class.__name__} fields")
        unknown = sorted(set(data) - fields - {"env"})
        if unknown:
            die(
                f"unknown key(s) {', '.join(unknown)} in {path}; valid keys: {', '.join(sorted(fields))}"
            )
    parser = TrlParser(dataclass_types=[config_class])
    try:
        (config,) = parser.parse_args_and_config(argv)
    except SystemExit as exit_:
        # argparse already printed its message (unknown flag, bad type); keep its exit code.
        raise SystemExit(exit_.code or 2) from None
    except (ValueError, TypeError) as err:
        die(str(err))
    return config


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)

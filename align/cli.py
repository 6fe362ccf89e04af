"""Command-line configs: a dataclass, a YAML file (--config) and flag overrides.

TRL's TrlParser does the parsing (YAML keys are dataclass fields; flags win over the file);
this module turns its failures into one clear message and a non-zero exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
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
    from rewards.secrets import scrub_text

    print(f"error: {scrub_text(message)}", file=sys.stderr, flush=True)  # a key echoed in a message stays hidden
    raise SystemExit(code)


def parse_config(config_class: type[T], argv: list[str] | None = None) -> T:
    """Parse ``--config file.yaml`` plus ``--flag value`` overrides into ``config_class``."""
    import yaml
    from trl import TrlParser

    from rewards.secrets import scrub_text

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
            data = yaml.safe_load(read_config_text(path)) or {}
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
    messages = io.StringIO()  # argparse's own messages, scrubbed: a key typed as a flag is not echoed
    try:
        with contextlib.redirect_stderr(messages):
            (config,) = parser.parse_args_and_config(argv)
    except SystemExit as exit_:
        # argparse printed its message (unknown flag, bad type; written out below); keep its exit code.
        raise SystemExit(exit_.code or 2) from None
    except (ValueError, TypeError) as err:
        die(str(err))
    finally:
        sys.stderr.write(scrub_text(messages.getvalue()))
    check_parsed_values(config)
    return config


def read_config_text(path: Path) -> str:
    from align.validation import read_text_file

    try:
        return read_text_file("--config", path, "YAML file")
    except ConfigError as err:
        die(str(err))


def check_parsed_values(config) -> None:
    """Parse-time checks every command shares (align.validation): types and finite floats (NaN passes
    ``x <= 0``), before any config or run folder is written; and secrets masked in every log record."""
    from align.validation import check_config_values
    from rewards.secrets import install_log_scrubber

    install_log_scrubber()
    try:
        check_config_values(config)
    except ConfigError as err:
        die(str(err))


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)

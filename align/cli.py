"""Command-line configs: a dataclass, a YAML file (--config) and flag overrides.

TRL's TrlParser does the parsing (YAML keys are dataclass fields; flags win over the file). Each
field is declared with `option(default, help, group)`: its help text and its --help section come
from the field's metadata, as HfArgumentParser reads `metadata={"help": ...}`. This module adds
the sections, a description, exit 0 for --help, and one clear line and exit 2 for a bad input.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from dataclasses import field
from pathlib import Path
from types import MappingProxyType
from typing import NoReturn, TypeVar

T = TypeVar("T")

# --help sections, in the order they are printed.
GROUPS = ("model", "data", "judge", "sampling", "optimisation", "evaluation", "output")


def option(default=dataclasses.MISSING, help: str = "", group: str = "", *, default_factory=dataclasses.MISSING):
    """A config field with its one-line help text and its --help group (one of GROUPS).

    Mutable defaults go through ``default_factory`` as with ``dataclasses.field``."""
    if group not in GROUPS:
        raise ValueError(f"unknown option group {group!r}; one of {', '.join(GROUPS)}")
    if not help.strip():
        raise ValueError("an option needs a help text")
    metadata = {"help": help, "group": group}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


class ConfigError(ValueError):
    """A bad value in a config; trainers raise it from their validate() before any expensive work."""


def die(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def first_paragraph(docstring: str | None) -> str | None:
    """A module docstring's first paragraph, on one line (the --help description)."""
    if not docstring:
        return None
    return " ".join(docstring.strip().split("\n\n")[0].split())


class OptionHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option once (its hyphenated alias still parses), with its default; no breaks at hyphens."""

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        first, *others = action.option_strings
        shown = ", ".join([first, *(s for s in others if not s.startswith("--") or s == "--help")])
        if action.nargs == 0:
            return shown
        return f"{shown} {self._format_args(action, self._get_default_metavar_for_optional(action))}"

    def _get_default_metavar_for_optional(self, action):
        """INT, FLOAT, STR or BOOL rather than the option's name in capitals."""
        kind = getattr(action.type, "__name__", "")
        return {"int": "INT", "float": "FLOAT", "str": "STR", "string_to_bool": "BOOL"}.get(kind, "VALUE")

    def _split_lines(self, text, width):
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def _trl_parser_class():
    from trl import TrlParser

    class SectionedParser(TrlParser):
        """TrlParser with one --help section per option group; the group key never reaches argparse."""

        def _add_dataclass_arguments(self, dtype):
            import typing

            sections = {name: self.add_argument_group(name) for name in GROUPS}
            hints = typing.get_type_hints(dtype)
            for fld in dataclasses.fields(dtype):
                if not fld.init:
                    continue
                group = fld.metadata.get("group")
                plain = copy.copy(fld)  # HfArgumentParser passes every metadata key on to add_argument
                meta = {k: v for k, v in fld.metadata.items() if k != "group"}
                if "help" in meta:  # argparse %-formats help texts ("18%" would break --help)
                    meta["help"] = meta["help"].replace("%", "%%")
                plain.type = hints[fld.name]
                plain.metadata = MappingProxyType(meta)
                self._parse_dataclass_field(sections.get(group, self), plain)

        def error(self, message):
            """A bad flag or value: one line, exit 2 (argparse would print the whole usage first)."""
            die(f"{message} (see {self.prog} --help)")

    return SectionedParser


def build_parser(config_class: type, description: str | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser behind parse_config: every field a flag, grouped, each with its help and default."""
    parser = _trl_parser_class()(
        dataclass_types=[config_class], description=first_paragraph(description), prog=prog,
        formatter_class=OptionHelpFormatter,
        epilog="--config FILE.yaml sets any of these options from a YAML mapping of option names to values; "
               "flags given on the command line override it.",
    )
    return parser


def parse_config(config_class: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """Parse ``--config file.yaml`` plus ``--flag value`` overrides into ``config_class``.

    ``description``: the command's module docstring (its first paragraph heads --help).
    --help prints and exits 0; a bad flag, value or YAML file prints one line and exits 2."""
    import yaml

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
    parser = build_parser(config_class, description)
    try:
        (config,) = parser.parse_args_and_config(argv)
    except SystemExit as exit_:
        # --help exits 0; argparse already printed its one-line message for a bad flag or value (exit 2).
        raise SystemExit(0 if exit_.code in (0, None) else 2) from None
    except (ValueError, TypeError) as err:
        die(str(err))
    return config


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)

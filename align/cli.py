"""Command-line configs: a dataclass, a YAML file (--config) and flag overrides.

TRL's TrlParser does the parsing (YAML keys are dataclass fields; flags win over the file). Each
field is declared with `option(default, help, group)`: its help text and its --help section come
from the field's metadata, as HfArgumentParser reads `metadata={"help": ...}`. This module adds
the sections, a description, exit 0 for --help, and one clear line and exit 2 for a bad input.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import errno
import io
import re
import sys
import textwrap
import typing
from dataclasses import field
from pathlib import Path
from types import MappingProxyType
from typing import NoReturn, TypeVar

import yaml

from align.declared import PATH_KINDS, Interval
from align.errors import ConfigError
from align.validation import check_config_values, read_text_file
from rewards.inputs import escaped
from rewards.secrets import install_log_scrubber, scrub_text

T = TypeVar("T")

# --help sections, in the order they are printed; after them, one section per choice that has options of its own
# (a plug-in's group is the flag and value it belongs to, e.g. "--algorithm nft").
GROUPS = ("model", "data", "judge", "sampling", "optimisation", "evaluation", "output")


def is_choice_group(group: str) -> bool:
    """A plug-in's options group: "--<flag> <value>"."""
    flag, _, value = group.partition(" ")
    return flag.startswith("--") and len(flag) > 2 and bool(value) and " " not in value


def section_title(group: str) -> str:
    """The --help section of an option group: the group's name, or "options of --algorithm nft" for a choice's."""
    return f"options of {group}" if is_choice_group(group) else group


def option(default=dataclasses.MISSING, help: str = "", group: str = "", *, default_factory=dataclasses.MISSING,
           within: str | None = None, choices=None, pattern: tuple[str, str] | None = None,
           path: str | None = None, or_name: bool = False,
           formats: tuple[str, ...] = (), reads=None, applies: str | None = None):
    """A config field with its one-line help text, its --help group (one of GROUPS, or "--<flag> <value>" for the
    options of one choice of a flag, such as an algorithm's), and what its values may be (align/declared.py), checked
    for every command before anything is written (align.validation.check_config_values):

    - ``within``: a number's range, "[0, 1)", "(0, inf)" (every number is finite, declared or not);
    - ``choices``: the values a string takes (a tuple, or a function returning them: a registry's names); ``pattern``:
      (a regular expression the whole value matches, how a message says it), for forms such as cuda:<n>;
    - ``path``: what a path names: "file", "folder", "any" (either) or "output" (a folder the command writes); with
      ``or_name`` a value that does not look like a local path is a name (a hub id, a prompt set); ``formats``: the
      file types it reads (".json", ".parquet", ...); ``reads``: a function that reads a local file's content and raises
      a ValueError for a wrong shape (JSON that is not a list of prompts, a parquet file without the columns), named
      with the option;
    - ``applies``: "--<flag> <value>[,<value>]" (or "--<flag>": when set): the option applies only then, and is
      refused otherwise; a choice group's options apply to that choice.

    Mutable defaults go through ``default_factory`` as with ``dataclasses.field``."""
    if group not in GROUPS and not is_choice_group(group):
        raise ValueError(f"unknown option group {group!r}; one of {', '.join(GROUPS)} or '--<flag> <value>'")
    if not help.strip():
        raise ValueError("an option needs a help text")
    if path is not None and path not in PATH_KINDS:
        raise ValueError(f"unknown path kind {path!r}; one of {', '.join(PATH_KINDS)}")
    metadata = {"help": help, "group": group}
    if within is not None:
        metadata["within"] = Interval.parse(within)
    if choices is not None:
        metadata["choices"] = choices
    if pattern is not None:
        metadata["pattern"] = pattern
    if path is not None:
        metadata.update(path=path, or_name=or_name, formats=tuple(formats))
        if reads is not None:
            metadata["reads"] = reads
    if applies or is_choice_group(group):
        metadata["applies"] = applies or group
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def die(message: str, code: int = 2) -> NoReturn:

    # A key echoed in a message stays hidden; control characters and bidirectional overrides in an echoed value are
    # escaped, so the message is one line that cannot restyle or reorder the terminal.
    print(f"error: {escaped(scrub_text(message))}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def die_if_disk_full(err: OSError, rerun: str = "run the same command again") -> NoReturn:
    """A full disk (or quota) ends in one line and exit status 3; any other OSError goes on as it is. Files are written
    whole (align.run_folder.atomic_path), so what was being written is discarded and everything before it is intact."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        raise err
    die(f"no space left on the device while writing {err.filename or 'the output'} (what was being written is "
        f"discarded; the files written before are intact): free some space and {rerun}", code=3)


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

    def _get_help_string(self, action):
        if action.nargs == 0:  # -h, --no_<flag>: nothing to default
            return action.help
        return super()._get_help_string(action)

    def _get_default_metavar_for_optional(self, action):
        """INT, FLOAT, STR or BOOL rather than the option's name in capitals."""
        kind = getattr(action.type, "__name__", "")
        return {"int": "INT", "float": "FLOAT", "str": "STR", "string_to_bool": "BOOL"}.get(kind, "VALUE")

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def _trl_parser_class():
    from trl import TrlParser

    class SectionedParser(TrlParser):
        """TrlParser with one --help section per option group; the group key never reaches argparse."""

        def _add_dataclass_arguments(self, dtype):
            sections = {name: self.add_argument_group(name) for name in GROUPS}
            hints = typing.get_type_hints(dtype)
            for fld in dataclasses.fields(dtype):
                if not fld.init:
                    continue
                group = fld.metadata.get("group")
                if group and is_choice_group(group) and group not in sections:
                    sections[group] = self.add_argument_group(section_title(group))
                plain = copy.copy(fld)  # HfArgumentParser passes every metadata key on to add_argument
                meta = {k: v for k, v in fld.metadata.items() if k == "help"}
                if "help" in meta:  # argparse %-formats help texts ("18%" would break --help)
                    meta["help"] = meta["help"].replace("%", "%%")
                plain.type = hints[fld.name]
                plain.metadata = MappingProxyType(meta)
                self._parse_dataclass_field(sections.get(group, self), plain)
                for action in self._actions:  # HfArgumentParser's --no_<flag> for a field that defaults to true
                    if action.dest == fld.name and action.option_strings[0] == f"--no_{fld.name}":
                        action.help = f"the same as --{fld.name} false"

        def error(self, message):
            """A bad flag or value: one line, exit 2 (argparse would print the whole usage first)."""
            die(f"{message} (see {self.prog} --help)")

    return SectionedParser


def build_parser(config_class: type, description: str | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser behind parse_config: every field a flag, grouped, each with its help and default."""
    parser = _trl_parser_class()(
        dataclass_types=[config_class], description=first_paragraph(description), prog=prog,
        formatter_class=OptionHelpFormatter, usage="%(prog)s [-h] [--config FILE.yaml] [--option VALUE ...]",
        epilog="--config FILE.yaml sets any of these options from a YAML mapping of option names to values; "
               "flags given on the command line override it.",
    )
    return parser


def apply_thread_count(env, path: Path) -> None:
    """A config's ``env: {OMP_NUM_THREADS: n}`` also sets torch's CPU threads: torch reads the variable only
    when it starts, before the YAML is read (one thread is fastest for the testbed on a busy CPU)."""
    if not isinstance(env, dict) or "OMP_NUM_THREADS" not in env:
        return
    threads = str(env["OMP_NUM_THREADS"])
    if not threads.isdigit() or int(threads) < 1:
        die(f"env: OMP_NUM_THREADS in {path} must be a whole number >= 1, got {threads!r}")
    import torch  # noqa: PLC0415 - --help and the config parse stay torch-free until a config sets threads

    torch.set_num_threads(int(threads))


def parse_config(config_class: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """Parse ``--config file.yaml`` plus ``--flag value`` overrides into ``config_class``.

    ``description``: the command's module docstring (its first paragraph heads --help).
    --help prints and exits 0; a bad flag, value or YAML file prints one line and exits 2."""
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
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            die(f"config file {path} is not valid YAML{where}: {getattr(err, 'problem', None) or ' '.join(str(err).split())}")
        if not isinstance(data, dict):
            die(f"config file {path} must hold a mapping of {config_class.__name__} fields")
        unknown = sorted(set(data) - fields - {"env"})
        if unknown:
            die(
                f"unknown key(s) {', '.join(unknown)} in {path}; valid keys: {', '.join(sorted(fields))}"
            )
        apply_thread_count(data.get("env"), path)
    parser = build_parser(config_class, description)
    messages = io.StringIO()  # argparse's own messages, scrubbed: a key typed as a flag is not echoed
    try:
        with contextlib.redirect_stderr(messages):
            (config,) = parser.parse_args_and_config(argv)
    except SystemExit as exit_:
        # --help exits 0; argparse already printed its one-line message for a bad flag or value (exit 2).
        raise SystemExit(0 if exit_.code in (0, None) else 2) from None
    except (ValueError, TypeError) as err:
        leftover = re.search(r"not used by the HfArgumentParser: (\[.*\])", str(err))
        if leftover:  # HfArgumentParser's words for an unknown flag
            die(f"unknown option(s) {' '.join(ast.literal_eval(leftover.group(1)))} (see {parser.prog} --help)")
        die(str(err))
    finally:
        sys.stderr.write(scrub_text(messages.getvalue()))
    check_parsed_values(config)
    return config


def read_config_text(path: Path) -> str:

    try:
        return read_text_file("--config", path, "YAML file")
    except ConfigError as err:
        die(str(err))


def check_parsed_values(config) -> None:
    """Parse-time checks every command shares (align.validation): types and finite floats (NaN passes
    ``x <= 0``), before any config or run folder is written; and secrets masked in every log record."""
    install_log_scrubber()
    try:
        check_config_values(config)
    except ConfigError as err:
        die(str(err))


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)

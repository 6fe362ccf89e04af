"""Reading an authors' repository for the reference scripts (experiments/*_reference.py): a file at a commit of a
fetched mirror (a bare git directory), one function or one block of lines of it, executed as written.

Nothing of the authors' code is copied into this repository: each reference script reads it at run time from the
mirror, checks its sha256, runs the parts it names and writes only the numbers into tests/data/.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import torch


def git_file(mirror: Path, commit: str, path: str, sha256: str | None = None) -> str:
    """The text of ``path`` at ``commit`` in the bare git directory ``mirror``; stops if its sha256 differs."""
    if not mirror.exists():
        raise SystemExit(f"{mirror} is missing: fetch the authors' repository first (see the script's docstring)")
    data = subprocess.run(["git", "--git-dir", str(mirror), "show", f"{commit}:{path}"], check=True,
                          capture_output=True).stdout
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise SystemExit(f"{path} @ {commit[:7]} in {mirror} is not the file these values were pinned from "
                         f"(sha256 {hashlib.sha256(data).hexdigest()} != {sha256})")
    return data.decode()


def function_source(source: str, name: str, cls: str | None = None) -> str:
    """The exact source of a top-level function (or of a method of the top-level class ``cls``), dedented."""
    body = ast.parse(source).body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    segment = ast.get_source_segment(source, node, padded=True)
    decorators = "".join(f"@{ast.get_source_segment(source, d)}\n" for d in node.decorator_list
                         if ast.get_source_segment(source, d) != "classmethod")
    return textwrap.dedent(decorators + segment) if decorators else textwrap.dedent(segment)


def lines_between(source: str, first: str, last: str, after: str | None = None) -> str:
    """The lines from the first one starting with ``first`` (after the first line starting with ``after``) to the
    next one starting with ``last``, both included (stripped lines compared), dedented."""
    lines = source.splitlines()
    begin = 0 if after is None else next(i for i, line in enumerate(lines) if line.strip().startswith(after))
    start = next(i for i in range(begin, len(lines)) if lines[i].strip().startswith(first))
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith(last))
    return textwrap.dedent("\n".join(lines[start : end + 1])) + "\n"


def execute(source: str, name: str, namespace: dict | None = None) -> dict:
    """Run ``source`` as a fresh module (its namespace seeded with ``namespace``; registered in sys.modules, which
    dataclasses need) and return that module's namespace."""
    module = types.ModuleType(f"authors_{name}")
    module.__dict__.update(namespace or {})
    sys.modules[module.__name__] = module
    exec(compile(source, name, "exec"), module.__dict__)
    return module.__dict__


def floats(t) -> list:
    """Exact decimals of a tensor's values (float32 widened to float64 loses nothing)."""
    return torch.as_tensor(t).detach().double().tolist()

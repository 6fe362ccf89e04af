"""Module boundaries: no import cycle inside `rewards/` or `align/` nor between align's rooms (its folders, and each
top-level module), `rewards` never imports `align`, and the fences: the package never imports scripts/, experiments/,
tests/ or its own testing fixtures; scripts never import experiments; nothing in the package edits sys.path.

The graph is read from the source with `ast` (every import, top level or inside a function), so a cycle
hidden in a function-local import counts too; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules that `path` imports (`from pkg import mod` counts as pkg.mod when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name in known:
                found.add(name)
            elif name.rsplit(".", 1)[0] in known and name.count("."):
                found.add(name.rsplit(".", 1)[0])  # `from pkg.mod import function`
    return found


def import_graph(package: str) -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    known = set(files)
    # a module's package __init__ runs first anyway; an edge to it is not a cycle of the module's making
    return {name: imported_modules(path, known) - {name} - {name.rsplit(".", 1)[0]} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_rewards():
    assert cycles(import_graph("rewards")) == []


def test_no_import_cycle_inside_align():
    assert cycles(import_graph("align")) == []


def test_rewards_never_imports_align():
    offenders = []
    for path in (ROOT / "rewards").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "align" or n.startswith("align.")]
    assert offenders == []


def imports_of(path: Path) -> list[str]:
    """Every absolute module name a file imports (top level or inside a function)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def offenders(folders: list[str], forbidden: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            if relative.startswith(skip):
                continue
            found += [f"{relative}: {name}" for name in imports_of(path)
                      if any(name == f or name.startswith(f + ".") for f in forbidden)]
    return found


TEST_HELPERS = ("tests", "script_loader", "wandb_records", "conftest")


def test_no_import_cycle_between_the_rooms_of_align():
    """A room is a folder of align/ (train, eval, data, ...) or one top-level module (pipeline, cli, ...)."""
    rooms: dict[str, set[str]] = {}
    for module, imported in import_graph("align").items():
        room = ".".join(module.split(".")[:2])
        rooms.setdefault(room, set()).update(".".join(m.split(".")[:2]) for m in imported)
    assert cycles({room: targets - {room} for room, targets in rooms.items()}) == []


def test_the_package_never_imports_scripts_experiments_tests_or_its_fixtures():
    forbidden = ("scripts", "experiments", *TEST_HELPERS, "align.testing", "align.testing")
    assert offenders(["align", "rewards"], forbidden, skip=("align/testing", "align/testing")) == []
    assert offenders(["align/testing", "align/testing"], ("scripts", "experiments", *TEST_HELPERS)) == []


def test_scripts_never_import_experiments():
    assert offenders(["scripts"], ("experiments",)) == []


def test_no_file_in_the_package_edits_sys_path():
    edits = [str(p.relative_to(ROOT)) for folder in ("align", "rewards") for p in (ROOT / folder).rglob("*.py")
             if "sys.path" in p.read_text()]
    assert edits == []


def test_the_fence_finder_sees_a_forbidden_import(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from experiments.flow_ceiling import held_out_set\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert offenders(["pkg"], ("experiments",)) == ["pkg/a.py: experiments.flow_ceiling"]


def test_every_folder_of_the_packages_is_a_regular_package():
    """An installed wheel holds only packages with an __init__.py (setuptools' find_packages)."""
    folders = {p.parent for package in ("align", "rewards") for p in (ROOT / package).rglob("*.py")}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()) == []

"""Import a file of scripts/ (product tools) or experiments/ (research scripts) as a module, for tests of their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
EXPERIMENTS = ROOT / "experiments"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def load_script(name: str):
    """scripts/<name>.py as the module ``name``."""
    return _load(SCRIPTS / f"{name}.py", name)


def load_experiment(name: str):
    """experiments/<name>.py as the module ``name``."""
    return _load(EXPERIMENTS / f"{name}.py", name)

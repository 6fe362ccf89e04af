"""The commands as users type them: the file paths (`accelerate launch align/dpo.py`), the modules
(`python -m align.evaluate`, `accelerate launch -m align.dpo`) and the installed scripts (`align-dpo`, from
pyproject's [project.scripts]) all reach the same main()."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# The launchers at align/'s top keep the commands' paths; each calls the main() of the module in its room.
LAUNCHERS = {"align.dpo": "align.train.dpo", "align.ddpo": "align.train.ddpo", "align.train_reward": "align.train.reward_model",
             "align.precompute": "align.data.precompute", "align.evaluate": "align.eval.evaluate",
             "align.best_of_n": "align.eval.best_of_n"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_installed_script_names_a_main_that_exists(name):
    module, _, function = SCRIPTS[name].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_every_launcher_has_an_installed_script():
    targets = {target.partition(":")[0] for target in SCRIPTS.values()}
    assert set(LAUNCHERS.values()) | {"align.judgebench.benchmark"} <= targets


@pytest.mark.parametrize("launcher, room", sorted(LAUNCHERS.items()))
def test_a_launcher_runs_its_rooms_main(launcher, room):
    """The launcher file holds no code of its own: it imports the room's module and calls its main()."""
    text = (ROOT / Path(*launcher.split("."))).with_suffix(".py").read_text()
    package, _, leaf = room.rpartition(".")
    assert f"from {package} import {leaf}" in text and f"{leaf}.main()" in text
    assert len(text.splitlines()) <= 10


@pytest.mark.parametrize("argv", [["-m", "align.dpo"], ["-m", "align.judgebench"], ["align/ddpo.py"]])
def test_the_commands_answer_help_as_module_and_as_file(argv):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout

"""Every config field explains itself: a help text and a --help group; --help exits 0 and shows each flag with
its default; every flag parses from the command line; parse errors are one line and exit 2."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_loader import load_script

from align import cli
from align.cli import GROUPS, first_paragraph, is_choice_group, option, parse_config, section_title
from align.eval.best_of_n import BestOfNConfig
from align.eval.evaluate import EvalConfig
from align.judgebench.benchmark import JudgeBenchConfig
from align.train.ddpo_config import DDPOConfig
from align.train.dpo_config import DPOConfig
from align.train.reward_model import RewardTrainConfig
from rewards.score import main

ROOT = Path(__file__).resolve().parent.parent
CompareConfig = load_script("compare_judges").CompareConfig
CONFIG_CLASSES = (DPOConfig, DDPOConfig, EvalConfig, BestOfNConfig, JudgeBenchConfig, RewardTrainConfig, CompareConfig)

# Valid values other than the default for fields that take one of a few words.
CHOICES = {
    "finetune": ("full", "lora", "head"), "mixed_precision": ("no", "fp16", "bf16"),
    "report_to": ("tensorboard", "wandb", "all", "none"), "tie_policy": ("drop", "keep_first"),
    "latent_store": ("run", "none"), "advantage": ("per-prompt", "group", "group-mean", "batch"),
    "timestep_selection": ("random", "high_noise"), "lr_scheduler": ("constant", "cosine"),
    "backbone": ("clip", "blip", "mllm"), "search": ("random", "zero-order"), "ci": ("wilson", "bootstrap"),
    "device": ("auto", "cpu"), "fid_feature": ("inception", "pixels"), "cmmd_feature": ("clip", "shapes-clip"),
    "resume": ("latest",), "protocol": ("project", "mjbench"), "subsets": ("alignment,safety,quality,bias", "alignment"), "trainer": ("dpo", "ddpo"),
}


def other_value(field: dataclasses.Field):
    """A valid value of the field's type that is not its default."""
    default = field.default
    if field.name in CHOICES:
        return next(c for c in CHOICES[field.name] if c != default)
    kind = str(field.type)
    if kind.startswith("list"):
        return ["value-other"]
    if "bool" in kind:
        return not default
    if "int" in kind:
        return 3 if default is None else default + 2
    if "float" in kind:
        return 0.25 if default is None else default * 2 + 0.5
    return f"{default or 'value'}-other"


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_help_text_and_a_group(config_class):
    for field in dataclasses.fields(config_class):
        assert field.metadata.get("help", "").strip(), f"{config_class.__name__}.{field.name} has no help text"
        group = field.metadata.get("group")
        assert group in GROUPS or is_choice_group(group), f"{config_class.__name__}.{field.name}: group {group!r}"


def test_option_refuses_an_unknown_group_or_an_empty_help():
    with pytest.raises(ValueError, match="unknown option group 'misc'"):
        option(1, "a number", "misc")
    with pytest.raises(ValueError, match="needs a help text"):
        option(1, " ", "model")
    assert option(default_factory=list, help="a list", group="data").default_factory is list


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_field_parses_from_its_flag(config_class, monkeypatch):
    # Parsing only: every field set at once to another value breaks what the declarations allow together (options of
    # another algorithm, files that are not there); the values' checks have tests of their own (tests/test_fuzz.py).
    monkeypatch.setattr(cli, "check_parsed_values", lambda config: None)
    fields = dataclasses.fields(config_class)
    wanted = {f.name: other_value(f) for f in fields}
    argv = [token for name, value in wanted.items()
            for token in (f"--{name}", *(map(str, value) if isinstance(value, list) else [str(value)]))]
    config = parse_config(config_class, argv)
    for name, value in wanted.items():
        assert getattr(config, name) == value, name
        assert value != next(f.default for f in fields if f.name == name), name  # really not the default


def test_a_flag_overrides_the_yaml_and_the_yaml_overrides_the_default(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.002\nnum_epochs: 7\nprompts: testbed:8\n")
    config = parse_config(DDPOConfig, ["--config", str(path), "--num_epochs", "9", "--deterministic_tail"])
    assert (config.learning_rate, config.num_epochs, config.prompts, config.deterministic_tail) == (0.002, 9, "testbed:8", True)
    assert config.eta == DDPOConfig.eta


def test_a_yaml_env_thread_count_reaches_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # restored after the test
    before = torch.get_num_threads()
    path = tmp_path / "c.yaml"
    path.write_text("env:\n  OMP_NUM_THREADS: 1\nprompts: testbed:8\n")
    try:
        parse_config(DDPOConfig, ["--config", str(path)])
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def help_entries(text: str) -> dict[str, str]:
    """--help's option entries: the flag at the start of an entry -> the entry on one line."""
    entries, current = {}, None
    for line in text.splitlines():
        match = re.match(r"^  (-h, --help|--[a-z0-9_]+)\b", line)
        if match:
            current = match.group(1)
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line
        else:
            current = None
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


def check_help(text: str, config_class, module_doc: str | None) -> None:
    entries = help_entries(text)
    if module_doc:
        assert " ".join(first_paragraph(module_doc).split()[:6]) in " ".join(text.split())
    for group in {f.metadata["group"] for f in dataclasses.fields(config_class)}:
        assert f"\n{section_title(group)}:\n" in text
    for field in dataclasses.fields(config_class):
        entry = entries.get(f"--{field.name}")
        assert entry is not None, f"--{field.name} missing from --help"
        default = field.default
        assert f"(default: {default})" in entry, (field.name, entry)
        assert " ".join(field.metadata["help"].split()[:3]) in entry


@pytest.mark.parametrize("script, config_class, documented_in", [
    ("align/dpo.py", DPOConfig, "align/train/dpo.py"), ("align/ddpo.py", DDPOConfig, "align/train/ddpo.py"),
    ("scripts/compare_judges.py", CompareConfig, "scripts/compare_judges.py")])
def test_trainer_help_runs_as_a_script_and_explains_every_flag(script, config_class, documented_in):
    """The command's path as users type it; its --help opens with the docstring of the module that holds the code."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}
    result = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    check_help(result.stdout, config_class, (ROOT / documented_in).read_text().split('"""')[1])


@pytest.mark.parametrize("module_name, config_class", [
    ("align.eval.evaluate", EvalConfig), ("align.eval.best_of_n", BestOfNConfig), ("align.judgebench.benchmark", JudgeBenchConfig),
    ("align.train.reward_model", RewardTrainConfig), ("align.train.dpo", DPOConfig), ("align.train.ddpo", DDPOConfig),
])
def test_each_entry_point_help_exits_0(module_name, config_class, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    module = importlib.import_module(module_name)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    check_help(capsys.readouterr().out, config_class, module.__doc__)


def test_score_help_exits_0_with_its_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--judge", "--prompt", "--model", "--device", "--dtype", "--batch-size"):
        assert flag in out
    assert "(default: cuda when available)" in out and "(default: the judge's own)" in out
    with pytest.raises(SystemExit) as exit_:
        main(["--prompt", "x", "a.png"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "--judge" in err


@pytest.mark.parametrize("argv, message", [
    (["--no_such_flag", "1"], "--no_such_flag"),
    (["--num_epochs", "many"], "invalid int value: 'many'"),
    (["--deterministic_tail", "maybe"], "argument --deterministic_tail"),
    (["--config", "missing.yaml"], "config file not found: missing.yaml"),
])
def test_parse_errors_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(DDPOConfig, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("error:")


@pytest.mark.parametrize("text, message", [
    ("num_epochs: [1\n", "is not valid YAML"),
    ("branch_sampling: true\n", "unknown key(s) branch_sampling"),
    ("- 1\n", "must hold a mapping"),
    ("env:\n  OMP_NUM_THREADS: two\n", "OMP_NUM_THREADS"),
])
def test_bad_yaml_is_one_line_and_exit_2(text, message, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        parse_config(DDPOConfig, ["--config", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1

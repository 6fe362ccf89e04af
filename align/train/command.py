"""The command around a trainer's ``train(config)``: flags parsed, one line and exit status 2 for a bad input,
3 for a run stopped on a bad value; the first checks every diffusion trainer makes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from align.cli import ConfigError, die, die_if_disk_full, parse_config
from align.data.pairs import DataError
from align.pipeline import ModelLoadError, check_model, check_sampling_steps
from align.quiet import quiet_output
from align.run_folder import (
    JUDGE_ANSWERS,
    RunFolderError,
    RunStopped,
)
from align.train.accelerator import adamw_class
from align.train.dry_run import print_memory_plan
from align.train.quantization import check_backends
from align.validation import check_weight_files

# A bad input: config, run folder, model files or data; each error's message names the input.


BAD_INPUT_ERRORS = (ConfigError, RunFolderError, ModelLoadError, DataError)


class TrainingStopped(RunStopped):
    """Training stopped on a bad value (a NaN loss or reward); the last good checkpoint is kept."""


def way_on(last_good) -> str:
    """What a stopped run's line ends with: how to go on from its last good checkpoint, or, before its first one, that
    the start left nothing (align.run_folder.restores_old_run_on_failure removes what it wrote) and the command runs
    again as it is typed."""
    if last_good:
        return (f"the last good checkpoint is {last_good}: --resume latest continues from it with the run's own settings; "
                "to train with other settings, start a new run (another --output_dir, or --overwrite true)")
    return ("no checkpoint was written, so this start's files are removed (the judges' answers are kept): mend the cause "
            "and run the command again")


def run_trainer(config_class: type, train: Callable, argv: list[str] | None, description: str | None,
                stopped: tuple[type[BaseException], ...] = (TrainingStopped,), check: Callable | None = None) -> None:
    """A trainer's ``main()``: parse the flags, run ``train(config)``, and turn a known failure into one line:
    exit 2 for a bad input, 3 for a run that stopped (``stopped``: NaN loss, failed reward, ...). ``--dry_run``
    runs the trainer's own ``check`` of the config (what ``train`` checks before loading anything; default: the
    config's rules), then prints the memory plan."""
    config = parse_config(config_class, argv, description=description)
    if hasattr(config, "quiet"):
        quiet_output(config.quiet)
    try:
        if getattr(config, "dry_run", False):
            (check or config_class.validate)(config)
            print_memory_plan(config)
        else:
            train(config)
    except BAD_INPUT_ERRORS as err:
        die(str(err))
    except stopped as err:
        die(str(err), code=3)
    except OSError as err:
        die_if_disk_full(err, "rerun with --resume latest")


def check_config_and_model(config) -> None:
    """The first checks of a diffusion trainer: the config's own rules, the 8-bit optimiser and the quantization
    backends when asked for, and the model's weight files (a truncated one is named here, before anything loads)."""
    config.validate()
    adamw_class(config.use_8bit_adam)  # bitsandbytes present when asked for
    if not getattr(config, "dry_run", False):  # a dry run plans any scheme on any machine
        check_backends(config.quantize_base, config.quantize_text_encoders)  # torchao / bitsandbytes and its GPU
    try:
        check_weight_files("--model", check_model(config.model))
        check_sampling_steps(config.model, getattr(config, "num_inference_steps", None))
    except ModelLoadError as err:
        raise ConfigError(str(err)) from None


def lr_schedules() -> tuple[str, ...]:
    """The schedules diffusers' get_scheduler knows (--lr_scheduler's choices)."""
    from diffusers.optimization import SchedulerType

    return tuple(t.value for t in SchedulerType)


def keep_judge_answers(judges, run_path: Path, process: int) -> None:
    """API and VLM judges keep their answers in the run folder: a resumed run re-samples the epochs (or relabels the
    round) after its checkpoint with the same seeds, and gets the same images' verdicts from there instead of paying
    for them again (and so the same rewards: the resume stays exact with a judge that answers differently each time).
    One file per process: each re-generates only its own images, and no two processes write one SQLite file."""
    for judge in judges:
        keep = getattr(judge, "keep_answers_in", None)
        if callable(keep):
            keep(run_path / JUDGE_ANSWERS / f"process_{process}.sqlite")

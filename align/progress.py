"""Progress bars on long work (labelling, sampling, training, evaluation).

    for step in progress_bar(range(steps), desc="dpo", enabled=accelerator.is_local_main_process):

A bar is drawn only on the process that asks with enabled=True (the main one), only when stderr is a
terminal (tqdm's disable=None: nothing lands in log files or CI output), and never after ``--quiet true``
(set_quiet, called by each entry point at its start).
"""

from __future__ import annotations

from tqdm.auto import tqdm

_quiet = False


def set_quiet(quiet: bool) -> None:
    """Turn every progress bar of this process off (``--quiet true``) or back on."""
    global _quiet
    _quiet = bool(quiet)


def is_quiet() -> bool:
    return _quiet


def progress_bar(iterable=None, desc: str | None = None, total: int | None = None, unit: str = "it",
                 enabled: bool = True, leave: bool = True, file=None):
    """A tqdm bar over ``iterable`` (or a manual one with ``total``); a silent pass-through when switched off."""
    # None: tqdm draws only when the output is a terminal.
    disable = True if (_quiet or not enabled) else None
    return tqdm(iterable, desc=desc, total=total, unit=unit, leave=leave, disable=disable, file=file)

"""--resume continues the run its checkpoint records, and nothing else.

A checkpoint's sealed state.json (align.run_folder.seal) holds what the run trained with: its settings, the number of
processes, their layout (sharded by FSDP2 or not) and so the micro-batches per optimiser step. A resumed launch is
checked against that record before anything is written; config.yaml is a copy for people to read, and editing it
changes nothing. A launch that would continue another run (other settings, another step, a layout that cannot read
the checkpoint) is refused in one line that names the command continuing this one.

Before its first checkpoint a run has trained nothing; its config.yaml (sealed by a digest line) records what its
first outputs (AI-feedback pairs, the run's latent store) were made with, and a resume keeps to it.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from align.run_folder import (
    CHECKPOINT_STATE,
    CONFIG_FILE,
    RunFolder,
    RunFolderError,
    read_config_copy,
    read_sealed,
    scrub_secrets,
)
from align.train.accelerator import launched_processes
from align.train.sharding import fsdp_launch

# What a resumed run may be given anew, and applies: where it ends (a longer run continues to the new end; the
# resume-exactness tests do this), and settings that do not shape what is trained (where the run folder now is,
# output, workers, checkpoint cadence, the cost cap, evaluation cadence). Every other setting is the run's own: a
# new value is refused, never kept silently while config.yaml claims it.
APPLIED_ON_RESUME = frozenset({
    "max_steps", "num_epochs", "output_dir", "resume", "overwrite", "quiet", "report_to", "dataloader_num_workers",
    "checkpointing_steps", "checkpointing_epochs", "checkpoints_total_limit", "max_api_cost", "eval_batch_size",
    "eval_every_steps", "eval_every_epochs", "dry_run",
})
ACCUMULATION = "gradient_accumulation_steps"
SHARDED_FILES = "pytorch_model_fsdp"  # accelerate's torch.distributed.checkpoint folders of a sharded model


def run_settings(config) -> dict:
    """A config as a run records it (checkpoints, config.yaml): secrets masked, values as YAML reads them back."""
    return yaml.safe_load(yaml.safe_dump(scrub_secrets(asdict(config)), sort_keys=False))


@dataclass
class RunRecord:
    """What a run trained with, and where that was read."""

    settings: dict
    processes: int | None  # None: no checkpoint (nothing trained yet), or one from before processes were recorded
    sharded: bool
    source: str


def checkpoint_is_sharded(state: dict) -> bool:
    """A checkpoint written by FSDP2 processes (each its shard), readable only by an FSDP2 launch."""
    if "sharded" in state:
        return bool(state["sharded"])
    return any(str(name).startswith(SHARDED_FILES) for name in state.get("files", {}))


def recorded_run(run: RunFolder) -> RunRecord | None:
    """The record a resume keeps to: the checkpoint it resumes from (its sealed state.json), else the run's config.yaml
    (no checkpoint yet, or one written before checkpoints recorded their settings), else None (nothing to keep to)."""
    checkpoint = run.resume_checkpoint()  # refuses a damaged named checkpoint, or a run whose checkpoints all are
    if checkpoint is not None:
        state = read_sealed(checkpoint / CHECKPOINT_STATE)
        processes = state.get("processes")
        processes = int(processes) if isinstance(processes, int) and processes > 0 else None
        if isinstance(state.get("settings"), dict):
            return RunRecord(state["settings"], processes, checkpoint_is_sharded(state), f"its checkpoint {checkpoint.name}")
        settings = read_config_copy(run.path, needed_for="its checkpoint records no settings (written before they were)")
        return None if settings is None else RunRecord(settings, processes, checkpoint_is_sharded(state), CONFIG_FILE)
    settings = read_config_copy(run.path, needed_for="it has no checkpoint yet")
    return None if settings is None else RunRecord(settings, None, False, CONFIG_FILE)


def _same_setting(old, new) -> bool:
    if old == new or old == "***":  # a masked secret cannot be compared (and is never a training setting)
        return True
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
        return float(old) == float(new)
    if isinstance(old, str) and isinstance(new, str) and Path(old).expanduser().exists():
        return Path(old).expanduser().resolve() == Path(new).expanduser().resolve()  # one file, written two ways
    return False


def _as_flag(name: str, value) -> str:
    """How the run's own value is typed on the command line (None: the flag left out)."""
    if value is None:
        return f"without --{name}"
    if isinstance(value, bool):
        return f"--{name} {str(value).lower()}"
    return f"--{name} {shlex.quote(str(value))}"


def _layout(processes: int, sharded: bool) -> str:
    return f"{processes} process{'es' if processes != 1 else ''}{' under FSDP2' if sharded else ''}"


def _launch(processes: int, sharded: bool) -> str:
    if processes == 1 and not sharded:
        return "as one process"
    launcher = "--use_fsdp --fsdp_version 2" if sharded else "--multi_gpu"
    return f"on {_layout(processes, sharded)} (accelerate launch {launcher} --num_processes {processes} ...)"


def check_resume_settings(run: RunFolder, config, processes: int | None = None, sharded: bool | None = None) -> None:
    """--resume continues the run its checkpoint records: a setting given another value, another number of
    micro-batches per optimiser step, or a layout that cannot read the checkpoint (sharded by FSDP2 or not) is
    refused in one line naming the command that continues the run; what APPLIED_ON_RESUME lists may change, and is
    printed. On another number of processes (``processes``: this launch's) the accumulation may change with it so
    that processes x accumulation stays the run's. Nothing is read from config.yaml while a checkpoint records it."""
    if not run.resume:
        return
    record = recorded_run(run)
    if record is None:
        return
    saved = record.settings
    now = run_settings(config)
    if saved.get("mixed_precision") is not None and now.get("mixed_precision") is None:
        now["mixed_precision"] = saved["mixed_precision"]  # unset: the run's own (accelerate's setting, resolved)
    processes = launched_processes() if processes is None else processes
    sharded = (fsdp_launch() and processes > 1) if sharded is None else sharded
    changed = [name for name, value in now.items() if name in saved and not _same_setting(saved[name], value)]
    refused = [name for name in changed if name not in APPLIED_ON_RESUME and name != ACCUMULATION]
    fixes = [_as_flag(name, saved[name]) for name in refused]
    problems = [", ".join(f"--{name} {saved[name]!r} (now {now[name]!r})" for name in refused)] if refused else []
    launch = ""
    if ACCUMULATION in saved and ACCUMULATION in now:
        launch = _check_step(record, int(saved[ACCUMULATION]), int(now[ACCUMULATION]), processes, sharded, problems,
                             fixes)
    if problems:
        what = f"--resume: the run in {run.path} was trained with other settings (read from {record.source}): "
        fix = " ".join(fixes) + (f", {launch}" if launch else "")
        raise RunFolderError(f"{what}{'; '.join(problems)}; to continue it, run the same command with {fix} (or start a "
                             "new run: another --output_dir, or --overwrite true)")
    applied = [name for name in changed if name not in ("resume", "overwrite", "output_dir", "dry_run", ACCUMULATION)]
    if applied:
        print("[run] --resume applies " + ", ".join(f"--{name} {now[name]!r} (was {saved[name]!r})" for name in applied)
              + f"; the run's next checkpoint and {CONFIG_FILE} record it", flush=True)


def _check_step(record: RunRecord, old_acc: int, new_acc: int, processes: int, sharded: bool, problems: list,
                fixes: list) -> str:
    """The accumulation and the launch against the record: the same micro-batches per optimiser step (processes x
    accumulation; the trainers key every draw by the global micro-batch, so N x A equals N' x A') on a layout that
    can read the checkpoint. Adds what is wrong to ``problems`` and its mend to ``fixes``; returns the launch to use
    ("" when this one does)."""
    if record.processes is None:  # nothing trained yet, or a checkpoint from before processes were recorded
        if old_acc != new_acc:
            problems.append(f"--{ACCUMULATION} {old_acc} (now {new_acc})")
            fixes.append(f"--{ACCUMULATION} {old_acc}")
        return ""
    per_step = record.processes * old_acc
    layout_reads = record.sharded == sharded  # a sharded checkpoint needs FSDP2 processes; an unsharded one, none
    if layout_reads and processes * new_acc == per_step:
        if (record.processes, old_acc) != (processes, new_acc):
            print(f"[run] --resume on {processes} processes x accumulation {new_acc} (the run: {record.processes} x "
                  f"{old_acc}): the same {per_step} micro-batches per optimiser step", flush=True)
        return ""
    if layout_reads and record.processes == processes:
        problems.append(f"--{ACCUMULATION} {old_acc} (now {new_acc})")
        fixes.append(f"--{ACCUMULATION} {old_acc}")
        return ""
    problems.append(f"it was launched on {_layout(record.processes, record.sharded)} x accumulation {old_acc} "
                    f"({per_step} micro-batches per optimiser step), this launch is {_layout(processes, sharded)} x "
                    f"{new_acc}" + ("" if layout_reads else f" ({_why_unreadable(record.sharded)})"))
    if layout_reads and per_step % processes == 0:
        fixes.append(f"--{ACCUMULATION} {per_step // processes}")
        return f"or as launched: {_launch(record.processes, record.sharded)} with --{ACCUMULATION} {old_acc}"
    fixes.append(f"--{ACCUMULATION} {old_acc}")
    return _launch(record.processes, record.sharded)


def _why_unreadable(sharded_checkpoint: bool) -> str:
    if sharded_checkpoint:
        return "its checkpoint holds each FSDP2 process's shard, which only an FSDP2 launch of 2 or more processes reads"
    return "its checkpoint holds whole tensors, which an FSDP2 launch does not read"

"""A training run's checkpoints and final weights: trainable-only checkpoint hooks, sealed checkpoint folders,
resume, the run folder's start, the weights-finite guard, and the final diffusers-format folder with its model card."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import yaml
from safetensors.torch import load_file, save_file

from align import pipeline  # save_lora / save_full_unet looked up at call time: tests replace them
from align.health import weights_finite
from align.run_folder import (
    CHECKPOINT_STATE,
    CONFIG_FILE,
    RunFolder,
    RunFolderError,
    atomic_folder,
    atomic_write_text,
    folder_manifest,
    publish_folder,
    read_sealed,
    scrub_secrets,
    seal,
)
from align.train.accelerator import launched_processes
from align.train.command import TrainingStopped
from align.train.sharding import all_processes_agree, is_sharded, local_tensor


def register_trainable_checkpoint_hooks(accelerator, only_trainable: bool) -> None:
    """With LoRA (or a frozen backbone), checkpoints hold only the trainable tensors, not the frozen model. Under
    FSDP2 accelerate writes every process's shard of the whole model instead (torch.distributed.checkpoint)."""
    if not only_trainable or is_sharded(accelerator):
        return

    def save_hook(models, weights, output_dir):
        for model in models if accelerator.is_main_process else ():  # every process holds the same tensors
            state = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
            save_file(state, str(Path(output_dir) / "trainable_weights.safetensors"))
        weights.clear()  # accelerate must not also write the full model

    def load_hook(models, input_dir):
        state = load_file(str(Path(input_dir) / "trainable_weights.safetensors"))
        while models:
            model = models.pop()
            missing = {n for n, p in model.named_parameters() if p.requires_grad} - set(state)
            if missing:
                raise RunFolderError(f"checkpoint {input_dir} lacks {len(missing)} trainable tensors, e.g. {sorted(missing)[0]}")
            model.load_state_dict(state, strict=False)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def save_checkpoint(accelerator, run: RunFolder, step: int, keep: int, extra_files: dict[str, str] | None = None) -> Path:
    """Model, optimizer, LR scheduler and RNG states (plus a trainer's own ``extra_files``, name -> text).

    Written into a staging folder, sealed by state.json (the step and every file's size and hash, checked
    on resume), then renamed into place: a checkpoint folder is complete or absent, never half written.
    The first checkpoint of an --overwrite run lets go of the old run it had set aside.
    """
    folder, staged = run.checkpoint_dir(step), run.staging_dir(step)
    if accelerator.is_main_process and staged.exists():
        shutil.rmtree(staged)  # left by a run killed while writing this checkpoint
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staged))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, text in (extra_files or {}).items():
            atomic_write_text(staged / name, text)
        try:
            atomic_write_text(staged / CHECKPOINT_STATE, json.dumps(seal({
                "step": step, "processes": accelerator.num_processes, "files": folder_manifest(staged)})))
            publish_folder(staged, folder)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)  # e.g. a full disk: the checkpoints before stay as they were
            raise
        run.damaged.pop(folder, None)
        run.let_go_of_old_run()
        run.prune_checkpoints(keep)
    accelerator.wait_for_everyone()
    return folder


def resume_from_checkpoint(accelerator, run: RunFolder, label: str) -> int | None:
    """Restore the latest checkpoint (model, optimiser, schedule and RNG states) and cut the metrics log back to
    its step; returns that step, or None when there is no checkpoint to resume from."""
    checkpoint = run.resume_checkpoint()
    if checkpoint is None:
        return None
    accelerator.load_state(str(checkpoint))
    state = json.loads((checkpoint / CHECKPOINT_STATE).read_text())
    step = state["step"]
    rescale_schedules(accelerator, state.get("processes", accelerator.num_processes))
    if accelerator.is_main_process:
        run.truncate_metrics(step)
        print(f"[{label}] resumed from {checkpoint} at step {step}", flush=True)
    return step


def rescale_schedules(accelerator, processes_before: int) -> None:
    """accelerate steps a prepared learning-rate schedule once per process at each optimiser step (and the trainers
    size it so): a run resumed on another number of processes continues the schedule at the same optimiser step."""
    if processes_before == accelerator.num_processes:
        return
    for prepared in accelerator._schedulers:
        inner = prepared.scheduler
        inner.last_epoch = inner.last_epoch * accelerator.num_processes // processes_before
        inner._step_count = inner.last_epoch + 1


def recorded_processes(run: RunFolder) -> int | None:
    """The number of processes that wrote the run's newest checkpoint whose state.json is sealed (an edited record is
    not believed: resume skips that checkpoint too); None without one, or for checkpoints from before it was recorded."""
    for checkpoint in reversed(run.checkpoints()):
        try:
            state = read_sealed(checkpoint / CHECKPOINT_STATE)
        except ValueError:
            continue
        try:
            return int(state["processes"])
        except (KeyError, TypeError, ValueError):
            return None
    return None


def same_micro_batches_per_step(run: RunFolder, saved: dict, now: dict, processes: int) -> bool:
    """Whether this launch trains the run's own optimiser steps: processes x accumulation as the run was launched
    (the trainers key every draw by the global micro-batch, so N processes x A equal N' x A' when the products
    match). A launch on another number of processes that would change the step is refused in one line."""
    before = recorded_processes(run) or processes
    old_acc, new_acc = saved.get("gradient_accumulation_steps"), now.get("gradient_accumulation_steps")
    if old_acc is None or new_acc is None:
        return False
    per_step = before * int(old_acc)
    if processes * int(new_acc) == per_step:
        if (before, old_acc) != (processes, new_acc):
            print(f"[run] --resume on {processes} processes x accumulation {new_acc} (the run: {before} x {old_acc}): "
                  f"the same {per_step} micro-batches per optimiser step", flush=True)
        return True
    if before != processes:
        fix = (f"--gradient_accumulation_steps {per_step // processes}" if per_step % processes == 0
               else f"a number of processes that divides {per_step}")
        raise RunFolderError(
            f"--resume: the run in {run.path} was launched on {before} processes x accumulation {old_acc} "
            f"({per_step} micro-batches per optimiser step), this launch is {processes} x {new_acc}: resume with {fix} "
            f"(or on {before} processes) to continue the same run")
    return False


# What a resumed run may be given anew, and applies: where it ends (a longer run continues to the new end; the
# resume-exactness tests do this), and settings that do not shape what is trained (where the run folder now is,
# output, workers, checkpoint cadence, the cost cap, evaluation cadence). Every other setting is the run's own: a
# new value is refused, never kept silently while config.yaml claims it.
APPLIED_ON_RESUME = frozenset({
    "max_steps", "num_epochs", "output_dir", "resume", "overwrite", "quiet", "report_to", "dataloader_num_workers",
    "checkpointing_steps", "checkpointing_epochs", "checkpoints_total_limit", "max_api_cost", "eval_batch_size",
    "eval_every_steps", "eval_every_epochs",
})


def _same_setting(old, new) -> bool:
    if old == new or old == "***":  # a masked secret cannot be compared (and is never a training setting)
        return True
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
        return float(old) == float(new)
    if isinstance(old, str) and isinstance(new, str) and Path(old).expanduser().exists():
        return Path(old).expanduser().resolve() == Path(new).expanduser().resolve()  # one file, written two ways
    return False


def check_resume_settings(run: RunFolder, config, processes: int | None = None) -> None:
    """--resume continues the run in config.yaml: a setting given another value is refused in one line naming every
    such flag (APPLIED_ON_RESUME lists what may change, and those changes are printed and recorded). On another
    number of processes (``processes``: this launch's), the accumulation may change with it so that the micro-batches
    per optimiser step stay the run's (same_micro_batches_per_step)."""
    saved_file = run.path / CONFIG_FILE
    if not run.resume or not saved_file.is_file():
        return
    try:
        saved = yaml.safe_load(saved_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        saved = None
    if not isinstance(saved, dict):
        raise RunFolderError(f"--resume: {saved_file} is not a readable config; the run's settings are unknown, so it "
                             "cannot be continued (start afresh with --overwrite)")
    now = yaml.safe_load(yaml.safe_dump(scrub_secrets(asdict(config)), sort_keys=False))
    if saved.get("mixed_precision") is not None and now.get("mixed_precision") is None:
        now["mixed_precision"] = saved["mixed_precision"]  # unset: the run's own (accelerate's setting, resolved)
    changed = [name for name, value in now.items() if name in saved and not _same_setting(saved[name], value)]
    steps_kept = same_micro_batches_per_step(run, saved, now, launched_processes() if processes is None else processes)
    refused = [name for name in changed
               if name not in APPLIED_ON_RESUME and not (name == "gradient_accumulation_steps" and steps_kept)]
    if refused:
        listed = ", ".join(f"--{name} {saved[name]!r} (now {now[name]!r})" for name in refused)
        raise RunFolderError(
            f"--resume: the run in {run.path} was started with other settings: {listed}; resume with the run's own "
            f"settings ({saved_file}) or start a new run (another --output_dir, or --overwrite)"
        )
    applied = [name for name in changed if name not in ("resume", "overwrite", "output_dir")]
    if applied:
        print("[run] --resume applies " + ", ".join(f"--{name} {now[name]!r} (was {saved[name]!r})" for name in applied)
              + f"; {CONFIG_FILE} records it", flush=True)


def start_run(accelerator, run: RunFolder, config) -> None:
    """The run folder made (or taken over) and its config.yaml written by the main process, then every process."""
    if accelerator.is_main_process:
        run.prepare()
        run.save_config(asdict(config))
    accelerator.wait_for_everyone()


def stop_unless_weights_finite(params, step_name: str, last_good, accelerator=None) -> None:
    """After an optimiser step: NaN/inf in a trainable weight stops training before it is checkpointed. Sharded
    (FSDP2, ``accelerator`` given): each process checks its shard and every process stops together."""
    finite = weights_finite(local_tensor(p) for p in params)
    if accelerator is not None and is_sharded(accelerator):
        finite = all_processes_agree(accelerator, finite)
    if not finite:
        raise TrainingStopped(
            f"non-finite trainable weights after {step_name}; stopped before they were saved. The last good "
            f"checkpoint is {last_good or 'none (no checkpoint was written yet)'}; lower --learning_rate"
        )


def save_final_weights(trained, run_path: Path, finetune: str, write_card: Callable[[Path], None],
                       family=None) -> Path:
    """``final/``: the trained LoRA (``pytorch_lora_weights.safetensors``) or full ``unet/`` (``transformer/``),
    and its model card, written as one folder (a half-written final/ is never in place); returns its path.
    ``trained``: the unwrapped model (``align.train.sharding.consolidated_model``); ``family``: the model family
    (``align.families``), SD 1.x/2.x when not given."""
    with atomic_folder(run_path / "final") as final:
        if finetune == "lora":
            pipeline.save_lora(trained, final, family)
        else:
            pipeline.save_full_unet(trained, final, family)
        write_card(final)
    return run_path / "final"


def write_diffusion_model_card(folder: Path, model: str, finetune: str, method: str, tags: str, trained_with: str,
                               rows: dict[str, str]) -> None:
    """README.md of a fine-tuned diffusion model: the hub's front matter, what it was trained with, how to load
    the weights, and a table of the run's settings and results."""
    weights = (
        "`pytorch_lora_weights.safetensors` (load with `pipe.load_lora_weights(folder)`)"
        if finetune == "lora"
        else "a diffusers `unet/` folder"
    )
    table = "".join(f"| {name} | {value} |\n" for name, value in rows.items())
    text = f"""---
base_model: {model}
tags: [text-to-image, diffusers, {tags}]
---
# {method} fine-tune of {model}

{trained_with}
Weights: {weights}.

| setting | value |
|---|---|
{table}"""
    atomic_write_text(folder / "README.md", text)

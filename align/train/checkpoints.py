"""A training run's checkpoints and final weights: trainable-only checkpoint hooks, sealed checkpoint folders,
resume, the run folder's start, the weights-finite guard, and the final diffusers-format folder with its model card."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import load_file, save_file

from align import pipeline  # save_lora / save_full_unet looked up at call time: tests replace them
from align.health import weights_finite
from align.run_folder import (
    CHECKPOINT_STATE,
    RunFolder,
    RunFolderError,
    atomic_folder,
    atomic_write_text,
    folder_manifest,
    publish_folder,
    seal,
)
from align.train.command import TrainingStopped, way_on
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


def save_checkpoint(accelerator, run: RunFolder, step: int, keep: int, extra_files: dict[str, str] | None = None,
                    settings: dict | None = None) -> Path:
    """Model, optimizer, LR scheduler and RNG states (plus a trainer's own ``extra_files``, name -> text).

    Written into a staging folder, sealed by state.json (the step, the run's ``settings``, its processes and their
    layout, every file's size and hash; checked on resume: align/train/resume.py), then renamed into place: a
    checkpoint folder is complete or absent, never half written. The first checkpoint of an --overwrite run lets go
    of the old run it had set aside.
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
            record = {"step": step, "processes": accelerator.num_processes, "sharded": is_sharded(accelerator),
                      "files": folder_manifest(staged)}
            if settings is not None:
                record["settings"] = settings
            atomic_write_text(staged / CHECKPOINT_STATE, json.dumps(seal(record)))
            publish_folder(staged, folder)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)  # e.g. a full disk: the checkpoints before stay as they were
            raise
        run.damaged.pop(folder, None)
        run.let_go_of_old_run()
        run.prune_checkpoints(keep)
    accelerator.wait_for_everyone()
    return folder


def rescale_schedules(accelerator, processes_before: int) -> None:
    """accelerate steps a prepared learning-rate schedule once per process at each optimiser step (and the trainers
    size it so): a run resumed on another number of processes continues the schedule at the same optimiser step."""
    if processes_before == accelerator.num_processes:
        return
    for prepared in accelerator._schedulers:
        inner = prepared.scheduler
        inner.last_epoch = inner.last_epoch * accelerator.num_processes // processes_before
        inner._step_count = inner.last_epoch + 1


def start_run(accelerator, run: RunFolder, config, write_config: bool = True) -> None:
    """The run folder made (or taken over) and its config.yaml written by the main process (a resumed run writes it
    once it has taken its first step: ``write_config`` False), then every process."""
    if accelerator.is_main_process:
        run.prepare()
        if write_config:
            run.save_config(asdict(config))
    accelerator.wait_for_everyone()


def stop_unless_weights_finite(params, step_name: str, last_good, accelerator=None) -> None:
    """After an optimiser step: NaN/inf in a trainable weight stops training before it is checkpointed. Sharded
    (FSDP2, ``accelerator`` given): each process checks its shard and every process stops together."""
    finite = weights_finite(local_tensor(p) for p in params)
    if accelerator is not None and is_sharded(accelerator):
        finite = all_processes_agree(accelerator, finite)
    if not finite:
        raise TrainingStopped(f"non-finite trainable weights after {step_name} (a --learning_rate too high?); stopped "
                              f"before they were saved. {way_on(last_good)}")


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

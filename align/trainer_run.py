"""The skeleton pieces of a trainer's run that DPO, DDPO and reward training share: the command around
``train(config)`` (one line and exit status 2 for a bad input, 3 for a run stopped on a bad value), the first
checks, the run folder's start, resuming from a checkpoint, and, for the diffusion trainers, the final weights
folder with its model card. Each trainer still reads top to bottom; these are the lines they all wrote alike."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from align import pipeline  # save_lora / save_full_unet looked up at call time: tests replace them
from align.cli import ConfigError, die, die_if_disk_full, parse_config
from align.data import DataError
from align.pipeline import ModelLoadError, check_model, check_sampling_steps
from align.quiet import quiet_output
from align.runs import CHECKPOINT_STATE, RunFolder, RunFolderError, atomic_folder, atomic_write_text
from align.training import TrainingStopped, adamw_class
from align.validation import check_weight_files

# A bad input: config, run folder, model files or data; each error's message names the input.
BAD_INPUT_ERRORS = (ConfigError, RunFolderError, ModelLoadError, DataError)


def run_trainer(config_class: type, train: Callable, argv: list[str] | None, description: str | None,
                stopped: tuple[type[BaseException], ...] = (TrainingStopped,)) -> None:
    """A trainer's ``main()``: parse the flags, run ``train(config)``, and turn a known failure into one line:
    exit 2 for a bad input, 3 for a run that stopped (``stopped``: NaN loss, failed reward, ...)."""
    config = parse_config(config_class, argv, description=description)
    if hasattr(config, "quiet"):
        quiet_output(config.quiet)
    try:
        train(config)
    except BAD_INPUT_ERRORS as err:
        die(str(err))
    except stopped as err:
        die(str(err), code=3)
    except OSError as err:
        die_if_disk_full(err, "rerun with --resume latest")


def save_final_weights(accelerator, unet, run_path: Path, finetune: str, write_card: Callable[[Path], None],
                       family=None) -> Path:
    """``final/``: the trained LoRA (``pytorch_lora_weights.safetensors``) or full ``unet/`` (``transformer/``),
    and its model card, written as one folder (a half-written final/ is never in place); returns its path.
    ``family``: the model family (``align.families``), SD 1.x/2.x when not given."""
    trained = accelerator.unwrap_model(unet)
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


def check_config_and_model(config) -> None:
    """The first checks of a diffusion trainer: the config's own rules, the 8-bit optimiser when asked for, and the
    model's weight files (a truncated one is named here, before anything loads)."""
    config.validate()
    adamw_class(config.use_8bit_adam)  # bitsandbytes present when asked for
    try:
        check_weight_files("--model", check_model(config.model))
        check_sampling_steps(config.model, getattr(config, "num_inference_steps", None))
    except ModelLoadError as err:
        raise ConfigError(str(err)) from None


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


def check_resume_settings(run: RunFolder, config) -> None:
    """--resume continues the run in config.yaml: a setting given another value is refused in one line naming every
    such flag (APPLIED_ON_RESUME lists what may change, and those changes are printed and recorded)."""
    import yaml

    from align.runs import CONFIG_FILE, scrub_secrets

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
    refused = [name for name in changed if name not in APPLIED_ON_RESUME]
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


def resume_from_checkpoint(accelerator, run: RunFolder, label: str) -> int | None:
    """Restore the latest checkpoint (model, optimiser, schedule and RNG states) and cut the metrics log back to
    its step; returns that step, or None when there is no checkpoint to resume from."""
    checkpoint = run.resume_checkpoint()
    if checkpoint is None:
        return None
    accelerator.load_state(str(checkpoint))
    step = json.loads((checkpoint / CHECKPOINT_STATE).read_text())["step"]
    if accelerator.is_main_process:
        run.truncate_metrics(step)
        print(f"[{label}] resumed from {checkpoint} at step {step}", flush=True)
    return step

"""Pieces shared by the trainers (dpo.py, ddpo.py, train_reward.py): prompts, judges, checkpoints, evaluation."""

from __future__ import annotations

import gc
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from align.cli import ConfigError
from align.families import family_of_pipeline
from align.health import degenerate_reason, weights_finite
from align.metrics import mean_and_sem
from align.prompt_sets import PromptSetError, load_prompt_set
from align.report import image_grid
from align.runs import (
    CHECKPOINT_STATE,
    EVALS,
    JUDGE_ANSWERS,
    RunFolder,
    RunFolderError,
    atomic_path,
    atomic_write_text,
    eval_file_name,
    folder_manifest,
    publish_folder,
    scrub_secrets,
)


class TrainingStopped(RuntimeError):
    """Training stopped on a bad value (a NaN loss or reward); the last good checkpoint is kept."""


def load_prompt_list(spec: str) -> list[str]:
    """A prompt set by name (parti, drawbench, testbed:<n>[:<seed>], mjbench, ...) or a prompt file."""
    try:
        prompts = load_prompt_set(spec).prompts
    except (PromptSetError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from None
    if not prompts:
        raise ConfigError(f"prompt source {spec!r} holds no prompts")
    return prompts


def check_lr_schedule(name: str, warmup_steps: int) -> None:
    """--lr_scheduler names one of diffusers' get_scheduler schedules; --lr_warmup_steps is >= 0."""
    from diffusers.optimization import SchedulerType

    schedules = [t.value for t in SchedulerType]
    if name not in schedules:
        raise ConfigError(f"--lr_scheduler must be one of {', '.join(schedules)}, got {name!r}")
    if warmup_steps < 0:
        raise ConfigError(f"--lr_warmup_steps must be >= 0, got {warmup_steps}")


def require_pointwise_eval_judge(spec: str, pointwise: bool) -> None:
    """The before/after evaluation scores each image on its own: refuse a judge that only compares images."""
    if not pointwise:
        raise ConfigError(
            "the before/after evaluation scores each image on its own: give a pointwise --eval_judge "
            f"(the judge {spec!r} compares images; API and VLM judges rate single images with [mode=single])"
        )


def keep_judge_answers(judges, run_path: Path, process: int) -> None:
    """API and VLM judges keep their answers in the run folder: a resumed run re-samples the epochs (or relabels the
    round) after its checkpoint with the same seeds, and gets the same images' verdicts from there instead of paying
    for them again (and so the same rewards: the resume stays exact with a judge that answers differently each time).
    One file per process: each re-generates only its own images, and no two processes write one SQLite file."""
    for judge in judges:
        keep = getattr(judge, "keep_answers_in", None)
        if callable(keep):
            keep(run_path / JUDGE_ANSWERS / f"process_{process}.sqlite")


def register_trainable_checkpoint_hooks(accelerator, only_trainable: bool) -> None:
    """With LoRA (or a frozen backbone), checkpoints hold only the trainable tensors, not the frozen model."""
    if not only_trainable:
        return

    def save_hook(models, weights, output_dir):
        for model in models:
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
            atomic_write_text(staged / CHECKPOINT_STATE, json.dumps({"step": step, "files": folder_manifest(staged)}))
            publish_folder(staged, folder)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)  # e.g. a full disk: the checkpoints before stay as they were
            raise
        run.damaged.pop(folder, None)
        run.let_go_of_old_run()
        run.prune_checkpoints(keep)
    accelerator.wait_for_everyone()
    return folder


def stop_unless_weights_finite(params, step_name: str, last_good) -> None:
    """After an optimiser step: NaN/inf in a trainable weight stops training before it is checkpointed."""
    if not weights_finite(params):
        raise TrainingStopped(
            f"non-finite trainable weights after {step_name}; stopped before they were saved. The last good "
            f"checkpoint is {last_good or 'none (no checkpoint was written yet)'}; lower --learning_rate"
        )


def save_image_row(images: torch.Tensor, path: Path) -> None:
    with atomic_path(path) as tmp:
        image_grid(images, ncols=len(images), pad=0).save(tmp, format="PNG")


def shown_images(config) -> int:
    """Held-out images in the report's before/after row: 4 x --num_validation_images (DPO), 16 for DDPO."""
    return getattr(config, "num_validation_images", 4) * 4


def evaluate_model(pipe, judge, config, steps: int, guidance: float, path: Path, label: str) -> float:
    """Mean judge score (and its standard error) on the held-out prompts with fixed seeds,
    ``eval_images_per_prompt`` seeds each; writes the scores and an image row."""
    from align.families import family_of_pipeline
    from align.pipeline import generate_images, merged_adapter

    held_out = load_prompt_list(config.eval_prompts)
    repeats = config.eval_images_per_prompt
    prompts = held_out * repeats
    # Seed eval_seed + i for the first image of prompt i, as with one image per prompt; further rounds follow on.
    seeds = [config.eval_seed + i for i in range(len(prompts))]
    with merged_adapter(family_of_pipeline(pipe).denoiser(pipe)):  # a LoRA folded into the weights: the same images up to float rounding, faster
        images = generate_images(pipe, prompts, seeds, num_inference_steps=steps, guidance_scale=guidance,
                                 batch_size=config.eval_batch_size, progress=f"held-out evaluation ({label})")
    degenerate = degenerate_reason(images)
    if degenerate:  # a diverged model's images are marked, not scored as if the model were merely bad
        atomic_write_text(path, json.dumps({"mean": None, "sem": None, "scores": None, "degenerate": degenerate,
                                            "prompts": prompts, "seeds": seeds}))
        save_image_row(torch.nan_to_num(images[: shown_images(config)]), path.with_suffix(".png"))
        print(f"[eval] {label}: DEGENERATE images ({degenerate}): not scored", flush=True)
        return float("nan")
    scores = judge.score(prompts, images).float().tolist()
    mean, sem = mean_and_sem(scores)
    shown = images[: shown_images(config)]  # the report splits this row back into images
    atomic_write_text(path, json.dumps({"mean": mean, "sem": sem, "scores": scores, "prompts": prompts, "seeds": seeds,
                                        "row_images": len(shown)}))
    save_image_row(shown, path.with_suffix(".png"))
    print(f"[eval] {label}: mean {judge.name} score on {len(held_out)} held-out prompts x {repeats} seed(s) = "
          f"{mean:.4f} (standard error {sem:.4f})", flush=True)
    return mean


def check_periodic_evaluation(flag: str, every: int, eval_prompts: str | None, judge_spec: str | None) -> None:
    """The held-out evaluation every N steps/epochs needs held-out prompts and a judge to score them."""
    if every < 0:
        raise ConfigError(f"--{flag} must be >= 0 (0: only before and after training), got {every}")
    if every and not (eval_prompts and judge_spec):
        raise ConfigError(f"--{flag} needs --eval_prompts and a judge to score them (--eval_judge or --reward)")


def periodic_evaluation_due(every: int, done: int, total: int) -> bool:
    """Whether step (DDPO: epoch) ``done`` of ``total`` gets a held-out score; the last one is eval_after's."""
    return every > 0 and done % every == 0 and done < total


def periodic_evaluation(pipe, judge, config, steps: int, guidance: float, run_dir: Path, done: int) -> float:
    """The held-out score after ``done`` steps (epochs for DDPO): evals/step_N.json and .png, scored
    exactly as eval_before / eval_after (same prompts and seeds), with the UNet in eval mode."""
    denoiser = family_of_pipeline(pipe).denoiser(pipe)  # the UNet or the transformer
    was_training = denoiser.training
    denoiser.eval()
    try:
        return evaluate_model(pipe, judge, config, steps, guidance, run_dir / EVALS / eval_file_name(done), f"step {done}")
    finally:
        denoiser.train(was_training)


def tracker_config(config) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in scrub_secrets(asdict(config)).items()}


def end_training(accelerator) -> None:
    """Close the trackers and the process group once accelerate has let go of the prepared objects.

    A DDP model freed after its process group is destroyed tears the group down from its own
    destructor, and under gloo that hung about every other 2-process CPU run at exit (the destructor,
    run from Python, waits on gloo's loop thread for ever). Callers drop their own references to the
    prepared model, optimiser and scheduler before calling this.
    """
    accelerator.free_memory()
    gc.collect()  # DDP's hooks keep the wrapper in reference cycles
    accelerator.end_training()


# ----------------------------------------------------------------------------------------------
# Precision and distribution: what the launcher says, and what the trainers can honestly run.

PRECISIONS = ("no", "fp16", "bf16")


def resolve_mixed_precision(flag: str | None, environ=None) -> str:
    """The mixed precision a run uses: --mixed_precision if given, else what `accelerate launch` (its flag or
    its config file) put in ACCELERATE_MIXED_PRECISION, else "no"."""
    environ = os.environ if environ is None else environ
    if flag is not None:
        source, value = "--mixed_precision", flag
    else:
        source, value = "ACCELERATE_MIXED_PRECISION (accelerate launch / its config file)", environ.get("ACCELERATE_MIXED_PRECISION", "no")
    value = str(value).lower()
    if value not in PRECISIONS:
        raise ConfigError(f"{source} is {value!r}; the trainers run {', '.join(PRECISIONS)}")
    return value


UNSUPPORTED_LAUNCHERS = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}
DISTRIBUTED_HELP = ("what works: one process, or multi-process data parallel (DDP), e.g. "
                    "`accelerate launch --multi_gpu --num_processes 8 align/<trainer>.py ...` (docs/scale.md)")


def refuse_unsupported_launch(environ=None) -> None:
    """Before the Accelerator is built: DeepSpeed, FSDP and Megatron-LM are not tested here, so refuse them."""
    environ = os.environ if environ is None else environ
    for variable, name in UNSUPPORTED_LAUNCHERS.items():
        if str(environ.get(variable, "")).lower() in ("1", "true", "yes"):
            raise ConfigError(f"{name} is not supported by this trainer ({variable} is set by the launcher); {DISTRIBUTED_HELP}")
    if cpu_launch_lost_its_processes(environ):
        raise ConfigError(
            "`accelerate launch --cpu --num_processes N` starts one process whatever N says (accelerate runs --cpu "
            "alone), so this would train one process with N times fewer pairs per step; for N CPU processes use "
            "`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N align/<trainer>.py ...`, for one "
            "leave out --num_processes (docs/training.md#multi-process-and-multi-gpu)")


# Set in each process by torch's launcher (WORLD_SIZE, RANK) or by MPI: a process that has none of them is alone.
_WORLD_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def cpu_launch_lost_its_processes(environ) -> bool:
    """accelerate's simple launcher (--cpu) starts the script once, and exports MASTER_ADDR only when more than
    one process was asked for: that trio without any world variable is a multi-process CPU launch run alone."""
    return (str(environ.get("ACCELERATE_USE_CPU", "")).lower() in ("1", "true", "yes") and "MASTER_ADDR" in environ
            and not any(v in environ for v in _WORLD_VARIABLES))


def refuse_unsupported_distribution(accelerator) -> None:
    """After the Accelerator is built (a plugin passed some other way): only no distribution or DDP."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind not in ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU"):
        raise ConfigError(f"accelerate's distributed type {kind} is not supported by this trainer; {DISTRIBUTED_HELP}")


def make_accelerator(flag_precision: str | None, label: str, **kwargs):
    """An Accelerator with the resolved mixed precision, refusing the untested distributed modes; logs the precision."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    refuse_unsupported_launch()
    precision = resolve_mixed_precision(flag_precision)
    if AcceleratorState._shared_state and AcceleratorState().mixed_precision != precision:
        # A second train() in one Python process (a notebook, the tests) with another precision: accelerate keeps
        # its state process-wide and would refuse; reset the precision part, not the process group.
        AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(mixed_precision=precision, **kwargs)
    refuse_unsupported_distribution(accelerator)
    if accelerator.is_main_process:
        source = "--mixed_precision" if flag_precision is not None else "accelerate's setting"
        scaler = " with accelerate's gradient scaler" if getattr(accelerator, "scaler", None) is not None else ""
        print(f"[{label}] mixed precision: {precision} (from {source}){scaler}", flush=True)
    return accelerator, precision


def apply_matmul_switches(allow_tf32: bool) -> None:
    """--allow_tf32: TF32 tensor cores for fp32 matmuls and convolutions on Ampere and newer GPUs (as diffusers' scripts)."""
    if allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def adamw_class(use_8bit_adam: bool):
    """torch's AdamW, or bitsandbytes' 8-bit AdamW (refused in one line when bitsandbytes is missing)."""
    if not use_8bit_adam:
        return torch.optim.AdamW
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("--use_8bit_adam needs bitsandbytes, which is not installed (pip install bitsandbytes)") from None
    return bnb.optim.AdamW8bit


def keep_default_attention(unet) -> None:
    """SDPA attention: diffusers' default AttnProcessor2_0 (torch's scaled_dot_product_attention); put it back if a
    loaded model carries another processor. LoRA (PEFT) wraps the projections, not the processor, so it stays."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    processors = getattr(unet, "attn_processors", {})
    if processors and not all(isinstance(p, AttnProcessor2_0) for p in processors.values()):
        unet.set_attn_processor(AttnProcessor2_0())

"""The held-out evaluation during training: the same prompts and seeds scored before, every N steps and after
training, with an image row per evaluation for the report.

With --eval_second_judge the same images are also scored by a second judge (the testbed's exact oracle beside a learned
judge used as the reward): the report then draws both judges' gains along the run, the over-optimisation curve. Each
evaluation of a LoRA run also records how far the trained denoiser's predictions moved from the base model's (the
adapter off) on noised latents of its first held-out images: ``prediction_change``, the mean squared change."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from align.api_cost import is_paid
from align.cli import ConfigError
from align.data.prompt_sets import load_prompt_list
from align.eval.paired import PART_LABELS, changes_by_part, describe_change
from align.eval.report import image_grid
from align.families import family_of_pipeline
from align.families.base import guided_prediction
from align.health import degenerate_reason
from align.judges import load_judge
from align.metrics import mean_and_sem
from align.pipeline import disabled_adapter, generate_images, merged_adapter
from align.run_folder import (
    EVALS,
    atomic_path,
    atomic_write_text,
    eval_file_name,
)
from align.train.sharding import full_weights_for_main

PROBE_IMAGES = 8  # held-out images whose noised latents measure how far the predictions moved from the base model
PROBE_SEED = 20260


def require_pointwise_eval_judge(spec: str, pointwise: bool) -> None:
    """The before/after evaluation scores each image on its own: refuse a judge that only compares images."""
    if not pointwise:
        raise ConfigError(
            "the before/after evaluation scores each image on its own: give a pointwise --eval_judge "
            f"(the judge {spec!r} compares images; API and VLM judges rate single images with [mode=single])"
        )


def save_image_row(images: torch.Tensor, path: Path) -> None:
    with atomic_path(path) as tmp:
        image_grid(images, ncols=len(images), pad=0).save(tmp, format="PNG")


def shown_images(config) -> int:
    """Held-out images in the report's before/after row: 4 x --num_validation_images (DPO), 16 for DDPO."""
    return getattr(config, "num_validation_images", 4) * 4


def evaluate_model(pipe, judge, config, steps: int, guidance: float, path: Path, label: str, second=None) -> float:
    """Mean judge score (and its standard error) on the held-out prompts with fixed seeds,
    ``eval_images_per_prompt`` seeds each; writes the scores and an image row. ``second``: a second judge scored on
    the same images (its scores under "second_judge")."""
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
    record = {"mean": mean, "sem": sem, "scores": scores, "prompts": prompts, "seeds": seeds, "row_images": len(shown),
              "prediction_change": prediction_change(pipe, images, prompts, guidance)}
    if second is not None:
        second_scores = second.score(prompts, images).float().tolist()
        second_mean, second_sem = mean_and_sem(second_scores)
        record["second_judge"] = {"name": second.name, "mean": second_mean, "sem": second_sem, "scores": second_scores}
    atomic_write_text(path, json.dumps(record))
    save_image_row(shown, path.with_suffix(".png"))
    print(f"[eval] {label}: mean {judge.name} score on {len(held_out)} held-out prompts x {repeats} seed(s) = "
          f"{mean:.4f} (standard error {sem:.4f})" + (f"; {second.name}: {record['second_judge']['mean']:.4f}"
                                                      if second is not None else ""), flush=True)
    if label == "after":
        print_paired_change(path.with_name("eval_before.json"), scores, prompts, seeds, config.eval_prompts)
    return mean


def print_paired_change(before_path: Path, scores: list[float], prompts: list[str], seeds: list[int], spec: str) -> None:
    """The run's headline: after - before on the same images, with the standard error per image and clustered by
    caption (a caption's seeds share its difficulty), for each part of the testbed's split among the prompts."""
    before = json.loads(before_path.read_text()) if before_path.is_file() else {}
    if before.get("scores") is None or (before.get("prompts"), before.get("seeds")) != (prompts, seeds):
        return  # no before score of the same images (a degenerate base, or another held-out set)
    for label, change in changes_by_part(before["scores"], scores, prompts).items():
        unit = "prompt" if label == PART_LABELS[None] else "caption"
        print(f"[eval] after - before on {label} ({spec}): {describe_change(change, unit)}", flush=True)


@torch.no_grad()
def prediction_change(pipe, images: torch.Tensor, prompts: list[str], guidance: float) -> float | None:
    """The mean squared change of the denoiser's guided prediction from the base model's (its LoRA adapter switched
    off), on the first PROBE_IMAGES held-out images noised at training timesteps drawn from a fixed seed: how far the
    run moved the model (the over-optimisation curve's distance). None when the denoiser has no adapter."""
    family = family_of_pipeline(pipe)
    denoiser = family.denoiser(pipe)
    if not getattr(denoiser, "peft_config", None):
        return None
    count = min(PROBE_IMAGES, len(prompts))
    device = next(denoiser.parameters()).device
    x0 = family.encode_images(pipe, images[:count].to(device) * 2 - 1)
    gen = torch.Generator().manual_seed(PROBE_SEED)
    timesteps = family.draw_training_timesteps(pipe.scheduler, count, gen).to(device)
    noise = torch.randn(x0.shape, generator=gen).to(x0.device, x0.dtype)
    noisy, _ = family.noisy_and_target(pipe.scheduler, x0, noise, timesteps)
    resolution = images.shape[-1]
    cond = family.encode_prompts(pipe, prompts[:count], resolution)
    uncond = family.unconditional(pipe, count, resolution)
    trained = guided_prediction(family, denoiser, noisy, timesteps, cond, uncond, guidance)
    with disabled_adapter(denoiser):
        base = guided_prediction(family, denoiser, noisy, timesteps, cond, uncond, guidance)
    return float(((trained - base) ** 2).mean())


def load_second_judge(spec: str | None):
    """The second held-out judge, loaded and checked: it scores images on its own and runs locally (the cost guard
    prices --reward and --eval_judge only)."""
    if not spec:
        return None
    judge = load_judge(spec)
    require_pointwise_eval_judge(spec, judge.pointwise)
    if is_paid(judge):
        raise ConfigError(f"--eval_second_judge {spec!r} is a paid API judge: the second held-out judge runs locally "
                          "(give it as --eval_judge to have its calls priced)")
    return judge


def check_periodic_evaluation(flag: str, every: int, eval_prompts: str | None, judge_spec: str | None) -> None:
    """The held-out evaluation every N steps/epochs needs held-out prompts and a judge to score them."""
    if every < 0:
        raise ConfigError(f"--{flag} must be >= 0 (0: only before and after training), got {every}")
    if every and not (eval_prompts and judge_spec):
        raise ConfigError(f"--{flag} needs --eval_prompts and a judge to score them (--eval_judge or --reward)")


def periodic_evaluation_due(every: int, done: int, total: int) -> bool:
    """Whether step (DDPO: epoch) ``done`` of ``total`` gets a held-out score; the last one is eval_after's."""
    return every > 0 and done % every == 0 and done < total


def periodic_evaluation(pipe, judge, config, steps: int, guidance: float, run_dir: Path, done: int,
                        second=None) -> float:
    """The held-out score after ``done`` steps (epochs for DDPO): evals/step_N.json and .png, scored
    exactly as eval_before / eval_after (same prompts and seeds), with the UNet in eval mode."""
    denoiser = family_of_pipeline(pipe).denoiser(pipe)  # the UNet or the transformer
    was_training = denoiser.training
    denoiser.eval()
    try:
        return evaluate_model(pipe, judge, config, steps, guidance, run_dir / EVALS / eval_file_name(done), f"step {done}",
                              second)
    finally:
        denoiser.train(was_training)


class HeldOutCheck:
    """A run's held-out evaluation: before training (a run that starts at step 0), every ``every`` steps (epochs)
    and after training, on the main process with the whole weights (FSDP2 gathers them once), all with the run's
    steps and guidance. It is on when the run has held-out prompts and a judge to score them; ``judge`` is that judge
    on the main process (None elsewhere)."""

    def __init__(self, run, pipe, judge, steps: int, guidance: float, every: int, total: int):
        self.run, self.pipe, self.judge, self.steps, self.guidance = run, pipe, judge, steps, guidance
        self.every, self.total = every, total
        config = run.config
        self.enabled = bool(config.eval_prompts) and bool(config.eval_judge or config.reward)
        self.denoiser = family_of_pipeline(pipe).denoiser(pipe)
        main = run.accelerator.is_main_process
        self.second = load_second_judge(config.eval_second_judge) if self.enabled and main else None

    def _on_main(self, needed: bool, score) -> float | None:
        with full_weights_for_main(self.run.accelerator, self.denoiser, needed=needed) as here:
            return score() if here else None

    def before(self, start: int) -> None:
        self._on_main(self.enabled and start == 0, lambda: evaluate_model(
            self.pipe, self.judge, self.run.config, self.steps, self.guidance, self.run.path / "eval_before.json",
            "before", self.second))

    def during(self, done: int) -> float | None:
        """The held-out score after ``done`` steps when one is due (main process), else None."""
        due = self.enabled and periodic_evaluation_due(self.every, done, self.total)
        return self._on_main(due, lambda: periodic_evaluation(self.pipe, self.judge, self.run.config, self.steps,
                                                              self.guidance, self.run.path, done, self.second))

    def after(self) -> None:
        self._on_main(self.enabled, lambda: evaluate_model(
            self.pipe, self.judge, self.run.config, self.steps, self.guidance, self.run.path / "eval_after.json",
            "after", self.second))

"""The run lifecycle every trainer shares (Diffusion-DPO, online RL, reward models), written once.

A trainer makes one ``TrainingRun`` from its config and then reads as its algorithm:

    run = TrainingRun(config, "dpo", shardable=True)   # the folder (and its lock), resume settings checked, accelerator
    ... judges and data checked: nothing is written yet ...
    run.start(judges)                                   # config.yaml, the judges' answer cache, the seed
    ... models, optimiser ...
    model, optimizer = run.prepare(model, optimizer)    # accelerate's wrapping, trainable-only checkpoints
    start, state = run.resume()                         # the newest checkpoint, or the start
    run.init_trackers()
    for step in run.progress(start, total): ... run.log(done, logs) ... run.checkpoint(done)
    run.save_final(...); run.report(...); run.end()

Every guarantee of docs/guarantees.md that is not an algorithm's own lives here or in what it calls: a start refused
before anything is written, a resumed run that keeps its settings, checkpoints that are complete or absent, exact
resume (every random draw is keyed by the step, so restoring the states is enough), final weights written whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from align.progress import progress_bar
from align.run_folder import CHECKPOINT_STATE, RunFolder
from align.train.accelerator import end_training, make_accelerator, tracker_config
from align.train.checkpoints import (
    register_trainable_checkpoint_hooks,
    rescale_schedules,
    save_checkpoint,
    save_final_weights,
    start_run,
)
from align.train.command import keep_judge_answers
from align.train.report import write_training_report
from align.train.resume import check_resume_settings, run_settings


class TrainingRun:
    """One run of a trainer: its folder, the Accelerator, resume, trackers, the metrics log, checkpoints, the end.

    ``label`` names the trainer in printed lines and its tracker project; ``step_name`` is what one logged step is
    (DDPO logs epochs); ``shardable``: the trainer supports FSDP2; ``accumulate``: accelerate counts the config's
    gradient accumulation (``accelerator.accumulate``)."""

    def __init__(self, config, label: str, step_name: str = "step", shardable: bool = False, accumulate: bool = False):
        self.config, self.label, self.step_name = config, label, step_name
        self.folder = RunFolder(config.output_dir, resume=config.resume, overwrite=config.overwrite)
        check_resume_settings(self.folder, config)  # a resumed run keeps its settings (or is refused in one line)
        self.log_with = None if config.report_to == "none" else config.report_to
        accumulation = {"gradient_accumulation_steps": config.gradient_accumulation_steps} if accumulate else {}
        self.accelerator, config.mixed_precision = make_accelerator(  # the flag, else accelerate's; recorded resolved
            config.mixed_precision, label, shardable=shardable, log_with=self.log_with,
            project_dir=str(self.folder.path), **accumulation)
        self.main = self.accelerator.is_main_process
        # A resumed run rewrites nothing of its record (config.yaml, metrics.jsonl) until it has taken its first step:
        # a resume that fails before that leaves the run as it was. None: nothing pending (a fresh start writes at once).
        self.resumed_at: int | None = None

    @property
    def path(self) -> Path:
        return self.folder.path

    def say(self, line: str, tag: str | None = None) -> None:
        """A line from the main process, tagged with the trainer's label (or ``tag``)."""
        if self.main:
            print(f"[{tag or self.label}] {line}", flush=True)

    def start(self, judges: Iterable = ()) -> None:
        """After every check: the run folder made (config.yaml written), API and VLM judges keeping their answers in
        it (a resumed run asks nothing twice), and the seed of everything random set."""
        from accelerate.utils import set_seed

        start_run(self.accelerator, self.folder, self.config, write_config=not self.config.resume)
        keep_judge_answers([judge for judge in judges if judge is not None], self.path, self.accelerator.process_index)
        set_seed(self.config.seed)

    def prepare(self, model, optimizer, scheduler=None, only_trainable: bool = True):
        """The model, optimiser (and learning-rate schedule) wrapped by accelerate; checkpoints then hold the trainable
        tensors only (``only_trainable``: LoRA or a frozen backbone) or the whole model."""
        prepared = self.accelerator.prepare(model, optimizer, *([scheduler] if scheduler is not None else []))
        register_trainable_checkpoint_hooks(self.accelerator, only_trainable)
        return prepared

    def resume(self, state_file: str | None = None) -> tuple[int, dict]:
        """(the step to start from, the trainer's own state saved in ``state_file`` of that checkpoint): the newest
        sound checkpoint's model, optimiser, schedule and RNG states restored and the metrics log cut back to it, or
        (0, {}) when there is none."""
        checkpoint = self.folder.resume_checkpoint()
        if checkpoint is None:
            if self.config.resume:
                self.resumed_at = 0
                self.say(f"--resume latest: no checkpoint yet, starting from {self.step_name} 0")
            return 0, {}
        self.accelerator.load_state(str(checkpoint))
        sealed = json.loads((checkpoint / CHECKPOINT_STATE).read_text())
        rescale_schedules(self.accelerator, sealed.get("processes", self.accelerator.num_processes))
        state = json.loads((checkpoint / state_file).read_text()) if state_file else {}
        self.resumed_at = sealed["step"]
        self.say(f"resumed from {checkpoint} at {self.step_name} {sealed['step']}")
        return sealed["step"], state

    def _record_resumed_run(self, step: int | None = None) -> None:
        """Once a resumed run has taken a step (``step``, just done) or reached its final save: the metrics logged after
        its checkpoint dropped (they are redone) and config.yaml rewritten with what the resume applied."""
        if self.resumed_at is None:
            return
        if self.main:
            self.folder.truncate_metrics(self.resumed_at, keep_eval=step)
            self.folder.save_config(asdict(self.config))
        self.resumed_at = None

    def init_trackers(self, project: str) -> None:
        if self.log_with:
            self.accelerator.init_trackers(project, config=tracker_config(self.config))

    def progress(self, start: int, end: int):
        return progress_bar(range(start, end), desc=self.label, unit=self.step_name,
                            enabled=self.accelerator.is_local_main_process)

    def log(self, step: int, logs: dict) -> None:
        """metrics.jsonl (main process) and the trackers."""
        self._record_resumed_run(step)
        if self.main:
            self.folder.log(step, logs)
        self.accelerator.log(logs, step=step)

    def checkpoint(self, step: int, extra_files: dict[str, str] | None = None) -> Path:
        """A sealed checkpoint of every state (plus the trainer's ``extra_files``), older ones pruned."""
        self._record_resumed_run(step)
        return save_checkpoint(self.accelerator, self.folder, step, self.config.checkpoints_total_limit, extra_files,
                               settings=run_settings(self.config))

    def latest_checkpoint(self) -> Path | None:
        return self.folder.latest_checkpoint()

    def save_final(self, trained, family, write_card: Callable[[Path], None]) -> None:
        """final/ (main process): the LoRA or the whole denoiser in diffusers' format, with its model card."""
        self._record_resumed_run()
        if self.main:
            save_final_weights(trained, self.path, self.config.finetune, write_card, family=family)

    def report(self, title: str, curves, judge: str | None = None, extra_sections=()) -> None:
        """report.html (main process); the run has now written everything, so an old run it replaced is let go."""
        if self.main:
            write_training_report(self.path, title=title, judge=judge, step_name=self.step_name, curves=curves,
                                  extra_sections=extra_sections)
            self.folder.let_go_of_old_run()

    def end(self, judges: Iterable = ()) -> None:
        """Judges closed (API judges print their token and cost counts), trackers and processes ended. The trainer
        drops its references to the prepared model, optimiser and schedule first (align/train/accelerator.py)."""
        for judge in {id(j): j for j in judges if j is not None}.values():
            judge.close()
        end_training(self.accelerator)

"""Run folders: one folder per run holding the resolved config (no secrets), metrics.jsonl,
checkpoints for exact resume, final weights, samples and the report. Writes are atomic."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml

from rewards.secrets import scrub, scrub_text

# The process umask, read once (os.umask can only be read by setting it, which races with other threads).
_UMASK = os.umask(0)
os.umask(_UMASK)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
EVALS = "evals"  # held-out scores during the run: step_N.json / .png
COMPILED = "compiled"  # older runs kept compiled code here; never loaded now (align/compiled_sampling.py), --overwrite removes it
JUDGE_ANSWERS = "judge_answers"  # process_N.sqlite: API/VLM judges' answers, so a resumed run asks nothing twice


def eval_file_name(step: int) -> str:
    return f"step_{step:07d}.json"


def eval_step(path: Path) -> int:
    """The step of an evals/ file (step_N.json or its .png)."""
    return int(path.stem.split("_")[1])


def held_out_evals(run_dir: str | Path) -> list[Path]:
    """The held-out scores written during a run (evals/step_N.json), in step order."""
    return sorted((Path(run_dir) / EVALS).glob("step_*.json"), key=eval_step)

class RunFolderError(ValueError):
    pass


def scrub_secrets(obj):
    """A copy of ``obj`` with secrets masked (rewards.secrets: key-shaped strings, key-holding variables' values)."""
    return scrub(obj)


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside ``path``; on success it replaces ``path`` (fsynced, usual
    permissions), on error it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Every text file a run writes (config, model card, report, scores) passes the secrets scrubber."""
    atomic_write_bytes(path, scrub_text(text).encode("utf-8"))


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run folder's metrics.jsonl (none if it has no such file)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunFolder:
    """The output folder of one run.

    A folder that already holds a run (its config.yaml) is refused unless ``resume`` is set
    (continue it) or ``overwrite`` is set (start afresh; old checkpoints are removed).
    """

    def __init__(self, output_dir: str | Path, resume: str | None = None, overwrite: bool = False):
        self.path = Path(output_dir)
        self.resume = resume
        holds_run = (self.path / CONFIG_FILE).is_file() or (self.path / CHECKPOINTS).is_dir()
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"output path {self.path} exists and is not a folder")
        if holds_run and not resume and not overwrite:
            raise RunFolderError(
                f"output folder {self.path} already holds a run; pass --resume latest to continue it, "
                "--overwrite to start afresh, or choose another --output-dir"
            )
        if resume and resume != "latest" and not Path(resume).is_dir():
            raise RunFolderError(f"--resume {resume!r}: no such checkpoint folder (or use 'latest')")
        self.overwrite = overwrite and not resume

    def prepare(self) -> None:
        """Create the folder (main process only). With --overwrite, clear old run outputs."""
        if self.overwrite:
            outputs = (CHECKPOINTS, METRICS_FILE, CONFIG_FILE, "final", "samples", "feedback", "report.html",
                       "eval_before.json", "eval_before.png", "eval_after.json", "eval_after.png", EVALS,
                       JUDGE_ANSWERS, COMPILED)
            for name in outputs:
                target = self.path / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        self.path.mkdir(parents=True, exist_ok=True)

    def save_config(self, config: dict) -> None:
        atomic_write_text(self.path / CONFIG_FILE, yaml.safe_dump(scrub_secrets(config), sort_keys=False))

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path / METRICS_FILE, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def read_metrics(self) -> list[dict]:
        return read_metrics(self.path)

    def truncate_metrics(self, after_step: int) -> None:
        """On resume, drop metric lines and held-out evaluations (evals/) logged after the checkpoint
        (they will be redone)."""
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= after_step]
        atomic_write_text(self.path / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))
        evals = self.path / EVALS
        for scored in evals.glob("step_*.*") if evals.is_dir() else []:
            if eval_step(scored) > after_step:
                scored.unlink()

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / CHECKPOINTS / f"step_{step:07d}"

    def checkpoints(self) -> list[Path]:
        folder = self.path / CHECKPOINTS
        if not folder.is_dir():
            return []
        done = [p for p in folder.iterdir() if p.is_dir() and (p / "state.json").is_file()]
        return sorted(done, key=lambda p: int(p.name.split("_")[-1]))

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def resume_checkpoint(self) -> Path | None:
        if not self.resume:
            return None
        if self.resume == "latest":
            return self.latest_checkpoint()
        return Path(self.resume)

    def prune_checkpoints(self, keep: int) -> None:
        if keep <= 0:
            return
        for old in self.checkpoints()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _plain(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value

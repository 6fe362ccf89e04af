"""Run folders: one folder per run holding the resolved config (no secrets), metrics.jsonl,
checkpoints for exact resume, final weights, samples and the report.

Nothing already written is lost (docs/guarantees.md): every file is written atomically (a temporary
file beside it, fsynced, then renamed over it), folders (checkpoints, final weights) likewise as a
whole, metrics.jsonl is appended line by line and read back without a torn last line, checkpoints
carry a manifest of their files' sizes and hashes so a damaged one is recognised and skipped, and
``--overwrite`` sets the old run aside until the new one has written its first checkpoint."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import yaml

from align.run_lock import (  # noqa: F401  (re-exported: the lock's names as they were here)
    LOCK_FILE,
    RunFolderError,
    acquire_run_lock,
    check_not_locked,
    live_lock_holder,
    process_command,
    process_start,
    release_run_lock,
)
from rewards.secrets import scrub, scrub_text

# The process umask, read once (os.umask can only be read by setting it, which races with other threads).
_UMASK = os.umask(0)
os.umask(_UMASK)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
EVALS = "evals"  # held-out scores during the run: step_N.json / .png
COMPILED = "compiled"  # older runs kept compiled sampling code here (--compile_sampling, removed); --overwrite removes it
JUDGE_ANSWERS = "judge_answers"  # process_N.sqlite: API/VLM judges' answers, so a resumed run asks nothing twice
CHECKPOINT_STATE = "state.json"  # written last into a checkpoint: its step and the manifest of its files
SET_ASIDE = ".overwritten_run"  # --overwrite: the old run's outputs, until the new run has a checkpoint
_SET_ASIDE_LIST = "moved.json"  # inside SET_ASIDE: which outputs were being moved there
# Everything a run writes into its folder (other files, e.g. the user's notes, are never touched).
RUN_OUTPUTS = (CHECKPOINTS, METRICS_FILE, CONFIG_FILE, "final", "samples", "feedback", "report.html",
               "eval_before.json", "eval_before.png", "eval_after.json", "eval_after.png", EVALS, JUDGE_ANSWERS, COMPILED,
               "latents")  # --latent_store run's store of the run's pairs (align/dpo.py run_store_path)
_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")
_UNCHOSEN = object()
CONFIG_SEAL = "# digest: "  # config.yaml's last line: a digest of the settings above it
# Run folders whose old run this process set aside and has not yet let go (see restores_old_run_on_failure).
_SET_ASIDE_HERE: set[Path] = set()
# Run folders this process prepared (their RunFolder), so the trainer's wrapper can undo a start that failed.
_OPEN_RUNS: dict[Path, RunFolder] = {}


def eval_file_name(step: int) -> str:
    return f"step_{step:07d}.json"


def eval_step(path: Path) -> int:
    """The step of an evals/ file (step_N.json or its .png)."""
    return int(path.stem.split("_")[1])


def held_out_evals(run_dir: str | Path) -> list[Path]:
    """The held-out scores written during a run (evals/step_N.json), in step order."""
    return sorted((Path(run_dir) / EVALS).glob("step_*.json"), key=eval_step)


def holds_training_run(path: str | Path) -> bool:
    """Whether ``path`` holds a training run (its config and any of checkpoints, final weights or metrics)."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and any((path / name).exists() for name in (CHECKPOINTS, "final", METRICS_FILE))


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


def _fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` (and the folders' entries) to disk before it is published."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        _fsync_dir(sub)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened for fsync
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish_folder(staged: Path, path: Path) -> None:
    """Make the complete folder ``staged`` become ``path`` (same parent folder): fsynced, then renamed; an
    existing ``path`` is renamed aside first and removed only once the new one is in place."""
    _fsync_tree(staged)
    os.chmod(staged, 0o777 & ~_UMASK)  # mkdtemp makes 0700 folders
    old = path.parent / f".{path.name}.replaced"
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    try:
        os.replace(staged, path)
    except BaseException:
        if old.exists() and not path.exists():
            os.replace(old, path)  # else clean_interrupted_writes puts it back when the run is next opened
        raise
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(path: str | Path):
    """Yield an empty temporary folder beside ``path``; once the block succeeds it becomes ``path`` (see
    publish_folder). On error it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield staged
        publish_folder(staged, path)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_manifest(folder: Path) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every file in a checkpoint folder (but its state.json)."""
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder) != Path(CHECKPOINT_STATE)
    }


# ------------------------------------------------------------------------------------------- sealed records
# A record a run writes and reads back (a checkpoint's state.json, a latent store's manifest) carries a digest of its
# own fields: a field edited by hand (the processes of a checkpoint, the resolution of a store) is seen, and a record
# without a digest (edited, or written by a version before records were sealed) is never trusted.

DIGEST = "digest"


def record_digest(record: dict) -> str:
    """sha256 of a record's fields but its digest (JSON, keys sorted), 32 hex digits."""
    body = {k: v for k, v in record.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]


def seal(record: dict) -> dict:
    """The record with its digest."""
    body = {k: v for k, v in record.items() if k != DIGEST}
    return {**body, DIGEST: record_digest(body)}


def seal_problem(record) -> str | None:
    """Why a record read back cannot be trusted (not an object, no digest, a digest that does not match), or None."""
    if not isinstance(record, dict):
        return f"is not a JSON object (found {type(record).__name__})"
    if DIGEST not in record:
        return "carries no digest (edited by hand, or written by a version before records were sealed)"
    if record[DIGEST] != record_digest(record):
        return "was changed after it was written (its digest does not match)"
    return None


def read_sealed(path: Path) -> dict:
    """A sealed JSON record; ValueError (naming the file and why) when it is unreadable, unsealed or changed."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path.name} is unreadable ({type(err).__name__})") from None
    if problem := seal_problem(record):
        raise ValueError(f"{path.name} {problem}")
    return record


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from (its state.json unreadable, unsealed or changed; a file
    missing, truncated or changed since it was written), or None."""
    try:
        state = read_sealed(folder / CHECKPOINT_STATE)
        int(state["step"])
        files = dict(state["files"])
    except ValueError as err:
        return str(err)
    except (KeyError, TypeError) as err:
        return f"{CHECKPOINT_STATE} lacks its step or file list ({type(err).__name__})"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} is {size} bytes, {expected['size']} were written"
        if file_sha256(path) != expected["sha256"]:
            return f"{name} has changed since it was written (hash mismatch)"
    return None


def read_config_copy(run_dir: str | Path, needed_for: str) -> dict | None:
    """The settings in a run folder's config.yaml (None without one) when a resume must keep to them (``needed_for``
    says why: the run has no checkpoint recording them). A copy that does not parse, or was edited after the run
    wrote it (its digest line no longer matches), is refused in one line; one without a digest line was written
    before copies were sealed, and is read as it is."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
        settings = yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        settings = None
    if not isinstance(settings, dict):
        raise RunFolderError(f"--resume: {path} is not a readable config, and {needed_for}: the run's settings are "
                             "unknown, so it cannot be continued (start afresh with --overwrite true)")
    seals = [line for line in text.splitlines() if line.startswith(CONFIG_SEAL)]
    if seals and seals[-1][len(CONFIG_SEAL):].split()[0] != record_digest(settings):
        raise RunFolderError(f"--resume: {path} was edited after the run wrote it, and {needed_for}: what the run was "
                             "started with is unknown. Put the file back as it was, or start afresh with --overwrite true")
    return settings


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run folder's metrics.jsonl (none if it has no such file). A last line cut short
    (the process was killed while appending it) is left out; damage anywhere else is an error."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise RunFolderError(f"{path}: line {number} is not a JSON record") from None
    return records


class RunFolder:
    """The output folder of one run.

    A folder that already holds a run (its config.yaml) is refused unless ``resume`` is set
    (continue it) or ``overwrite`` is set (start afresh: the old run's outputs are set aside, and
    deleted only once the new run has written its first checkpoint; a start that fails gives them back).
    """

    def __init__(self, output_dir: str | Path, resume: str | None = None, overwrite: bool = False):
        self.path = Path(output_dir)
        self.resume = resume
        self.damaged: dict[Path, str] = {}  # checkpoints found damaged (skipped by latest_checkpoint)
        self._chosen: Path | None | object = _UNCHOSEN  # the checkpoint a resume starts from, once looked for
        if not str(output_dir).strip():
            raise RunFolderError("--output_dir is empty; give a folder path (. for the current folder)")
        holds_run = any((self.path / name).exists() for name in (CONFIG_FILE, CHECKPOINTS, SET_ASIDE))
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"output path {self.path} exists and is not a folder")
        check_not_locked(self.path)  # a run still training there: neither --resume nor --overwrite may touch it
        if holds_run and not resume and not overwrite:
            raise RunFolderError(
                f"output folder {self.path} already holds a run; pass --resume latest to continue it, "
                "--overwrite to start afresh, or choose another --output-dir"
            )
        if resume and resume != "latest" and not Path(resume).is_dir():
            raise RunFolderError(f"--resume {resume!r}: no such checkpoint folder (or use 'latest')")
        self.overwrite = overwrite and not resume
        self.created: set[str] = set()  # the outputs this run made where none were (undone by a start that fails)
        self.made_folder = False

    def prepare(self) -> None:
        """Create the folder (main process only). An old run set aside by an --overwrite start that never
        finished is given back first; with --overwrite, the old run's outputs are set aside (set_aside). The
        folder's lock is taken first: a second start into it is refused."""
        self.made_folder = not self.path.exists()
        acquire_run_lock(self.path)
        _OPEN_RUNS[self.path.resolve()] = self
        recover_set_aside_run(self.path)
        if self.path.is_dir():
            clean_interrupted_writes(self.path)
        if self.overwrite:
            self.set_aside_old_run()
        self.path.mkdir(parents=True, exist_ok=True)
        self.created = {name for name in RUN_OUTPUTS if not (self.path / name).exists()}

    def set_aside_old_run(self) -> None:
        """Move the old run's outputs into <run>/.overwritten_run (renames: nothing is copied or changed)."""
        names = [name for name in RUN_OUTPUTS if (self.path / name).exists()]
        if not names:
            return
        aside = self.path / SET_ASIDE
        aside.mkdir()
        atomic_write_text(aside / _SET_ASIDE_LIST, json.dumps(names))  # before any move: what restore may undo
        for name in names:
            os.replace(self.path / name, aside / name)
        _SET_ASIDE_HERE.add(self.path.resolve())
        print(f"[run] --overwrite: the old run in {self.path} is set aside ({', '.join(names)}) until this run "
              "writes its first checkpoint; if this run fails to start it is given back", flush=True)

    def let_go_of_old_run(self) -> None:
        """The new run stands (it has a checkpoint): delete the old run set aside by --overwrite."""
        aside = self.path / SET_ASIDE
        if aside.is_dir():
            shutil.rmtree(aside)
        _SET_ASIDE_HERE.discard(self.path.resolve())

    def save_config(self, config: dict) -> None:
        """config.yaml: the run's settings for people to read, sealed by a digest line (an edited copy is seen)."""
        text = scrub_text(yaml.safe_dump(scrub_secrets(config), sort_keys=False))
        atomic_write_text(self.path / CONFIG_FILE, f"{text}{CONFIG_SEAL}{record_digest(yaml.safe_load(text))}  "
                                                   "(a copy for people: the run's checkpoints hold its settings)\n")

    def log(self, step: int, metrics: dict) -> None:
        """Append one record (one write of one line, flushed to disk; a torn last line is skipped on read)."""
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path / METRICS_FILE, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def read_metrics(self) -> list[dict]:
        return read_metrics(self.path)

    def truncate_metrics(self, after_step: int, keep_eval: int | None = None) -> None:
        """On resume, drop metric lines and held-out evaluations (evals/) logged after the checkpoint
        (they will be redone), but the evaluation of step ``keep_eval`` (the resumed run's own, just written)."""
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= after_step]
        atomic_write_text(self.path / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in kept))
        evals = self.path / EVALS
        for scored in evals.glob("step_*.*") if evals.is_dir() else []:
            if eval_step(scored) > after_step and eval_step(scored) != keep_eval:
                scored.unlink()

    def checkpoint_dir(self, step: int) -> Path:
        return self.path / CHECKPOINTS / f"step_{step:07d}"

    def staging_dir(self, step: int) -> Path:
        """Where checkpoint ``step`` is written before it is renamed into place (the same on every process)."""
        return self.path / CHECKPOINTS / f".step_{step:07d}.partial"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (a step_N folder with its state.json), oldest first."""
        folder = self.path / CHECKPOINTS
        if not folder.is_dir():
            return []
        done = [p for p in folder.iterdir()
                if _CHECKPOINT_NAME.match(p.name) and p.is_dir() and (p / CHECKPOINT_STATE).is_file()]
        return sorted(done, key=lambda p: int(p.name.split("_")[-1]))

    def latest_checkpoint(self) -> Path | None:
        found = [p for p in self.checkpoints() if p not in self.damaged]
        return found[-1] if found else None

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint to resume from: the one named, or the newest intact one (a damaged newer one is
        reported in one line and skipped, not deleted); None when the run has none yet. A run whose checkpoints are
        all damaged is refused in one line (starting it again from step 0 would replace what it trained)."""
        if not self.resume:
            return None
        if self._chosen is not _UNCHOSEN:
            return self._chosen
        if self.resume != "latest":
            named = Path(self.resume)
            if problem := checkpoint_problem(named):
                raise RunFolderError(f"--resume {self.resume}: checkpoint is damaged: {problem}; resume from another "
                                     "checkpoint of the run (--resume latest takes the newest intact one)")
            self._chosen = named
            return named
        found = self.checkpoints()
        for candidate in reversed(found):
            problem = checkpoint_problem(candidate)
            if problem is None:
                self._chosen = candidate
                return candidate
            self.damaged[candidate] = problem
            print(f"[run] checkpoint {candidate} is damaged ({problem}); trying the one before it", flush=True)
        if found:
            raise RunFolderError(
                f"--resume latest: every checkpoint in {self.path / CHECKPOINTS} is damaged (the newest, {found[-1].name}: "
                f"{self.damaged[found[-1]]}); nothing was changed. Put a checkpoint's files back (its state.json lists "
                "their sizes and hashes) and run the command again, or start the run afresh with --overwrite true "
                "(the damaged checkpoints are set aside and deleted once the new run writes its first)")
        self._chosen = None
        return None

    def prune_checkpoints(self, keep: int) -> None:
        """Delete all but the newest ``keep`` intact checkpoints (a damaged one never counts among them)."""
        if keep <= 0:
            return
        for old in [p for p in self.checkpoints() if p not in self.damaged][:-keep]:
            shutil.rmtree(old, ignore_errors=True)


_STAGED_NAME = re.compile(r"^\..+\.(tmp|partial)$")  # atomic_path / atomic_folder / checkpoint staging
_REPLACED_NAME = re.compile(r"^\.(.+)\.replaced$")  # publish_folder: the old folder while the new one moves in


def clean_interrupted_writes(path: Path) -> None:
    """Remove what writes killed midway left in a run folder (temporary files, staged folders; the
    finished files beside them were never touched), and put back a folder whose replacement was
    interrupted between its two renames."""
    for leftover in sorted(path.rglob(".*"), key=lambda p: len(p.parts)):
        if SET_ASIDE in leftover.relative_to(path).parts or not leftover.exists():
            continue
        if replaced := _REPLACED_NAME.match(leftover.name):
            original = leftover.with_name(replaced.group(1))
            if original.exists():
                _remove(leftover)
            else:
                os.replace(leftover, original)
        elif _STAGED_NAME.match(leftover.name):
            _remove(leftover)


def recover_set_aside_run(path: Path) -> None:
    """An --overwrite start that was interrupted (killed before its first checkpoint) left the old run
    set aside: give it back (the interrupted run's outputs go). If the new run got as far as a checkpoint
    or its final weights, it stands and the old run is deleted, as it would have been."""
    aside = path / SET_ASIDE
    if not aside.is_dir() or path.resolve() in _SET_ASIDE_HERE:
        return
    new_run = RunFolder.__new__(RunFolder)
    new_run.path, new_run.damaged = path, {}
    if new_run.checkpoints():
        print(f"[run] {path}: an earlier --overwrite run had written its checkpoint; the old run it had set "
              "aside is now deleted", flush=True)
        shutil.rmtree(aside)
        return
    restore_set_aside_run(path)
    print(f"[run] {path}: an earlier --overwrite run stopped before its first checkpoint; the old run it had "
          "set aside is back in place", flush=True)


def restore_set_aside_run(path: Path) -> None:
    """Put the outputs in <path>/.overwritten_run back where they were, byte for byte (renames), and remove
    what the new run had written in their place."""
    aside = path / SET_ASIDE
    listing = aside / _SET_ASIDE_LIST
    if listing.is_file():
        moved = set(json.loads(listing.read_text()))
        for name in RUN_OUTPUTS:
            old, current = aside / name, path / name
            if old.exists() or name not in moved:  # else it was never moved: ``current`` is the old one
                _remove(current)
            if old.exists():
                os.replace(old, current)
        listing.unlink()
    shutil.rmtree(aside)
    _SET_ASIDE_HERE.discard(path.resolve())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class RunStopped(RuntimeError):
    """A run stopped on a bad value (a NaN loss, a failed judge): the trainers' TrainingStopped. Before the run's first
    checkpoint, what the start wrote is removed as for a bad input, so the command runs again as typed."""


# What a run that never reached its first checkpoint leaves behind when it stops on a bad input: the judge's
# answers (paid for; a cache keyed by the question, so a corrected command asks nothing twice).
_KEPT_AFTER_BAD_START = (JUDGE_ANSWERS,)


def undo_failed_start(run: RunFolder) -> None:
    """A run stopped by a bad input before its first checkpoint: remove what it wrote where nothing was (config,
    metrics, feedback, latents, ...), and the folder itself if it made it and nothing else is left, so the corrected
    command is not refused with 'already holds a run'. An old run set aside by --overwrite is put back first."""
    if run.checkpoints():
        return
    for name in sorted(run.created - set(_KEPT_AFTER_BAD_START)):
        _remove(run.path / name)
    if run.made_folder and run.path.is_dir():
        leftovers = [p for p in run.path.iterdir() if p.name != LOCK_FILE]
        if all(p.name in _KEPT_AFTER_BAD_START and not any(p.iterdir()) for p in leftovers if p.is_dir()) and \
                not any(p.is_file() for p in leftovers):
            shutil.rmtree(run.path, ignore_errors=True)


def restores_old_run_on_failure(train, bad_input: tuple[type[BaseException], ...] = (ValueError,)):
    """Decorate a trainer's ``train(config)``: if it fails after --overwrite set the old run aside and before
    the new run's first checkpoint, the old run is put back byte for byte before the error goes on; if it fails on
    a bad input (``bad_input``: ConfigError, DataError, ... are ValueErrors) before that checkpoint, what it wrote
    is removed (undo_failed_start); so is what a run stopped on a bad value (RunStopped) wrote before that checkpoint.
    The folder's lock is let go however it ends."""

    @functools.wraps(train)
    def guarded(config, *args, **kwargs):
        path = Path(config.output_dir)
        try:
            return train(config, *args, **kwargs)
        except BaseException as err:
            run = _OPEN_RUNS.get(path.resolve())
            if path.resolve() in _SET_ASIDE_HERE and (path / SET_ASIDE).is_dir():
                restore_set_aside_run(path)
                print(f"[run] the run did not start; the old run in {path} is back in place", flush=True)
            elif run is not None and isinstance(err, (*bad_input, RunStopped)):
                undo_failed_start(run)
            raise
        finally:
            _OPEN_RUNS.pop(path.resolve(), None)
            release_run_lock(path)

    return guarded


def _plain(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value

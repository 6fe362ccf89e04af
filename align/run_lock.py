"""One run writes into a folder at a time: ``<run>/.run.lock``.

The main process of a run holds the lock file open with an exclusive ``flock`` for as long as it lives, and the file
names it: pid, host, the pid's start time, its command line, its rank and distributed group, its launcher. Whether a
lock is held is asked of the kernel (a shared ``flock`` that fails while the holder lives), never concluded from what
the file says: a lock whose holder died (kill -9, a crash, a reboot), a file copied from another folder, edited by
hand or torn, is held by nobody and is taken over, in one printed line. A lock the kernel says is held, but by a
process that is not the run it names (the pid gone, or running another command), is refused with the way out (find
the holder with ``fuser -v``). A lock from another host cannot be asked about (not every shared filesystem carries
locks between machines): it is honoured, and the refusal names the file to delete if that run is gone.

The processes of one launch share the folder when they are one process group of the run: the same distributed
rendezvous (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, TORCHELASTIC_RUN_ID, which only one live launch can hold) and
another rank than the holder's. Where ``flock`` is not supported the lock falls back to the pid, start time and
command line it names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path

from rewards.secrets import scrub_text

LOCK_FILE = ".run.lock"
_GROUP_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
# Locks this process holds: resolved folder -> the open, flocked file descriptor of its lock file.
_HELD: dict[Path, int] = {}


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked (align.run_folder re-exports it)."""


# ------------------------------------------------------------------------------------------- who we are


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux /proc), so a pid reused after the holder
    died is not mistaken for it; None where /proc is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_command(pid: int) -> str | None:
    """The command line of process ``pid`` (Linux /proc), secrets masked and cut to 300 characters; None where it
    cannot be read (gone, /proc absent)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        if pid != os.getpid():
            return None
        raw = "\0".join([sys.executable, *sys.argv]).encode()
    words = [w.decode("utf-8", "replace") for w in raw.rstrip(b"\0").split(b"\0")]
    text = scrub_text(shlex.join(words))  # shown in one line: newlines, escapes and bidi controls escaped
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)[:300]


def _launcher() -> int | None:
    """The pid of the launcher this process belongs to (accelerate launch / torchrun set RANK); None alone."""
    return os.getppid() if "RANK" in os.environ or "LOCAL_RANK" in os.environ else None


def _group() -> str | None:
    """The distributed group this process is a rank of (its launch's rendezvous), or None outside a launch."""
    if "RANK" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return "|".join(os.environ.get(name, "") for name in _GROUP_VARIABLES)


def _me() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "start": process_start(pid), "command": process_command(pid),
            "rank": os.environ.get("RANK"), "group": _group(), "launcher": _launcher(), "time": time.time()}


def _ours(holder: dict) -> bool:
    """The lock is this process's, or another rank's of this process's launch (one distributed group)."""
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        return True
    group = _group()
    return group is not None and holder.get("group") == group and holder.get("rank") != os.environ.get("RANK")


# ------------------------------------------------------------------------------------------- reading a lock


def _read_lock(path: Path) -> dict | None:
    """The lock's record; None without a lock file, {} for one that cannot be read (torn, edited, not ours)."""
    try:
        holder = json.loads((path / LOCK_FILE).read_text())
        int(holder["pid"])
        return holder
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _held(path: Path) -> bool | None:
    """Whether a live process holds the lock file (the kernel's flock); None where flock cannot tell."""
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return True
        return None  # ENOLCK, EOPNOTSUPP, EINVAL: this filesystem carries no flock
    finally:
        os.close(fd)  # closing lets go of a shared lock taken here
    return False


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    return start is None or process_start(pid) in (None, start)


def _names_its_holder(holder: dict) -> bool:
    """Whether the process the lock names is alive and is running the command the lock recorded."""
    if not holder or holder.get("host") != socket.gethostname():
        return False
    pid = int(holder["pid"])
    if not _alive(pid, holder.get("start")):
        return False
    now = process_command(pid)
    return holder.get("command") is not None and now in (None, holder["command"])


def live_lock_holder(path: str | Path) -> dict | None:
    """The lock of another run still writing into ``path``, or None: no lock, our own (or our launch's), or one held
    by nobody. A held lock whose record does not name its holder comes back with ``"impostor": True``."""
    path = Path(path)
    holder = _read_lock(path)
    if holder is None or (holder and _ours(holder)):
        return None
    if holder and holder.get("host") != socket.gethostname():
        return holder  # another machine's: the kernel here cannot say; honoured (the refusal names the file)
    held = _held(path)
    if held is None:  # no flock here: the record alone, checked against the process it names
        return holder if _names_its_holder(holder) else None
    if not held:
        return None
    return holder if _names_its_holder(holder) else {**holder, "impostor": True}


def check_not_locked(path: str | Path) -> None:
    """One line, with the way out, when another run is writing into ``path``."""
    holder = live_lock_holder(path)
    if holder is None:
        return
    lock = Path(path) / LOCK_FILE
    if holder.get("impostor"):
        named = f"pid {holder['pid']}" if holder.get("pid") is not None else "no readable process"
        raise RunFolderError(
            f"output folder {path} is locked by a live process that is not the run its lock names ({named}); find it "
            f"with `fuser -v {lock}` and stop it if no run of yours is writing there, or choose another --output_dir")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
    command = f", `{holder['command']}`" if holder.get("command") else ""
    if holder.get("host") != socket.gethostname():
        raise RunFolderError(
            f"output folder {path} is in use by a run on another machine (pid {holder['pid']} on {holder.get('host')}"
            f"{command}, started {since}); wait for it to end or choose another --output_dir (if that run is gone, "
            f"delete {lock})")
    raise RunFolderError(
        f"output folder {path} is in use by a run that is still going (pid {holder['pid']} on {holder.get('host')}"
        f"{command}, started {since}); wait for it to end (or stop it: kill {holder['pid']}) or choose another "
        "--output_dir")


# ------------------------------------------------------------------------------------------- taking a lock


def acquire_run_lock(path: Path) -> None:
    """Take <path>/.run.lock for this process (refused while another run holds it; one held by nobody is taken
    over, in one printed line). The record is written whole and flocked before it is linked into place: the link
    fails if a lock is there (two starts cannot both take it), and the lock is held from the moment it is seen."""
    path.mkdir(parents=True, exist_ok=True)
    key = path.resolve()
    if key in _HELD:
        return
    for _ in range(3):
        check_not_locked(path)
        holder = _read_lock(path)
        if holder and _ours(holder) and holder.get("pid") != os.getpid():
            return  # another rank of this launch holds it for the run
        old = _take_over(path, holder) if holder is not None else None
        fd, tmp = tempfile.mkstemp(dir=path, prefix=f"{LOCK_FILE}.", suffix=".tmp")
        try:
            os.write(fd, json.dumps(_me()).encode())
            os.fsync(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.link(tmp, path / LOCK_FILE)
        except FileExistsError:
            os.close(fd)
            continue  # another start took it between our look and our link: look again
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            os.link(tmp, path / LOCK_FILE)  # no flock on this filesystem: the record alone
        finally:
            os.unlink(tmp)
            if old is not None:
                os.close(old)
        _HELD[key] = fd
        return
    check_not_locked(path)


def _take_over(path: Path, holder: dict) -> int | None:
    """Remove a lock held by nobody (check_not_locked has said so), holding it meanwhile so that no other start
    takes it at the same moment; says in one line whose lock it was. Returns the descriptor to close once ours is
    in place."""
    fd = None
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return None
    except BlockingIOError:
        os.close(fd)
        raise RunFolderError(f"output folder {path} was just locked by another start; wait for it to end or choose "
                           "another --output_dir") from None
    except OSError:
        pass  # no flock here: live_lock_holder went by the record
    if holder:
        command = f", `{holder['command']}`" if holder.get("command") else ""
        print(f"[run] {path}: its lock named pid {holder['pid']} on {holder.get('host')}{command}, which holds it no "
              "longer (a run that ended without letting go, or a lock copied or edited); taken over", flush=True)
    else:
        print(f"[run] {path}: its lock could not be read and nobody holds it; taken over", flush=True)
    (path / LOCK_FILE).unlink(missing_ok=True)
    return fd


def release_run_lock(path: str | Path) -> None:
    """Let go of <path>/.run.lock if this process holds it (the file removed first, then the flock)."""
    path = Path(path)
    fd = _HELD.pop(path.resolve(), None)
    holder = _read_lock(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        (path / LOCK_FILE).unlink(missing_ok=True)
    if fd is not None:
        os.close(fd)


__all__ = ["LOCK_FILE", "RunFolderError", "acquire_run_lock", "check_not_locked", "live_lock_holder", "process_command",
           "process_start", "release_run_lock"]

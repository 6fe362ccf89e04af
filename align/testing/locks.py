"""A run lock held by another live process, for the tests of the lock (align/run_lock.py): a child Python process
takes the folder's lock as a run's main process does and keeps it until it is killed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_HOLD = """
import sys, time
from pathlib import Path
from align.run_lock import acquire_run_lock
acquire_run_lock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold_run_lock(folder: str | Path, seconds: float = 600) -> subprocess.Popen:
    """Start a process holding ``folder``'s lock; returns once it holds it. Kill it (``.kill()``) to leave the
    lock file behind as a killed run does."""
    child = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder), str(seconds)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    if line.strip() != "locked":
        child.kill()
        raise RuntimeError(f"the lock holder did not start: {child.stderr.read()[-2000:]}")
    return child

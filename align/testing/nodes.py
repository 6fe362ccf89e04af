"""Run a trainer as N "machines" on this computer: N `accelerate launch` commands started at once, one per machine
rank, meeting at 127.0.0.1, each running its share of the processes on the CPU with gloo (as two_processes.py does
for one machine)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from align.testing.two_processes import ROOT, accelerate_launch_command, cpu_launch_env, free_port


def launch_cpu_nodes(script: str, argv: list[str], num_machines: int = 2, processes_per_machine: int = 1,
                     timeout: float = 600, launcher_args: tuple[str, ...] = ()) -> list[subprocess.CompletedProcess]:
    """Start every machine's launch at once and wait for all; one result per machine rank, in rank order.

    A machine that fails leaves the others waiting for it in a collective: they are killed then (each launch with
    its workers), and so is everything at ``timeout`` (their return code is then -SIGKILL), so a broken run cannot
    hang the caller.
    """
    port = free_port()
    env = cpu_launch_env()
    with tempfile.TemporaryDirectory() as logs:
        outputs = [(Path(logs) / f"node{r}.out", Path(logs) / f"node{r}.err") for r in range(num_machines)]
        commands = [accelerate_launch_command(script, argv, num_machines * processes_per_machine, port, launcher_args,
                                              num_machines, machine_rank=r) for r in range(num_machines)]
        launches = []
        for command, (out, err) in zip(commands, outputs):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                launches.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=stdout, stderr=stderr))
        try:
            wait_for_all_or_first_failure(launches, time.monotonic() + timeout)
        finally:
            for launch in launches:
                if launch.poll() is None:
                    kill_with_its_workers(launch)
        return [subprocess.CompletedProcess(command, launch.returncode, out.read_text(), err.read_text())
                for command, launch, (out, err) in zip(commands, launches, outputs)]


def wait_for_all_or_first_failure(launches: list[subprocess.Popen], deadline: float) -> None:
    """Returns when every launch has exited, or one has failed, or the deadline has passed."""
    while time.monotonic() < deadline:
        codes = [launch.poll() for launch in launches]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return
        time.sleep(0.2)


def kill_with_its_workers(launch: subprocess.Popen) -> None:
    """torchrun starts each worker in a session of its own, so killing the launch's process group would leave them
    running: kill every descendant, then the launch."""
    try:
        workers = psutil.Process(launch.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    launch.kill()
    launch.wait()
    psutil.wait_procs(workers, timeout=30)

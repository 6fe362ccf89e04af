"""Run a trainer as two CPU processes with gloo DDP, the way `accelerate launch` starts them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: align/testing/ -> the repository root


def cpu_launch_env() -> dict[str, str]:
    """This process's environment for a CPU launch of the checkout: offline, one thread a process, gloo on the CPU."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "true"}


def free_port() -> int:
    """A port free now: another launch may hold accelerate's default 29500."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


FSDP2 = ("--use_fsdp", "--fsdp_version", "2")  # accelerate launch's flags for FSDP2 (align/train/sharding.py)


def accelerate_launch_command(script: str, argv: list[str], num_processes: int, port: int,
                              launcher_args: tuple[str, ...] = (), num_machines: int = 1,
                              machine_rank: int = 0) -> list[str]:
    """``accelerate launch --multi_gpu --num_processes N <script> <argv>`` (``launcher_args=FSDP2``: sharded instead;
    accelerate takes one of --multi_gpu and --use_fsdp), as machine ``machine_rank`` of ``num_machines`` meeting at
    127.0.0.1. With ACCELERATE_USE_CPU (``cpu_launch_env``) the processes run on the CPU over gloo; accelerate's
    --cpu flag would run one process."""
    machines = ["--num_machines", str(num_machines)]
    if num_machines > 1:
        machines += ["--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1"]
    return [sys.executable, "-m", "accelerate.commands.launch", *(launcher_args or ["--multi_gpu"]),
            "--num_processes", str(num_processes), *machines, "--main_process_port", str(port),
            "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / script), *argv]


def two_cpu_processes_command(script: str, argv: list[str], launcher_args: tuple[str, ...] = (),
                               num_processes: int = 2) -> tuple[list[str], dict[str, str]]:
    """(the command, its environment) of a launch of two (or ``num_processes``) CPU processes on this machine."""
    return accelerate_launch_command(script, argv, num_processes, free_port(), launcher_args), cpu_launch_env()


def launch_two_cpu_processes(script: str, argv: list[str], timeout: int = 600, launcher_args: tuple[str, ...] = (),
                             num_processes: int = 2) -> subprocess.CompletedProcess:
    """Run ``two_cpu_processes_command`` from the repository root to its end (``num_processes``: 2 unless said)."""
    cmd, env = two_cpu_processes_command(script, argv, launcher_args, num_processes)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)

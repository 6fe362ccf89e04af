"""Run a trainer as two CPU processes with gloo DDP, the way `accelerate launch` starts them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: align/testing/ -> the repository root


def launch_two_cpu_processes(script: str, argv: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu --num_processes 2 <script> <argv>`` on the CPU, from the repository root.

    accelerate's --cpu flag runs one process; --multi_gpu + ACCELERATE_USE_CPU give two with gloo DDP.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "true"}
    with socket.socket() as sock:  # a free port: another two-process run may hold accelerate's default 29500
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / script), *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)

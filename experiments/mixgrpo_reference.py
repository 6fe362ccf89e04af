"""Reference values for MixGRPO (align/sampling/mix_sampler.py, --sampler mix), computed by the authors' own code.

    python -m experiments.mixgrpo_reference [--mirror DIR] [--out tests/data]

DIR is a fetched mirror of Tencent-Hunyuan/MixGRPO (a bare git directory; default
/work/.mirror/Tencent-Hunyuan+MixGRPO/repo). Two files @ e5cdd6a (2025-08-08), sha256 checked, executed whole (their
imports are torch, numpy, diffusers, tqdm and the standard library):
  - fastvideo/utils/grpo_states.py: ``GRPOTrainingStates`` run as their train_grpo_flux.py runs it (``training_strategy
    = "part"``: ``max_timesteps = sampling_steps - 2``, ``get_current_timesteps()`` then ``update_iteration()`` once per
    iteration), with their script's settings (25 steps, window 4, progressive, overlap step 1, 25 iterations a position,
    roll back) for 350 iterations, and with small ones that reach the roll-back (10 steps).
  - fastvideo/utils/sampling_utils.py: the step functions, ``flow_grpo_step`` (the SDE their script samples the window
    with, ``--flow_grpo_sampling``; ``determistic=True`` is their ODE step) and ``dance_grpo_step`` (``sde_solver`` True
    inside the window, False outside), each drawing the next latents (``prev_sample=None``; flow_grpo_step from a seeded
    generator, dance_grpo_step from torch's global RNG, seeded) and re-scoring them under a perturbed velocity, on
    float32 tensors on a shift-3 schedule of 25 steps built with their ``sd3_time_shift``.

Writes mixgrpo_reference.json into --out (tests/test_mixgrpo_reference.py reads it). Side environment: this project's
Python (torch 2.13.0+cpu, diffusers 0.42.1, numpy 2.4.6).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from experiments.authors_source import execute, floats, git_file

MIRROR = Path("/work/.mirror/Tencent-Hunyuan+MixGRPO/repo")
COMMIT = "e5cdd6a427778d8c8b2e7a48ce16972141adbe7c"
FILES = {"grpo_states": ("fastvideo/utils/grpo_states.py",
                         "c95109e474125f097d80f1bf968e51017907ce714bc3e9dbe5bbe5eafacf7950"),
         "sampling_utils": ("fastvideo/utils/sampling_utils.py",
                            "aceb827ef1e70a84e566821c3e026b7325ac76b6647caa94b5b04bfbe027a91a")}
SCHEDULES = (  # (name, sampling steps, window (group_size), iterations a position, overlap step, iterations)
    ("authors-25-steps", 25, 4, 25, 1, 350),
    ("ten-steps-window2", 10, 2, 3, 1, 60),
    ("ten-steps-window3-stride2", 10, 3, 2, 2, 40),
)
LATENT = (1, 3, 4, 4)
STEP_INDICES = [0, 1, 5, 12, 22]  # σ = 1 included; the authors' windows end before step 23 of 25


def window_schedule(states_cls, steps: int, size: int, per_position: int, stride: int, iterations: int) -> dict:
    states = states_cls(iters_per_group=per_position, group_size=size, max_timesteps=steps - 2, cur_timestep=0,
                        cur_iter_in_group=0, sample_strategy="progressive", prog_overlap=True, prog_overlap_step=stride,
                        max_iters_per_group=10, min_iters_per_group=1, roll_back=True)
    windows = []
    for _ in range(iterations):
        windows.append(states.get_current_timesteps())
        states.update_iteration()
    return {"steps": steps, "size": size, "per_position": per_position, "stride": stride, "windows": windows}


def step_rows(fns: dict, sigmas: torch.Tensor, eta: float, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for index in STEP_INDICES:
        latents = torch.randn(LATENT, generator=g)
        velocity = torch.randn(LATENT, generator=g)
        velocity_2 = velocity + 0.05 * torch.randn(LATENT, generator=g)
        row = {"index": index, "latents": floats(latents), "velocity": floats(velocity), "velocity_2": floats(velocity_2)}
        prev, _, log_prob, mean, std = fns["flow_grpo_step"](velocity, latents, eta, sigmas, index, None,
                                                             generator=torch.Generator().manual_seed(seed + index))
        _, _, log_prob_2, mean_2, _ = fns["flow_grpo_step"](velocity_2, latents, eta, sigmas, index, prev)
        ode, _, _, _, _ = fns["flow_grpo_step"](velocity, latents, eta, sigmas, index, None, determistic=True)
        row["flow_grpo"] = {"prev_sample": floats(prev), "log_prob": floats(log_prob), "mean": floats(mean),
                            "std": floats(std), "log_prob_2": floats(log_prob_2), "mean_2": floats(mean_2),
                            "ode": floats(ode)}
        torch.manual_seed(seed + index)
        prev, _, log_prob = fns["dance_grpo_step"](velocity, latents, eta, sigmas, index, None, grpo=True, sde_solver=True)
        _, _, log_prob_2 = fns["dance_grpo_step"](velocity_2, latents, eta, sigmas, index, prev, grpo=True, sde_solver=True)
        ode, _, _ = fns["dance_grpo_step"](velocity, latents, eta, sigmas, index, None, grpo=True, sde_solver=False)
        row["dance"] = {"prev_sample": floats(prev), "log_prob": floats(log_prob), "log_prob_2": floats(log_prob_2),
                        "ode": floats(ode)}
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mirror", type=Path, default=MIRROR)
    p.add_argument("--out", type=Path, default=Path("tests/data"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sources = {name: git_file(args.mirror, COMMIT, path, digest) for name, (path, digest) in FILES.items()}
    states_cls = execute(sources["grpo_states"], "grpo_states")["GRPOTrainingStates"]
    fns = execute(sources["sampling_utils"], "sampling_utils")
    sigmas = fns["sd3_time_shift"](3.0, torch.linspace(1, 0, 26))
    reference = {
        "authors": {"repository": "Tencent-Hunyuan/MixGRPO", "commit": COMMIT, "files": [p for p, _ in FILES.values()]},
        "schedules": {name: window_schedule(states_cls, *rest) for name, *rest in SCHEDULES},
        "sigmas": floats(sigmas), "eta": 0.7, "steps": step_rows(fns, sigmas, 0.7, 7),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "mixgrpo_reference.json"
    path.write_text(json.dumps(reference) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

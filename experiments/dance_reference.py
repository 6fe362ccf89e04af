"""Reference values for Dance-SDE (align/sampling/flow.py ``dance_step``, --sampler dance), computed by DanceGRPO's own
step function on seeded tensors.

    python -m experiments.dance_reference [--mirror DIR] [--out tests/data]

DIR is a fetched mirror of XueZeyue/DanceGRPO (a bare git directory; default /work/.mirror/XueZeyue+DanceGRPO/repo).
The script reads fastvideo/train_grpo_flux.py @ 15cc71d (2025-10-16, sha256 checked), takes two of its top-level
functions by name and runs them as written (the file itself imports the authors' whole package and cannot be
imported here):
  - ``sd3_time_shift``: their σ schedule, shift(linspace(1, 0, N + 1)) with shift 3 (their FLUX scripts);
  - ``flux_step``: the Dance-SDE step, with ``grpo=False`` (it returns the step's mean and x̂0) and with ``grpo=True,
    sde_solver=True`` (it draws the next latents from torch's global RNG, seeded here, and returns their
    log-probability), then scoring those latents under a perturbed velocity (``prev_sample=...``, what their training
    step does).
Inputs are float32, on CPU, as their step computes (it casts the latents to float32). Steps of the 16-step FLUX schedule
(the first, σ = 1, and the last, σ_next = 0, included) and of a 10-step one, η 0.3 (their FLUX recipe) and 0.7.

Writes dance_reference.json into --out (tests/test_dance_reference.py reads it). Side environment: this project's
Python (torch 2.13.0+cpu).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from experiments.authors_source import execute, floats, function_source, git_file

MIRROR = Path("/work/.mirror/XueZeyue+DanceGRPO/repo")
COMMIT = "15cc71d53cc2e6e18a68ee607d5fb6ba9a99e344"
SCRIPT = "fastvideo/train_grpo_flux.py"
SHA256 = "1b9ba86bf9ad6b384c996cd9fad0244bbc19b7c0a3fe0ac33793545bf2f9a91b"
LATENT_SHAPE = (1, 3, 4, 4)  # one sample per call, as their sampler (batch_size = 1)
CASES = (  # (name, steps N, shift, eta, step indices, seed)
    ("flux16-eta0.3", 16, 3.0, 0.3, [0, 1, 5, 10, 14, 15], 1),
    ("flux12-eta0.3", 12, 3.0, 0.3, [0, 3, 6, 10, 11], 2),
    ("ten-eta0.7", 10, 1.0, 0.7, [0, 2, 8, 9], 3),
)


def authors_functions(mirror: Path) -> dict:
    source = git_file(mirror, COMMIT, SCRIPT, SHA256)
    namespace = execute(function_source(source, "sd3_time_shift"), "sd3_time_shift")
    return execute(function_source(source, "flux_step"), "flux_step", {"math": math, "torch": torch, **namespace})


def step_case(fns: dict, name: str, num_steps: int, shift: float, eta: float, steps: list[int], seed: int) -> dict:
    sigmas = fns["sd3_time_shift"](shift, torch.linspace(1, 0, num_steps + 1))
    g = torch.Generator().manual_seed(seed)
    rows = []
    for index in steps:
        latents = torch.randn(LATENT_SHAPE, generator=g)
        velocity = torch.randn(LATENT_SHAPE, generator=g)
        velocity_2 = velocity + 0.05 * torch.randn(LATENT_SHAPE, generator=g)
        mean, x0 = fns["flux_step"](velocity, latents, eta, sigmas, index, None, grpo=False, sde_solver=True)
        torch.manual_seed(1000 * seed + index)  # their draw: torch.randn_like from the global RNG
        prev, _, log_prob = fns["flux_step"](velocity, latents, eta, sigmas, index, None, grpo=True, sde_solver=True)
        _, _, log_prob_2 = fns["flux_step"](velocity_2, latents, eta, sigmas, index, prev, grpo=True, sde_solver=True)
        rows.append({"index": index, "latents": floats(latents), "velocity": floats(velocity),
                     "velocity_2": floats(velocity_2), "mean": floats(mean), "pred_original": floats(x0),
                     "prev_sample": floats(prev), "log_prob": floats(log_prob), "log_prob_2": floats(log_prob_2),
                     "std_dev_t": eta * math.sqrt(sigmas[index] - sigmas[index + 1])})
    return {"name": name, "num_steps": num_steps, "shift": shift, "eta": eta, "sigmas": floats(sigmas), "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mirror", type=Path, default=MIRROR)
    p.add_argument("--out", type=Path, default=Path("tests/data"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    fns = authors_functions(args.mirror)
    reference = {"authors": {"repository": "XueZeyue/DanceGRPO", "path": SCRIPT, "commit": COMMIT},
                 "cases": [step_case(fns, *case) for case in CASES]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "dance_reference.json"
    path.write_text(json.dumps(reference) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

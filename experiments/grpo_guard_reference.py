"""Reference values for GRPO-Guard (align/train/objectives/grpo_guard.py), computed by the two public implementations
(the paper's authors published no code): verl-omni's ``GRPOGuardLoss.compute_loss`` and Flow-Factory's GRPO-Guard
training block.

    python -m experiments.grpo_guard_reference [--verl-omni DIR] [--flow-factory DIR] [--out tests/data]

DIRs are fetched mirrors (bare git directories; defaults under /work/.mirror/). Read at run time, sha256 checked:
  - verl-project/verl-omni @ a1139ba, verl_omni/trainer/diffusion/diffusion_algos.py: the method
    ``GRPOGuardLoss.compute_loss`` (taken by name, run as written; the file imports verl, which is not installed, so
    the method alone is executed with ``torch`` and its type names bound), with a config namespace holding
    ``diffusion_loss.clip_ratio`` and ``diffusion_loss.adv_clip_max``. Its micro-batch is one step of the chain: every
    row here shares the step (its std and √dt are averaged over the batch there).
  - X-GenGroup/Flow-Factory @ a0b2bc5, src/flow_factory/trainers/grpo.py: the lines of ``GRPOGuardTrainer.optimize``
    from "# 3. Compute loss" to the ``policy_loss = ...`` line, executed with ``output``, ``batch``, ``old_log_prob``,
    ``self.training_args`` bound as their trainer binds them. Their ``std_dev_t`` and ``dt`` are [B, 1, 1] while the
    log-probabilities are [B]: ``(log_prob - old_log_prob) * scale_factor`` broadcasts to [B, 1, B] and mixes the rows
    of a micro-batch when B > 1 (their default per_device_batch_size is 1 for this reason or by chance); the block is
    run here one row at a time, B = 1, where it computes what it means to.
The inputs: a Flow-GRPO SDE step (shift-3 10-step schedule, noise level 0.7; s = 0.7·√(σ/(1-σ)), the authors' σ_max
at σ = 1), the sampling policy's mean, x = mean_old + s·√Δσ·z, the current mean a leaf (requires grad) off by offsets
that put the normalised ratios on both sides of the clip range, log-probabilities the Gaussian's of x averaged over
the elements; advantages with two beyond the clip at 5. The loss is back-propagated to the current mean and both
log-probability paths (the current log-probability is a function of that mean, as in the trainer).

Writes grpo_guard_reference.json into --out (tests/test_grpo_guard_reference.py reads it). Side environment: this
project's Python (torch 2.13.0+cpu).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from experiments.authors_source import execute, floats, function_source, git_file, lines_between

VERL = Path("/work/.mirror/verl-project+verl-omni/repo")
VERL_COMMIT = "a1139bafffb5b9711f0a6b6edff8ecaa60bfff30"
VERL_FILE = "verl_omni/trainer/diffusion/diffusion_algos.py"
VERL_SHA256 = "d6db8d516373714214d24bb6abbcc41e57b7c2f069db5e38cbedc87e2cbf923e"
FF = Path("/work/.mirror/X-GenGroup+Flow-Factory/repo")
FF_COMMIT = "a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c"
FF_FILE = "src/flow_factory/trainers/grpo.py"
FF_SHA256 = "cfdcde0cb8aa9c359ffc63ed92f018d5a0000c28982372fbc9074c7d27908283"
LATENT = (3, 4, 4)
ADVANTAGES = [1.2, -0.8, 6.0, -7.5, 0.4, -1.9]
CASES = (  # (name, step index of the 10-step schedule, noise level, clip range, offset scale of the current mean, seed)
    ("first-step-clip2e-6", 0, 0.7, 2e-6, 1.5e-5, 1),
    ("middle-step-clip1e-4", 4, 0.7, 1e-4, 1e-3, 2),
    ("late-step-clip1e-4", 8, 0.7, 1e-4, 3e-3, 3),
    ("middle-step-clip2e-6-far", 5, 1.2, 2e-6, 1e-2, 4),
)


def schedule(num_steps: int = 10, shift: float = 3.0) -> torch.Tensor:
    """SD3's shifted schedule (FlowMatchEulerDiscreteScheduler, shift 3): σ = shift·t / (1 + (shift - 1)·t)."""
    t = torch.linspace(1.0, 1.0 / num_steps, num_steps)
    return torch.cat([shift * t / (1 + (shift - 1) * t), torch.zeros(1)])


def gaussian_log_prob(x, mean, std):
    log_density = -((x.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return log_density.mean(dim=tuple(range(1, log_density.ndim)))


def inputs(index: int, noise_level: float, offset: float, seed: int) -> dict:
    sigmas = schedule()
    sigma, sigma_next = sigmas[index], sigmas[index + 1]
    denominator = 1 - (sigmas[1] if sigma == 1 else sigma)
    std_dev_t = noise_level * torch.sqrt(sigma / denominator)
    sqrt_dt = torch.sqrt(sigma - sigma_next)
    g = torch.Generator().manual_seed(seed)
    rows = len(ADVANTAGES)
    old_mean = torch.randn(rows, *LATENT, generator=g)
    x = old_mean + std_dev_t * sqrt_dt * torch.randn(rows, *LATENT, generator=g)
    mean = old_mean + offset * torch.randn(rows, *LATENT, generator=g)
    return {"sigma": float(sigma), "sigma_next": float(sigma_next), "std_dev_t": float(std_dev_t),
            "sqrt_dt": float(sqrt_dt), "old_mean": old_mean, "x": x, "mean": mean,
            "advantages": torch.tensor(ADVANTAGES, dtype=torch.float32)}


def verl_case(compute_loss, data: dict, clip: float) -> dict:
    std_dev_t = torch.full((len(ADVANTAGES), 1, 1, 1), data["std_dev_t"])
    sqrt_dt = torch.full((len(ADVANTAGES),), data["sqrt_dt"])
    mean = data["mean"].clone().requires_grad_(True)
    std = std_dev_t * sqrt_dt.view(-1, 1, 1, 1)
    log_prob = gaussian_log_prob(data["x"], mean, std)
    old_log_prob = gaussian_log_prob(data["x"], data["old_mean"], std)
    config = SimpleNamespace(diffusion_loss=SimpleNamespace(clip_ratio=clip, adv_clip_max=5.0))
    loss, metrics = compute_loss(None, old_log_prob=old_log_prob, log_prob=log_prob, advantages=data["advantages"],
                                 config=config, old_prev_sample_mean=data["old_mean"], prev_sample_mean=mean,
                                 std_dev_t=std_dev_t, sqrt_dt=sqrt_dt)
    loss.backward()
    return {"loss": float(loss.detach()), "grad_mean": floats(mean.grad), "log_prob": floats(log_prob.detach()),
            "old_log_prob": floats(old_log_prob), "clipfrac": metrics["actor/pg_clipfrac"],
            "ratio_mean": metrics["actor/ratio_mean"]}


def flow_factory_rows(block, data: dict, clip: float) -> dict:
    """Their block one row at a time (B = 1); the mean of the rows' losses and the gradient of that mean."""
    mean = data["mean"].clone().requires_grad_(True)
    losses = []
    for r in range(len(ADVANTAGES)):
        std_dev_t = torch.full((1, 1, 1), data["std_dev_t"])  # their [B, 1, 1] for [B, L, C] latents
        dt = torch.full((1, 1, 1), -data["sqrt_dt"] ** 2)
        std = (std_dev_t * torch.sqrt(-dt)).reshape(1, 1, 1, 1)
        log_prob = gaussian_log_prob(data["x"][r : r + 1], mean[r : r + 1], std)
        old_log_prob = gaussian_log_prob(data["x"][r : r + 1], data["old_mean"][r : r + 1], std)
        namespace = {"torch": torch, "old_log_prob": old_log_prob, "timestep_index": 0, "callback_index_map": [0],
                     "batch": {"advantage": data["advantages"][r : r + 1],
                               "next_latents_mean": data["old_mean"][r : r + 1].unsqueeze(1)},
                     "output": SimpleNamespace(log_prob=log_prob, next_latents_mean=mean[r : r + 1], std_dev_t=std_dev_t,
                                               dt=dt),
                     "self": SimpleNamespace(training_args=SimpleNamespace(adv_clip_range=(-5.0, 5.0),
                                                                           clip_range=(-clip, clip)))}
        exec(block, namespace)
        losses.append(namespace["policy_loss"])
    loss = torch.stack(losses).mean()
    loss.backward()
    return {"loss": float(loss.detach()), "grad_mean": floats(mean.grad)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verl-omni", type=Path, default=VERL)
    p.add_argument("--flow-factory", type=Path, default=FF)
    p.add_argument("--out", type=Path, default=Path("tests/data"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    verl_source = git_file(args.verl_omni, VERL_COMMIT, VERL_FILE, VERL_SHA256)
    compute_loss = execute(function_source(verl_source, "compute_loss", cls="GRPOGuardLoss"), "verl_grpo_guard",
                           {"torch": torch, "Optional": Optional, "Any": Any, "DiffusionActorConfig": object})["compute_loss"]
    ff_source = git_file(args.flow_factory, FF_COMMIT, FF_FILE, FF_SHA256)
    block = compile(lines_between(ff_source, "# 3. Compute loss", "policy_loss = torch.mean(torch.maximum(",
                                  after="class GRPOGuardTrainer"), "flow_factory_grpo_guard", "exec")
    cases = []
    for name, index, noise_level, clip, offset, seed in CASES:
        data = inputs(index, noise_level, offset, seed)
        cases.append({"name": name, "step_index": index, "noise_level": noise_level, "clip_range": clip,
                      **{k: (floats(v) if torch.is_tensor(v) else v) for k, v in data.items()},
                      "verl_omni": verl_case(compute_loss, data, clip),
                      "flow_factory": flow_factory_rows(block, data, clip)})
    reference = {"verl_omni": {"path": VERL_FILE, "commit": VERL_COMMIT},
                 "flow_factory": {"path": FF_FILE, "commit": FF_COMMIT}, "cases": cases}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "grpo_guard_reference.json"
    path.write_text(json.dumps(reference) + "\n")
    for case in cases:
        print(f"{case['name']}: verl-omni loss {case['verl_omni']['loss']:.6g} (clipfrac "
              f"{case['verl_omni']['clipfrac']:.2f}), Flow-Factory loss {case['flow_factory']['loss']:.6g}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Reference values for AWM (align/train/objectives/awm.py), computed by the authors' own training script on seeded inputs.

    python -m experiments.awm_reference [--repo MIRROR] [--commit REV] [--out tests/data/awm_reference.json]

The authors' file is read with ``git show REV:advantage_weighted_matching/scripts/train_sd3_awm.py`` from a clone of
scxue/advantage_weighted_matching (default: the local mirror at HEAD, be51372, 2026-03-27). Four pieces of it
run unchanged, each located by marker lines and exec'd with its free names bound:
  - ``compute_log_prob_awm`` (the whole function, found by name): its transformer is a tiny callable that
    returns a prepared float64 tensor (the velocity, a leaf that requires grad) and records the timestep it
    is called with; config.train.cfg is False, as in every recipe.
  - the training step from ``if not config.train.off_policy:`` (first one after the "training" loop header)
    to ``info["loss"].append(loss)``: log-prob reshape, advantage clip/scale, ratio, PPO clip, KL to the base
    and to the EMA adapter, total loss, clipfrac. Its inputs come from three calls of compute_log_prob_awm
    (policy with grad; base and EMA under no_grad), as in the script. ``loss.backward()`` then gives
    d loss / d model_output.
  - the time sampling from ``if config.time_type == 'logit_normal':`` to its ``raise NotImplementedError``,
    on CPU after ``torch.manual_seed(seed)``, on the SD3.5 14-step grid (diffusers' FlowMatchEulerDiscreteScheduler,
    shift 3) and on plain linspace grids.
  - the end-of-epoch update of the "ema" adapter, from ``if config.train.kl_ema_decay_type == 'constant':`` to
    the ``tgt_param.data.copy_`` line, on small tensors.
Everything is float64 on CPU (torch 2.13, this project's Python; nothing else is installed). ``print`` calls in
the blocks are silenced by ``accelerator.is_main_process = False``. The authors' step needs log_prob_ref and
model_output_ema bound even when beta or ema_beta is 0 (it reshapes them unconditionally); they are bound here.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import textwrap
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path("/work/.mirror/scxue+advantage_weighted_matching/repo")
SCRIPT = "advantage_weighted_matching/scripts/train_sd3_awm.py"
OUT = ROOT / "tests" / "data" / "awm_reference.json"
LATENT = (2, 2, 2)  # C, H, W of the tiny "latents"
WEIGHTINGS = ["Uniform", "t", "t**2", "huber", "ghuber"]


# ---------------------------------------------------------------- the authors' code


def authors_source(repo: Path, commit: str) -> tuple[str, str]:
    full = subprocess.run(["git", "-C", str(repo), "rev-parse", commit], check=True, capture_output=True, text=True)
    sha = full.stdout.strip()
    text = subprocess.run(["git", "-C", str(repo), "show", f"{sha}:{SCRIPT}"], check=True, capture_output=True,
                          text=True).stdout
    return sha, text


def function_source(text: str, name: str) -> str:
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node)


def block(lines: list[str], start: int, end_marker: str) -> str:
    """Lines[start] up to and including the first line at or after it that contains end_marker, dedented."""
    end = next(i for i in range(start, len(lines)) if end_marker in lines[i])
    return textwrap.dedent("\n".join(lines[start:end + 1]))


def line_index(lines: list[str], marker: str, after: int = 0) -> int:
    return next(i for i in range(after, len(lines)) if marker in lines[i])


class Pieces:
    def __init__(self, text: str):
        lines = text.splitlines()
        namespace = {"torch": torch}
        exec(compile(function_source(text, "compute_log_prob_awm"), SCRIPT, "exec"), namespace)
        self.compute_log_prob_awm = namespace["compute_log_prob_awm"]
        training = line_index(lines, 'desc=f"Epoch {epoch}: training"')
        self.step = compile(block(lines, line_index(lines, "if not config.train.off_policy:", training),
                                  'info["loss"].append(loss)'), SCRIPT + ":step", "exec")
        self.times = compile(block(lines, line_index(lines, "if config.time_type == 'logit_normal':"),
                                   'raise NotImplementedError("Only logit_normal'), SCRIPT + ":times", "exec")
        self.ema = compile(block(lines, line_index(lines, "if config.train.kl_ema_decay_type == 'constant':"),
                                 "tgt_param.data.copy_(tgt_param.detach().data * decay"), SCRIPT + ":ema", "exec")


class TinyTransformer:
    """Stands in for the SD3 transformer: returns the given velocity and records the timestep it was given."""

    def __init__(self, output: torch.Tensor):
        self.output = output
        self.timestep = None

    def __call__(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict):
        self.timestep = timestep.detach().clone()
        return (self.output,)


def config(**train) -> SimpleNamespace:
    return SimpleNamespace(train=SimpleNamespace(cfg=False, **train), sample=SimpleNamespace(guidance_scale=1.0))


QUIET = SimpleNamespace(is_main_process=False, device=torch.device("cpu"))


def as_list(tensor: torch.Tensor) -> list:
    return tensor.detach().double().tolist()


# ---------------------------------------------------------------- inputs


def inputs(seed: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    clean, noise = randn(rows, *LATENT), randn(rows, *LATENT)
    target = noise - clean
    # the policy near the target (small errors, where ghuber bends most) and two other models near the policy
    model_output = target + randn(rows, *LATENT, scale=0.7)
    return {"clean": clean, "noise": noise, "model_output": model_output,
            "ref_output": model_output + randn(rows, *LATENT, scale=0.3),
            "ema_output": model_output + randn(rows, *LATENT, scale=0.1)}


def log_prob_cases(pieces: Pieces) -> list[dict]:
    """compute_log_prob_awm per weighting on 8 rows with t from 0.01 to 1, and d sum(log_prob) / d model_output."""
    data = inputs(0, 8)
    t = torch.tensor([1.0, 0.973, 0.8, 0.55, 0.3, 0.2, 0.05, 0.01], dtype=torch.float64).view(-1, 1, 1, 1)
    cases = []
    for weighting, power in [(w, 0.25) for w in WEIGHTINGS] + [("ghuber", 0.5), ("ghuber", 1.0)]:
        output = data["model_output"].clone().requires_grad_(True)
        transformer = TinyTransformer(output)
        noised = (1 - t) * data["clean"] + t * data["noise"]
        log_prob, model_output, std_dev_t = pieces.compute_log_prob_awm(
            transformer, None, None, t, None, None, config(ghuber_power=power), noised, data["clean"],
            data["noise"], weighting=weighting)
        log_prob.sum().backward()
        cases.append({"weighting": weighting, "ghuber_power": power, "log_prob": as_list(log_prob),
                      "grad": as_list(output.grad), "std_dev_t": as_list(std_dev_t.reshape(-1)),
                      "transformer_timestep": as_list(transformer.timestep)})
    return [{"t": as_list(t.reshape(-1)), "model_output": as_list(data["model_output"]),
             "clean": as_list(data["clean"]), "noise": as_list(data["noise"]), "cases": cases}]


STEP_CASES = [
    # the PickScore recipe, on-policy: old log-prob = this forward's, detached (ratio 1)
    dict(name="recipe-on-policy", weighting="ghuber", loss_type="exp_first", clip_range=1.0, adv_clip_max=5,
         advantage_max=1, beta=1e-4, kl_weight="Uniform", ema_beta=1.0, kl_ema_weight="Uniform", on_policy=True),
    dict(name="exp-first-clipped-elbo", weighting="Uniform", loss_type="exp_first", clip_range=0.2, adv_clip_max=5,
         advantage_max=None, beta=0.1, kl_weight="ELBO", ema_beta=0.5, kl_ema_weight="ELBO", on_policy=False),
    dict(name="sum-first-clipped", weighting="t", loss_type="sum_first", clip_range=0.1, adv_clip_max=2,
         advantage_max=1, beta=0.05, kl_weight="Uniform", ema_beta=0.2, kl_ema_weight="ELBO", on_policy=False),
    dict(name="sum-first-huber-tiny-clip", weighting="huber", loss_type="sum_first", clip_range=1e-4,
         adv_clip_max=5, advantage_max=None, beta=0.01, kl_weight="ELBO", ema_beta=1.0, kl_ema_weight="Uniform",
         on_policy=False),
    dict(name="exp-first-t2-no-kl", weighting="t**2", loss_type="exp_first", clip_range=0.3, adv_clip_max=3,
         advantage_max=2, beta=0.0, kl_weight="Uniform", ema_beta=0.0, kl_ema_weight="Uniform", on_policy=False),
    dict(name="exp-first-ghuber-half-power", weighting="ghuber", ghuber_power=0.5, loss_type="exp_first",
         clip_range=0.15, adv_clip_max=5, advantage_max=1, beta=1e-3, kl_weight="Uniform", ema_beta=1.0,
         kl_ema_weight="Uniform", on_policy=False),
]
T, B = 3, 4
ADVANTAGES = [2.5, -1.0, 7.0, -6.0]  # both signs, two beyond every adv_clip_max used


def step_case(pieces: Pieces, spec: dict, seed: int) -> dict:
    """The authors' compute_log_prob_awm ×3 and training step on T=3 timesteps × B=4 samples."""
    data = inputs(seed, T * B)
    grid_t = torch.tensor([0.943, 0.654, 0.357], dtype=torch.float64)
    t = torch.repeat_interleave(grid_t, repeats=B).view(-1, 1, 1, 1)  # timestep-major rows, as the script
    cfg = config(ghuber_power=spec.get("ghuber_power", 0.25), loss_type=spec["loss_type"],
                 clip_range=spec["clip_range"], adv_clip_max=spec["adv_clip_max"],
                 advantage_max=spec["advantage_max"], beta=spec["beta"], kl_weight=spec["kl_weight"],
                 ema_beta=spec["ema_beta"], kl_ema_weight=spec["kl_ema_weight"], train_timesteps=T, batch_size=B,
                 off_policy=False, gradient_accumulation_steps=1)
    noised = (1 - t) * data["clean"] + t * data["noise"]

    def run(output, grad):
        transformer = TinyTransformer(output)
        with torch.set_grad_enabled(grad):
            return pieces.compute_log_prob_awm(transformer, None, None, t, None, None, cfg, noised, data["clean"],
                                               data["noise"], weighting=spec["weighting"])

    output = data["model_output"].clone().requires_grad_(True)
    log_prob, model_output, std_dev_t = run(output, True)
    log_prob_ref, model_output_ref, _ = run(data["ref_output"], False)
    _, model_output_ema, _ = run(data["ema_output"], False)
    sample = {"advantages": torch.tensor(ADVANTAGES, dtype=torch.float64).view(B, 1)}
    old_log_probs = None
    if spec["on_policy"]:
        i = 0  # within the first gradient_accumulation_steps micro-batches: old = this forward, detached
    else:
        i = 1  # later: the precomputed (no-grad) old log-probs; offsets put ratios on both sides of the clip
        g = torch.Generator().manual_seed(100 + seed)
        offsets = torch.randn(T, B, generator=g, dtype=torch.float64) * 0.4
        old_log_probs = log_prob.detach().reshape(T, B) + offsets
        sample["old_log_probs"] = old_log_probs.clone()
    namespace = {"torch": torch, "config": cfg, "i": i, "sample": sample, "accelerator": QUIET,
                 "info": defaultdict(list), "log_prob": log_prob, "log_prob_ref": log_prob_ref,
                 "model_output": model_output, "model_output_ref": model_output_ref,
                 "model_output_ema": model_output_ema, "std_dev_t": std_dev_t}
    exec(pieces.step, namespace)
    namespace["loss"].backward()
    record = {key: value for key, value in spec.items()}
    record.update({
        "t": as_list(t.reshape(-1)), "advantages": ADVANTAGES, "model_output": as_list(data["model_output"]),
        "ref_output": as_list(data["ref_output"]), "ema_output": as_list(data["ema_output"]),
        "clean": as_list(data["clean"]), "noise": as_list(data["noise"]),
        "old_log_probs": None if old_log_probs is None else as_list(old_log_probs),
        "log_prob": as_list(log_prob), "ratio": as_list(namespace["ratio"]),
        "policy_loss": namespace["policy_loss"].item(), "loss": namespace["loss"].item(),
        "clipfrac": namespace["info"]["clipfrac"][0].item(), "grad": as_list(output.grad),
    })
    if spec["beta"] > 0:
        record["kl_loss"] = namespace["kl_loss"].item()
        if spec["ema_beta"] > 0:
            record["ema_kl_loss"] = namespace["ema_kl_loss"].item()
    return record


def sd3_grid(num_steps: int) -> torch.Tensor:
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)  # SD3.5-Medium's scheduler config
    scheduler.set_timesteps(num_steps)
    return scheduler.timesteps.float()


def time_cases(pieces: Pieces) -> list[dict]:
    """The authors' discrete time sampling after torch.manual_seed(seed), on CPU, with batch size 2."""
    cases = []
    settings = [(14, 6, 0.9), (14, 1, 0.9), (10, 3, 1.0), (40, 5, 0.9), (20, 7, 0.5)]
    for time_type in ["discrete", "discrete_with_init", "discrete_wo_init"]:
        for num_steps, train_timesteps, fraction in settings:
            grid = sd3_grid(num_steps) if num_steps == 14 else torch.linspace(1000, 10, num_steps)
            for seed in range(3):
                cfg = SimpleNamespace(time_type=time_type, time_shift=3.0,
                                      train=SimpleNamespace(train_timesteps=train_timesteps, batch_size=2,
                                                            timestep_fraction=fraction),
                                      sample=SimpleNamespace(num_steps=num_steps))
                namespace = {"torch": torch, "config": cfg, "accelerator": QUIET,
                             "sample": {"timesteps": grid.repeat(2, 1)}}
                torch.manual_seed(seed)
                exec(pieces.times, namespace)
                cases.append({"time_type": time_type, "num_steps": num_steps, "train_timesteps": train_timesteps,
                              "timestep_fraction": fraction, "seed": seed, "batch_size": 2,
                              "grid": grid.tolist(), "t_indices": namespace["t_indices"].tolist(),
                              "timesteps": namespace["timesteps"].reshape(-1).tolist()})
    return cases


def ema_cases(pieces: Pieces) -> list[dict]:
    """The authors' end-of-epoch "ema" adapter update on two small tensors."""
    g = torch.Generator().manual_seed(7)
    current = [torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)]
    ema = [torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)]
    cases = []
    for schedule, decay, step in [("constant", 0.3, 5), ("constant", 0.9, 0), ("linear", 0.3, 0), ("linear", 0.3, 7),
                                  ("linear", 0.3, 250), ("linear", 0.3, 1000), ("linear", 0.05, 40)]:
        targets = [p.clone() for p in ema]
        cfg = SimpleNamespace(train=SimpleNamespace(kl_ema_decay_type=schedule, kl_ema_decay=decay))
        namespace = {"torch": torch, "config": cfg, "accelerator": QUIET, "global_step": step,
                     "transformer_trainable_parameters": current, "ema_transformer_trainable_parameters": targets}
        exec(pieces.ema, namespace)
        cases.append({"schedule": schedule, "kl_ema_decay": decay, "global_step": step,
                      "decay": float(namespace["decay"]), "current": [as_list(p) for p in current],
                      "ema": [as_list(p) for p in ema], "updated": [as_list(p) for p in targets]})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=MIRROR, help="a clone of scxue/advantage_weighted_matching")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    sha, text = authors_source(args.repo, args.commit)
    pieces = Pieces(text)
    reference = {
        "source": f"scxue/advantage_weighted_matching@{sha}:{SCRIPT}",
        "torch": torch.__version__,
        "log_prob": log_prob_cases(pieces),
        "steps": [step_case(pieces, spec, seed) for seed, spec in enumerate(STEP_CASES, start=1)],
        "times": time_cases(pieces),
        "ema": ema_cases(pieces),
    }
    args.out.write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} from {reference['source']}")


if __name__ == "__main__":
    main()

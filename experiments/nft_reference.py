"""Reference values for DiffusionNFT's maths (align/train/objectives/nft.py), computed by the authors' own lines.

    python -m experiments.nft_reference [--repo DIR] [--commit REV] [--out tests/data]

DIR is a git checkout or mirror of NVlabs/DiffusionNFT (default /work/.mirror/NVlabs+DiffusionNFT/repo, commit
24af5554898d85e93efa492f42b5e9cdf4156e9b); the files are read with ``git show REV:path`` and nothing is changed:

- scripts/train_nft_sd3.py, the training step: the lines from ``# Policy Gradient Loss`` (then ``advantages_clip = torch.clamp(``) through
  ``loss += config.train.beta * torch.mean(kl_div_loss)`` (the advantage -> r mapping, the logged norms and
  deviations, the positive / implicit-negative mix, the self-normalised x0 losses, the KL term), exec'd with
  float64 tensors bound to forward_prediction (requires grad), old_prediction, ref_forward_prediction, xt, x0,
  t_expanded, train_sample_batch["advantages"] and a SimpleNamespace config (beta, train.beta,
  train.adv_clip_max, train.adv_mode). Records loss, loss_terms and d loss / d forward_prediction. The sub-range
  ending at ``r = torch.clamp(normalized_advantages_clip, 0, 1)`` gives r for every adv_mode.
- the same file's ``return_decay`` (by ast) for a range of steps and decay types 0, 1, 2, and the old-policy
  update lines from ``decay = return_decay(global_step, config.decay_type)`` through ``tgt_param.data.copy_(``.
- flow_grpo/ema.py's EMAModuleWrapper (decay 0.9, as the trainer builds it), stepped at global steps 1..5.
- flow_grpo/diffusers_patch/solver.py's run_sampling(solver="dpm2", determistic=True) on a toy velocity
  v(z, sigma) = tanh(A*z) + sigma*B (A, B recorded), over SD3's shifted 10- and 25-step sigma grids
  (FlowMatchEulerDiscreteScheduler(shift=3.0).set_timesteps(N), float32 as the pipeline passes them) and an
  unshifted grid that starts below sigma = 1.

Side environment: this project's Python (torch 2.13 CPU, diffusers 0.42.1, tqdm); no other package is needed
(solver.py imports only diffusers' randn_tensor, torch.distributed and tqdm). Writes nft_reference.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

DEFAULT_REPO = Path("/work/.mirror/NVlabs+DiffusionNFT/repo")
TRAIN_SCRIPT = "scripts/train_nft_sd3.py"
STEP_START = "# Policy Gradient Loss"  # the line before ``advantages_clip = torch.clamp(``
STEP_LOSS_START = "positive_prediction = config.beta * forward_prediction"
STEP_END = "loss += config.train.beta * torch.mean(kl_div_loss)"
ADV_END = "r = torch.clamp(normalized_advantages_clip, 0, 1)"
UPDATE_START = "decay = return_decay(global_step, config.decay_type)"
UPDATE_END = "tgt_param.data.copy_("
SHAPE = (4, 2, 3, 3)
GRID_T = [1.0, 0.9601293206214905, 0.4648760259151459, 0.008928571827709675]  # SD3 10-step grid values
DECAY_STEPS = [0, 1, 2, 5, 10, 74, 75, 76, 100, 150, 208, 209, 210, 300, 499, 500, 501, 1000, 5000]


def authors_file(repo: Path, commit: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def line_range(source: str, start: str, end: str) -> str:
    """The lines from the one holding ``start`` through the first after it holding ``end``, dedented."""
    lines = source.splitlines()
    starts = [i for i, line in enumerate(lines) if start in line]
    if len(starts) != 1:
        raise ValueError(f"start marker {start!r} found {len(starts)} times")
    stop = next(i for i in range(starts[0], len(lines)) if end in lines[i])
    block = lines[starts[0]:stop + 1]
    # the end marker may open a multi-line statement: take lines until the brackets close
    while sum(line.count("(") - line.count(")") for line in block) > 0:
        stop += 1
        block.append(lines[stop])
    return textwrap.dedent("\n".join(block)) + "\n"


def function_source(source: str, name: str) -> str:
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(source, node) + "\n"


def _config(beta: float, train_beta: float, adv_clip_max: float = 5.0, adv_mode: str = "all") -> SimpleNamespace:
    return SimpleNamespace(beta=beta, train=SimpleNamespace(beta=train_beta, adv_clip_max=adv_clip_max,
                                                            adv_mode=adv_mode))


def _tolist(t: torch.Tensor):
    return t.detach().double().tolist()


def loss_case(step_code: str, name: str, beta: float, train_beta: float, advantages: list[float],
              tiny_first: bool, seed: int) -> dict:
    """One training step of the authors on seeded float64 tensors; ``tiny_first`` puts sample 0's x0 errors
    below the 1e-5 clip of the self-normalising weights."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    noise = torch.randn(SHAPE, generator=g, dtype=torch.float64)
    t = torch.tensor(GRID_T, dtype=torch.float64)
    t_expanded = t.view(-1, *([1] * (x0.ndim - 1)))
    xt = (1 - t_expanded) * x0 + t_expanded * noise  # the authors' noising line
    old = (noise - x0) + 0.3 * torch.randn(SHAPE, generator=g, dtype=torch.float64)
    forward = old + 0.05 * torch.randn(SHAPE, generator=g, dtype=torch.float64)
    ref = old + 0.05 * torch.randn(SHAPE, generator=g, dtype=torch.float64)
    if tiny_first:
        exact = noise[0] - x0[0]  # x_t - t*exact = x0 exactly
        old[0] = exact + 1e-7 * torch.randn(SHAPE[1:], generator=g, dtype=torch.float64)
        forward[0] = exact + 1e-7 * torch.randn(SHAPE[1:], generator=g, dtype=torch.float64)
    forward_prediction = forward.clone().requires_grad_(True)
    scope = {
        "torch": torch, "config": _config(beta, train_beta),
        "train_sample_batch": {"advantages": torch.tensor(advantages, dtype=torch.float64)[:, None]}, "j_idx": 0,
        "forward_prediction": forward_prediction, "old_prediction": old, "ref_forward_prediction": ref,
        "xt": xt, "x0": x0, "t_expanded": t_expanded, "loss_terms": {},
    }
    exec(step_code, scope)
    loss = scope["loss"]
    loss.backward()
    return {
        "name": name, "beta": beta, "train_beta": train_beta, "adv_clip_max": 5.0, "tiny_first": tiny_first,
        "advantages": advantages, "t": GRID_T, "x0": _tolist(x0), "xt": _tolist(xt),
        "forward_prediction": _tolist(forward), "old_prediction": _tolist(old), "ref_prediction": _tolist(ref),
        "r": _tolist(scope["r"]), "loss": loss.item(), "loss_dtype": str(loss.dtype),
        "loss_terms": {k: v.item() for k, v in scope["loss_terms"].items()},
        "grad_forward_prediction": _tolist(forward_prediction.grad),
    }


def adv_mode_cases(adv_code: str) -> list[dict]:
    advantages = [-7.0, -5.0, -2.5, -0.1, 0.0, 0.1, 2.5, 5.0, 7.0]
    cases = []
    for mode in ("all", "positive_only", "negative_only", "one_only", "binary"):
        scope = {"torch": torch, "config": _config(1.0, 1e-4, 5.0, mode), "j_idx": 0,
                 "train_sample_batch": {"advantages": torch.tensor(advantages, dtype=torch.float64)[:, None]}}
        exec(adv_code, scope)
        cases.append({"adv_mode": mode, "adv_clip_max": 5.0, "advantages": advantages, "r": _tolist(scope["r"])})
    return cases


def decay_reference(source: str) -> dict:
    scope: dict = {}
    exec(function_source(source, "return_decay"), scope)
    decay = {str(kind): [scope["return_decay"](s, kind) for s in DECAY_STEPS] for kind in (0, 1, 2)}
    # the old-policy update after an epoch, on seeded parameters
    g = torch.Generator().manual_seed(7)
    current = [torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
    old = [torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
    old_before = [p.clone() for p in old]
    scope.update(torch=torch, global_step=120, config=SimpleNamespace(decay_type=2),
                 transformer_trainable_parameters=current, old_transformer_trainable_parameters=old)
    exec(line_range(source, UPDATE_START, UPDATE_END), scope)
    update = {"global_step": 120, "decay_type": 2, "decay": scope["decay"], "current": [_tolist(p) for p in current],
              "old_before": [_tolist(p) for p in old_before], "old_after": [_tolist(p) for p in old]}
    return {"steps": DECAY_STEPS, "decay": decay, "old_policy_update": update}


def ema_reference(source: str) -> dict:
    scope: dict = {}
    exec(source, scope)
    g = torch.Generator().manual_seed(11)
    params = [torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)]
    ema = scope["EMAModuleWrapper"](params, decay=0.9, update_step_interval=1, device=torch.device("cpu"))
    initial = _tolist(params[0])
    history = []
    for step in range(1, 6):  # the trainer calls ema.step(params, global_step) after each optimiser step
        with torch.no_grad():
            params[0].add_(torch.randn(4, generator=g, dtype=torch.float64))
        ema.step(params, step)
        history.append({"global_step": step, "params": _tolist(params[0]), "ema": _tolist(ema.ema_parameters[0]),
                        "decay": ema.get_current_decay(step)})
    return {"max_decay": 0.9, "initial": initial, "steps": history}


def solver_reference(source: str) -> list[dict]:
    scope: dict = {}
    exec(source, scope)
    g = torch.Generator().manual_seed(3)
    shape = (1, 2, 4, 4)
    a = torch.randn(shape, generator=g)
    b = torch.randn(shape, generator=g)
    z = torch.randn(shape, generator=g)

    def velocity(x, sigma):
        return torch.tanh(a * x) + float(sigma) * b

    grids = {}
    for n in (10, 25):
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        scheduler.set_timesteps(n)
        grids[f"sd3_shift3_{n}"] = scheduler.sigmas.float()
    grids["unshifted_below_1"] = torch.tensor([0.9, 0.75, 0.6, 0.45, 0.3, 0.15, 0.0])
    cases = []
    for name, sigmas in grids.items():
        torch.manual_seed(0)  # the DDIM steps draw (and multiply by 0) a noise tensor
        final, all_latents, _ = scope["run_sampling"](velocity, z.clone(), sigmas, solver="dpm2", determistic=True)
        cases.append({"name": name, "sigmas": sigmas.tolist(), "A": a.tolist(), "B": b.tolist(), "z": z.tolist(),
                      "final": final.tolist(), "all_latents": [x.tolist() for x in all_latents]})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=DEFAULT_REPO)
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--out", type=Path, default=Path("tests/data"))
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", args.commit], check=True, capture_output=True,
                            text=True).stdout.strip()
    train = authors_file(args.repo, commit, TRAIN_SCRIPT)
    step_code = line_range(train, STEP_START, STEP_END)
    if STEP_LOSS_START not in step_code:
        raise ValueError("the training-step block no longer holds the positive/negative mix")
    adv_code = line_range(train, STEP_START, ADV_END)
    advantages = [-7.0, 5.0, 1.3, -0.4]  # r = 0, 1 and between
    tiny_advantages = [2.0, -1.0, 9.0, 0.0]
    reference = {
        "source": f"NVlabs/DiffusionNFT @ {commit}",
        "loss_cases": [
            loss_case(step_code, "beta1", 1.0, 1e-4, advantages, False, 0),
            loss_case(step_code, "beta0.1", 0.1, 1e-4, advantages, False, 1),
            loss_case(step_code, "beta1_tiny_error", 1.0, 1e-4, tiny_advantages, True, 2),
            loss_case(step_code, "beta0.1_tiny_error_kl0.1", 0.1, 0.1, tiny_advantages, True, 3),
        ],
        "adv_mode_cases": adv_mode_cases(adv_code),
        "return_decay": decay_reference(train),
        "eval_ema": ema_reference(authors_file(args.repo, commit, "flow_grpo/ema.py")),
        "dpm2_solver": solver_reference(authors_file(args.repo, commit, "flow_grpo/diffusers_patch/solver.py")),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "nft_reference.json"
    path.write_text(json.dumps(reference) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

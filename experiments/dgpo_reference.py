"""Reference values for DGPO (align/train/objectives/dgpo.py), computed by the authors' own training script.

    python -m experiments.dgpo_reference [--mirror DIR] [--out tests/data]

DIR is a fetched mirror of Luo-Yihong/DGPO (a bare git directory; default /work/.mirror/Luo-Yihong+DGPO/repo). The
script reads scripts/train_sd3_dgpo.py @ 01ceb4b (2026-04-25, sha256 checked); the file imports accelerate, absl,
wandb and the authors' package, so two parts of it run alone, as written:
  - ``compute_group_dgpo_loss_allreduce`` (the function, by name), with ``dist`` bound to a one-process stand-in whose
    ``all_reduce`` leaves the tensor as it is (the sum over one process);
  - the training step's lines from ``ref_dgpo_v = ref_old_v`` to ``info["dsm_loss"].append(dsm_loss.mean())``: the
    advantage clip, the denoising losses, the PPO-style clip against the EMA policy, the group loss and the KL, with
    ``model_v`` a leaf that requires grad, ``ref_old_v`` / ``old_v`` the base and EMA predictions, ``target_v = noise -
    x0`` as their line before it, ``group_info`` as their ``precompute_group_info`` makes it, and a config namespace
    of the recipe's values. ``loss.backward()`` then gives d loss / d model_v.
Two groups of 4 images at one timestep (their micro-batch), float32 on CPU; the recipes' settings (GenEval/OCR: beta
100, clip 1e-2, KL 0.02; PickScore: beta 10, KL 0.001), no clipping, the EMA policy as the reference (use_ema_ref) and
interleaved group ids.

Writes dgpo_reference.json into --out (tests/test_dgpo_reference.py reads it). Side environment: this project's Python
(torch 2.13.0+cpu).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments.authors_source import execute, floats, function_source, git_file, lines_between

MIRROR = Path("/work/.mirror/Luo-Yihong+DGPO/repo")
COMMIT = "01ceb4b83c0bbc55d96246fe1b6d9a3d4749ebd6"
SCRIPT = "scripts/train_sd3_dgpo.py"
SHA256 = "0ab5042b552a2cc7cc0ed26db2164817548769e5a5cdcd13958d8c889f85a332"
LATENT = (3, 4, 4)
GROUP = 4
ADVANTAGES = [1.1, -0.3, 0.7, -1.5, 6.0, -2.0, -0.5, -3.5]  # two groups; 6.0 is clipped to 5
CASES = (  # (name, beta_dpo, clip_range, clip_dsm, kl beta, use_ema_ref, interleaved groups, seed)
    ("geneval", 100.0, 1e-2, True, 0.02, False, False, 1),
    ("pickscore", 10.0, 1e-2, True, 0.001, False, False, 2),
    ("no-clip-no-kl", 100.0, 1e-2, False, 0.0, False, False, 3),
    ("ema-reference", 2000.0, 5e-2, True, 0.001, True, False, 4),
    ("interleaved-groups", 100.0, 1e-2, True, 0.02, False, True, 5),
)


class OneProcess:
    """torch.distributed for one process: all_reduce of a sum leaves the tensor as it is."""

    class ReduceOp:
        SUM = "sum"

    @staticmethod
    def all_reduce(tensor, op=None):
        return tensor


def case(loss_fn, block, name, beta_dpo, clip, clip_dsm, beta, ema_ref, interleaved, seed) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = len(ADVANTAGES)
    x0, noise = torch.randn(rows, *LATENT, generator=g), torch.randn(rows, *LATENT, generator=g)
    target_v = noise - x0
    model_v = (target_v + 0.5 * torch.randn(rows, *LATENT, generator=g)).requires_grad_(True)
    ref_old_v = model_v.detach() + 0.2 * torch.randn(rows, *LATENT, generator=g)
    old_v = model_v.detach() + 0.1 * torch.randn(rows, *LATENT, generator=g)
    groups = torch.tensor([0, 1] * GROUP) if interleaved else torch.arange(rows) // GROUP
    config = SimpleNamespace(use_ema_ref=ema_ref, clip_range=clip, clip_dsm=clip_dsm, clip_kl=False,
                             train=SimpleNamespace(adv_clip_max=5, beta_dpo=beta_dpo, beta=beta),
                             sample=SimpleNamespace(num_image_per_prompt=GROUP))
    namespace = {"torch": torch, "compute_group_dgpo_loss_allreduce": loss_fn, "config": config, "j": 0,
                 "sample": {"advantages": torch.tensor(ADVANTAGES).view(rows, 1)}, "x0": x0, "target_v": target_v,
                 "model_v": model_v, "ref_old_v": ref_old_v, "old_v": old_v, "use_old": clip_dsm or ema_ref,
                 "accelerator": None, "info": defaultdict(list),
                 "group_info": {"local_group_indices": groups, "num_groups": int(groups.max()) + 1}}
    exec(block, namespace)
    namespace["loss"].backward()
    out = {"name": name, "beta_dpo": beta_dpo, "clip_range": clip, "clip_dsm": clip_dsm, "beta": beta,
           "use_ema_ref": ema_ref, "group_size": GROUP, "groups": groups.tolist(), "advantages": ADVANTAGES,
           "x0": floats(x0), "noise": floats(noise), "model_v": floats(model_v.detach()), "ref_v": floats(ref_old_v),
           "old_v": floats(old_v), "loss": float(namespace["loss"].detach()),
           "dgpo_loss": float(namespace["dgpo_loss"].detach()), "grad_model_v": floats(model_v.grad)}
    if "should_clip" in namespace:
        out["clipped"] = namespace["should_clip"].tolist()
    if beta > 0:
        out["kl_loss"] = float(namespace["kl_loss"].detach())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mirror", type=Path, default=MIRROR)
    p.add_argument("--out", type=Path, default=Path("tests/data"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    source = git_file(args.mirror, COMMIT, SCRIPT, SHA256)
    loss_fn = execute(function_source(source, "compute_group_dgpo_loss_allreduce"), "dgpo_loss",
                      {"torch": torch, "dist": OneProcess})["compute_group_dgpo_loss_allreduce"]
    block = compile(lines_between(source, "ref_dgpo_v = ref_old_v", 'info["dsm_loss"].append(dsm_loss.mean())'),
                    "dgpo_step", "exec")
    reference = {"authors": {"repository": "Luo-Yihong/DGPO", "path": SCRIPT, "commit": COMMIT},
                 "cases": [case(loss_fn, block, *spec) for spec in CASES]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "dgpo_reference.json"
    path.write_text(json.dumps(reference) + "\n")
    for c in reference["cases"]:
        print(f"{c['name']}: loss {c['loss']:.6g}, clipped {c.get('clipped')}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Reference values for GDPO's advantages (align/train/advantages.py ``gdpo_combined_rewards`` and
``gdpo_batch_advantages``, --advantage gdpo), computed by the authors' own code.

    python -m experiments.gdpo_reference [--mirror DIR] [--out tests/data]

DIR is a fetched mirror of NVlabs/GDPO (a bare git directory; default /work/.mirror/NVlabs+GDPO/repo). The script reads
trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py @ b080e63 (2026-01-09, sha256 checked; the README's reference
implementation) and runs the lines of ``_generate_and_score_completions`` from ``if self.apply_gdpo and
len(self.reward_weights) > 1:`` to the batch normalisation ``advantages = (pre_bn_advantages - ...)``, as written, with
``self`` holding ``apply_gdpo``, ``reward_weights`` and ``num_generations`` and ``rewards_per_func`` the gathered
[N, K] float32 rewards (their trainer's dtype) of groups of consecutive completions. The rewards: three judges of very
different spreads (a 0/1 oracle, a wide score, a narrow one; one group tied on the oracle), weights 1, 0.5, 2.

Writes gdpo_reference.json into --out (tests/test_gdpo_reference.py reads it). Side environment: this project's Python
(torch 2.13.0+cpu).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments.authors_source import floats, git_file, lines_between

MIRROR = Path("/work/.mirror/NVlabs+GDPO/repo")
COMMIT = "b080e63d0126870ad08acc8ebc3f04b728175a9e"
FILE = "trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py"
SHA256 = "15f9992200d61f4bb5ffaf1f4f7ea039f096f98d04aa0ad105bc37391c4843aa"
GROUPS, GENERATIONS = 4, 6
WEIGHTS = [1.0, 0.5, 2.0]


def rewards() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    n = GROUPS * GENERATIONS
    oracle = (torch.rand(n, generator=g) > 0.5).float()
    oracle[:GENERATIONS] = 1.0  # the first group is tied on the oracle
    wide = 10 * torch.randn(n, generator=g)
    narrow = 0.01 * torch.rand(n, generator=g)
    return torch.stack([oracle, wide, narrow], dim=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mirror", type=Path, default=MIRROR)
    p.add_argument("--out", type=Path, default=Path("tests/data"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    source = git_file(args.mirror, COMMIT, FILE, SHA256)
    block = lines_between(source, "if self.apply_gdpo and len(self.reward_weights) > 1:",
                          "advantages = (pre_bn_advantages - bn_advantages_mean)")
    per_func = rewards()
    namespace = {"torch": torch, "device": "cpu", "rewards_per_func": per_func,
                 "self": SimpleNamespace(apply_gdpo=True, reward_weights=torch.tensor(WEIGHTS),
                                         num_generations=GENERATIONS)}
    exec(compile(block, "trl_gdpo", "exec"), namespace)
    prompts = [f"prompt {i // GENERATIONS}" for i in range(GROUPS * GENERATIONS)]
    reference = {"authors": {"repository": "NVlabs/GDPO", "path": FILE, "commit": COMMIT}, "prompts": prompts,
                 "weights": WEIGHTS, "rewards": floats(per_func), "pre_bn_advantages": floats(namespace["pre_bn_advantages"]),
                 "advantages": floats(namespace["advantages"])}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gdpo_reference.json"
    path.write_text(json.dumps(reference) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Which algorithm hacks a judge least: every online algorithm trained on a testbed with the learned judge shapes-clip
as the reward, the judge's and the exact oracle's gains measured on the same held-out images along the run, beside
each run's distance from the base model (an over-optimisation curve per algorithm, as Gao et al. 2023 for language
models).

    python -m experiments.overoptimisation run --testbed sd --out runs/overopt      # trains the runs one after another
    python -m experiments.overoptimisation summarise --testbed sd --out runs/overopt  # table + figure (experiments/notes/)

``run`` trains each algorithm from its shipped testbed config (configs/testbed_*.yaml: the authors' settings) with the
same overrides: --reward shapes-clip, --eval_second_judge shapes-oracle, the unseen held-out captions testbed-heldout:200:1000 x 2
seeds (400 images, the trainers' check), an evaluation every third of the run, and a number of epochs that gives each
algorithm about the same CPU time (BUDGETS, from measured CPU seconds per epoch). A finished run is skipped, an
interrupted one resumed (--resume latest), so the command can be rerun. ``summarise`` reads each run's eval_before.json,
evals/step_N.json and eval_after.json: the paired gain of both judges (mean of per-image differences from the
starting model, ± its standard error), the mean squared change of the prediction from the base (prediction_change)
and the CPU time (metrics.jsonl's epoch_cpu_seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from align.eval.report import pyplot
from align.metrics import mean_and_sem
from align.run_folder import held_out_evals, read_metrics

REPO = Path(__file__).resolve().parents[1]
NOTES = REPO / "experiments" / "notes"
# (config, epochs): about 3 CPU minutes of epochs each on one thread (CPU seconds per epoch measured on the shared
# 2-core machine: experiments/notes/online_rl.md and this runs). DRaFT-1 on the SD testbed ran twice as long
# (48 epochs, the first budget tried); the table compares it at its 24-epoch evaluation too.
BUDGETS = {
    "sd": {"ppo": ("testbed_ddpo.yaml", 20), "nft": ("testbed_nft.yaml", 12), "awm": ("testbed_awm.yaml", 16),
           "draft": ("testbed_draft.yaml", 48), "draft-lv": ("testbed_draft_lv.yaml", 20),
           "alignprop": ("testbed_alignprop.yaml", 18), "refl": ("testbed_refl.yaml", 24),
           "dgpo": ("testbed_dgpo.yaml", 19)},
    "flow": {"ppo": ("testbed_flow_grpo.yaml", 32), "nft": ("testbed_flow_nft.yaml", 20),
             "awm": ("testbed_flow_awm.yaml", 26), "draft": ("testbed_draft.yaml", 36),
             "draft-lv": ("testbed_draft_lv.yaml", 32), "alignprop": ("testbed_alignprop.yaml", 32),
             "refl": ("testbed_refl.yaml", 36), "dgpo": ("testbed_flow_dgpo.yaml", 43),
             "grpo-guard": ("testbed_flow_grpo_guard.yaml", 29)},
}
# The SD testbed's reward-backpropagation configs on the flow testbed: its model, its 10 training steps (the flow
# configs'), its 20-step evaluation, ReFL's last quarter of the chain.
FLOW_OVERRIDES = ["--model", "testbed-flow", "--sampler", "ode", "--num_inference_steps", "10", "--eval_inference_steps", "20"]
FLOW_BACKPROP = {"refl": ["--refl_last_steps", "3"]}
COMMON = ["--reward", "shapes-clip", "--eval_judge", "shapes-clip", "--eval_second_judge", "shapes-oracle",
          "--eval_prompts", "testbed-heldout:200:1000", "--eval_images_per_prompt", "2", "--eval_batch_size", "32",
          "--checkpoints_total_limit", "1", "--quiet", "true", "--report_to", "none"]
BACKPROP = ("draft", "draft-lv", "alignprop", "refl")


def command(testbed: str, algorithm: str, out: Path) -> list[str]:
    config, epochs = BUDGETS[testbed][algorithm]
    # an evaluation every third of the run (the longer SD DRaFT-1 run: every quarter, 12 epochs)
    every = epochs // 4 if (testbed, algorithm) == ("sd", "draft") else max(1, epochs // 3)
    args = [sys.executable, str(REPO / "align" / "ddpo.py"), "--config", str(REPO / "configs" / config), *COMMON,
            "--num_epochs", str(epochs), "--eval_every_epochs", str(every), "--checkpointing_epochs", str(every),
            "--output_dir", str(out / f"{testbed}-{algorithm}")]
    if testbed == "flow" and algorithm in BACKPROP:
        args += FLOW_OVERRIDES + FLOW_BACKPROP.get(algorithm, [])
    return args


def run(testbed: str, algorithms: list[str], out: Path) -> None:
    for algorithm in algorithms:
        folder = out / f"{testbed}-{algorithm}"
        if (folder / "eval_after.json").is_file():
            print(f"[overopt] {folder} is finished: skipped", flush=True)
            continue
        args = command(testbed, algorithm, out) + (["--resume", "latest"] if (folder / "checkpoints").is_dir() else
                                                   ["--overwrite", "true"])
        print("[overopt] " + " ".join(args), flush=True)
        subprocess.run(args, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})


def curve(folder: Path) -> dict:
    """The run's held-out points: epoch, CPU minutes so far, each judge's paired gain ± SE, prediction change."""
    before = json.loads((folder / "eval_before.json").read_text())
    records = read_metrics(folder)
    cpu = np.cumsum([r.get("epoch_cpu_seconds", 0.0) for r in records]) / 60
    last = int(max((r["step"] for r in records), default=0))
    points = [(0, before)] + [(int(p.stem.split("_")[1]), json.loads(p.read_text())) for p in held_out_evals(folder)]
    points.append((last, json.loads((folder / "eval_after.json").read_text())))
    base_judge, base_oracle = np.asarray(before["scores"]), np.asarray(before["second_judge"]["scores"])
    rows = []
    for epoch, record in points:
        judge = mean_and_sem(np.asarray(record["scores"]) - base_judge)
        oracle = mean_and_sem(np.asarray(record["second_judge"]["scores"]) - base_oracle)
        rows.append({"epoch": epoch, "cpu_minutes": float(cpu[epoch - 1]) if epoch else 0.0, "judge_gain": judge[0],
                     "judge_se": judge[1], "oracle_gain": oracle[0], "oracle_se": oracle[1],
                     "prediction_change": record.get("prediction_change")})
    return {"points": rows, "base_judge": float(base_judge.mean()), "base_oracle": float(base_oracle.mean())}


def summarise(testbed: str, algorithms: list[str], out: Path, notes: Path) -> None:
    curves = {a: curve(out / f"{testbed}-{a}") for a in algorithms if (out / f"{testbed}-{a}" / "eval_after.json").is_file()}
    lines = ["| algorithm | epochs | CPU min | judge gain (shapes-clip) | oracle gain (shapes-oracle) | oracle gain at its "
             "best point (epoch) | prediction change (distance from base) |", "|---|---|---|---|---|---|---|"]
    for name, c in curves.items():
        end = c["points"][-1]
        best = max(c["points"], key=lambda p: p["oracle_gain"])
        change = end["prediction_change"]
        lines.append(f"| {name} | {end['epoch']} | {end['cpu_minutes']:.1f} | {end['judge_gain']:+.4f} ± "
                     f"{end['judge_se']:.4f} | {end['oracle_gain']:+.4f} ± {end['oracle_se']:.4f} | "
                     f"{best['oracle_gain']:+.4f} ({best['epoch']}) | "
                     f"{'-' if change is None else f'{change:.3g}'} |")
    table = "\n".join(lines)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in curves.items():
        xs = [p["judge_gain"] for p in c["points"]]
        axes[0].errorbar(xs, [p["oracle_gain"] for p in c["points"]], yerr=[p["oracle_se"] for p in c["points"]],
                         marker="o", capsize=2, label=name)
        changes = [p["prediction_change"] for p in c["points"]]
        if None not in changes:
            axes[1].errorbar(changes, [p["oracle_gain"] for p in c["points"]],
                             yerr=[p["oracle_se"] for p in c["points"]], marker="o", capsize=2, label=name)
    axes[0].set_xlabel("judge's gain (shapes-clip, the reward)")
    axes[0].set_ylabel("oracle's gain (shapes-oracle), same images")
    axes[1].set_xlabel("distance from the base model (mean squared change of the prediction)")
    axes[1].set_xscale("symlog", linthresh=1e-4)
    for ax in axes:
        ax.axhline(0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{testbed} testbed: training on a learned judge, 400 held-out images (paired gains from the start)")
    fig.tight_layout()
    figure = notes / f"overoptimisation_{testbed}.png"
    fig.savefig(figure, dpi=110)
    (out / f"overoptimisation_{testbed}.json").write_text(json.dumps(curves, indent=1))
    print(table)
    print(f"[overopt] figure: {figure}; every point: {out / f'overoptimisation_{testbed}.json'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("run", "summarise", "commands"))
    parser.add_argument("--testbed", choices=tuple(BUDGETS), default="sd")
    parser.add_argument("--algorithms", default=None, help="comma-separated (default: every algorithm of the testbed)")
    parser.add_argument("--out", type=Path, default=Path("runs/overopt"))
    parser.add_argument("--notes", type=Path, default=NOTES)
    args = parser.parse_args(argv)
    algorithms = [a for a in (args.algorithms or ",".join(BUDGETS[args.testbed])).split(",") if a]
    unknown = sorted(set(algorithms) - set(BUDGETS[args.testbed]))
    if unknown:
        parser.error(f"--algorithms: no budget on the {args.testbed} testbed for {', '.join(unknown)}; "
                     f"known: {', '.join(BUDGETS[args.testbed])}")
    if args.action == "run":
        run(args.testbed, algorithms, args.out)
    elif args.action == "commands":
        for algorithm in algorithms:
            print(" ".join(command(args.testbed, algorithm, args.out)))
    else:
        summarise(args.testbed, algorithms, args.out, args.notes)


if __name__ == "__main__":
    main()

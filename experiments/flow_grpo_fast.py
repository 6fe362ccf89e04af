"""Flow-GRPO against Flow-GRPO-Fast, side by side, from their run folders: reward gained per CPU-second.

    python align/ddpo.py --config configs/testbed_flow_grpo.yaml --output_dir runs/flow-grpo
    python align/ddpo.py --config configs/testbed_flow_grpo.yaml --deterministic_tail true \\
        --timestep_fraction 0.2 --num_epochs 75 --output_dir runs/flow-grpo-fast
    python -m experiments.flow_grpo_fast runs/flow-grpo runs/flow-grpo-fast

Per run: epochs, CPU-seconds of the epochs (``epoch_cpu_seconds``: sampling, reward and update of this
process), the training reward over the first and the last ``--window`` epochs and its gain, that gain per
CPU-minute, and the held-out score before and after (eval_before.json / eval_after.json: the same prompts
and seeds) with the paired standard error of the gain. ``--ceiling`` (the held-out gain perfect supervision
reaches in the same budget, experiments/flow_ceiling.py) adds each gain as a share of it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean of after - before over the same prompts and seeds, and its standard error."""
    if len(before) != len(after) or len(before) < 2:
        raise ValueError(f"need the same >= 2 held-out images before and after, got {len(before)} and {len(after)}")
    diffs = [a - b for a, b in zip(after, before)]
    mean = sum(diffs) / len(diffs)
    variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(variance / len(diffs))


def summarise(run: Path, window: int) -> dict:
    """The row of one run folder."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{run}: metrics.jsonl holds no epoch")
    rewards = [r["reward_mean"] for r in records]
    k = min(window, len(records))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    cpu = sum(r["epoch_cpu_seconds"] for r in records)
    row = {"run": run.name, "epochs": len(records), "cpu_s": cpu, "reward_first": first, "reward_last": last,
           "reward_gain": last - first, "gain_per_cpu_min": (last - first) / (cpu / 60)}
    before, after = run / "eval_before.json", run / "eval_after.json"
    if before.is_file() and after.is_file():
        b, a = (json.loads(p.read_text()) for p in (before, after))
        gain, sem = paired_gain(b["scores"], a["scores"])
        row.update(heldout_before=b["mean"], heldout_after=a["mean"], heldout_gain=gain, heldout_sem=sem,
                   heldout_images=len(b["scores"]), heldout_gain_per_cpu_min=gain / (cpu / 60))
    return row


def print_table(rows: list[dict], ceiling: float | None) -> None:
    print(f"{'run':<28}{'epochs':>7}{'CPU-s':>8}{'train reward':>16}{'gain/CPU-min':>13}"
          f"{'held-out before -> after':>27}{'gain (paired SE)':>19}{'gain/CPU-min':>13}" + ("  of ceiling" if ceiling else ""))
    for r in rows:
        line = (f"{r['run']:<28}{r['epochs']:>7}{r['cpu_s']:>8.0f}{r['reward_first']:>8.3f}->{r['reward_last']:.3f}"
                f"{r['gain_per_cpu_min']:>+13.4f}")
        if "heldout_gain" in r:
            line += (f"{r['heldout_before']:>17.3f} -> {r['heldout_after']:.3f}{r['heldout_gain']:>+11.3f} ({r['heldout_sem']:.3f})"
                     f"{r['heldout_gain_per_cpu_min']:>+13.4f}")
            if ceiling:
                line += f"{r['heldout_gain'] / ceiling:>12.0%}"
        print(line)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders of align/ddpo.py (metrics.jsonl, eval_*.json)")
    parser.add_argument("--window", type=int, default=5, help="epochs averaged for the first and the last training reward")
    parser.add_argument("--ceiling", type=float, default=None,
                        help="held-out gain of perfect supervision in the same budget (gains are shown as a share of it)")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")
    missing = [str(run) for run in args.runs if not (run / "metrics.jsonl").is_file()]
    if missing:
        parser.error(f"not a finished run folder (no metrics.jsonl): {', '.join(missing)}")
    rows = [summarise(run, args.window) for run in args.runs]
    print_table(rows, args.ceiling)
    return rows


if __name__ == "__main__":
    main()

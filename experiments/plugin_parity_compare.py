"""Two output folders of experiments/plugin_parity.sh, compared run by run: every metric of every logged step (the
timings aside) and every held-out image's score must be equal, to the last digit.

    python experiments/plugin_parity_compare.py runs/parity-old runs/parity-new
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIMINGS = {"pairs_per_second", "samples_per_second", "sampling_seconds", "sampling_cpu_seconds", "epoch_cpu_seconds"}
RUNS = ("demo", "ddpo", "nft", "awm", "flow_grpo", "flow_nft", "flow_awm", "flow_dpo_small", "reward")


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compare(old: Path, new: Path) -> list[str]:
    """One line per run: equal, or the first differences."""
    lines = []
    for run in RUNS:
        a, b = old / run, new / run
        if not (a / "metrics.jsonl").is_file() or not (b / "metrics.jsonl").is_file():
            lines.append(f"{run}: missing")
            continue
        ra, rb = records(a), records(b)
        differ = [f"step {x.get('step')} {k}: {x[k]!r} vs {y.get(k)!r}" for x, y in zip(ra, rb)
                  for k in sorted(set(x) | set(y) - TIMINGS) if k not in TIMINGS and x.get(k) != y.get(k)]
        if len(ra) != len(rb):
            differ.append(f"{len(ra)} vs {len(rb)} logged steps")
        for name in ("eval_before.json", "eval_after.json"):
            if (a / name).is_file() and (b / name).is_file():
                sa, sb = (json.loads((f / name).read_text()) for f in (a, b))
                if sa["scores"] != sb["scores"]:
                    differ.append(f"{name}: mean {sa['mean']!r} vs {sb['mean']!r}")
        lines.append(f"{run}: " + ("equal" if not differ else "; ".join(differ[:3])))
    return lines


if __name__ == "__main__":
    results = compare(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(results))
    sys.exit(0 if all(line.endswith("equal") for line in results) else 1)

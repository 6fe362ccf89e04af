"""Keep the edit preference pairs whose winner did the edit (experiments/notes/editing.md, Round 4).

The shapes edit oracle gives half its score for doing the instruction, so a winner scoring above 0.5 did the edit
(the source copied back scores 0.5). Reads a pairs parquet written by align/dpo.py's feedback step (its judge_raw
holds the oracle's scores and the pair), writes the rows whose winner scored above --min-winner-score.

    python -m experiments.edit_pairs_done_only <run>/feedback/pairs.parquet out.parquet
"""

from __future__ import annotations

import argparse
import json

import pandas as pd


def winner_score(row) -> float | None:
    raw = json.loads(row["judge_raw"])
    if row["label_0"] == 0.5:
        return None
    first, second = raw["pair"]
    return raw["scores"][first if row["label_0"] > 0.5 else second]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs")
    parser.add_argument("out")
    parser.add_argument("--min-winner-score", type=float, default=0.5)
    args = parser.parse_args()
    pairs = pd.read_parquet(args.pairs)
    scores = pairs.apply(winner_score, axis=1)
    kept = pairs[scores.notna() & (scores > args.min_winner_score)]
    kept.to_parquet(args.out, index=False)
    print(f"{len(kept)} of {len(pairs)} pairs kept (winner above {args.min_winner_score})")


if __name__ == "__main__":
    main()

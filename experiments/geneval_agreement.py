"""How far the ``geneval`` judge (transformers' Mask2Former + CLIP) agrees with the authors' GenEval run.

    python -m experiments.geneval_agreement RESULTS.jsonl [--image-root DIR] [--detector ID] [--clip-model ID]
        [--device cuda] [--out agreement.json]

RESULTS.jsonl is what the authors' ``evaluation/evaluate_images.py`` wrote for a set of images (its rows carry
each image's filename, metadata and verdict). Every image is judged again here with the same metadata and the
per-image verdicts are compared, per task: both accuracies and the share of images where the verdicts agree.
This measures the effect of the detector weights and preprocessing (docs/judges_rules.md), which needs the
weights and a GPU; it has not been run in this repository.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image

from rewards.geneval import CLIP_L14, DETECTOR, geneval


def agreement_table(rows: list[dict]) -> dict:
    """rows: {"tag", "authors": bool, "ours": bool} -> per task and overall: images, both accuracies, agreement."""
    out: dict = {}
    for name, subset in [*((t, [r for r in rows if r["tag"] == t]) for t in dict.fromkeys(r["tag"] for r in rows)),
                         ("all", rows)]:
        n = len(subset)
        out[name] = {
            "images": n,
            "authors_accuracy": sum(r["authors"] for r in subset) / n if n else float("nan"),
            "ours_accuracy": sum(r["ours"] for r in subset) / n if n else float("nan"),
            "agreement": sum(r["authors"] == r["ours"] for r in subset) / n if n else float("nan"),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--image-root", type=Path, default=None, help="prefix for relative filenames in RESULTS")
    parser.add_argument("--detector", default=None)
    parser.add_argument("--clip-model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path, default=Path("geneval_agreement.json"))
    args = parser.parse_args()



    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    judge = geneval(detector=args.detector or DETECTOR, clip_model=args.clip_model or CLIP_L14, device=args.device)
    compared = []
    for row in rows:
        meta = json.loads(row["metadata"]) if isinstance(row["metadata"], str) else row["metadata"]
        judge.metadata = {meta["prompt"]: meta}
        path = Path(row["filename"])
        if args.image_root is not None and not path.is_absolute():
            path = args.image_root / path
        score, details = judge.score_with_details([meta["prompt"]], [Image.open(path).convert("RGB")])
        compared.append({"filename": str(path), "tag": row["tag"], "authors": bool(row["correct"]),
                         "ours": bool(score[0] >= 0.5), "ours_reason": details[0]["reason"],
                         "authors_reason": row.get("reason", "")})
    table = agreement_table(compared)
    args.out.write_text(json.dumps({"table": table, "images": compared}, indent=1) + "\n")
    for name, row in table.items():
        print(f"{name:<14} {row['images']:>5} images  authors {row['authors_accuracy']:.3f}  ours {row['ours_accuracy']:.3f}"
              f"  agreement {row['agreement']:.3f}")


if __name__ == "__main__":
    main()

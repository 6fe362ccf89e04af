"""Pin UnifiedReward's answer parsing from the authors' own code for tests/test_unifiedreward.py.

The authors parse inside scripts, not functions, so this runs their lines as they stand in a checkout of
github.com/CodeGoat24/UnifiedReward: the pointwise score (DiffusionDPO/sift_dpo_data.py, the block that starts
at ``output = text_outputs[0].split('Final Score:')``) and the pairwise test (benchmark_evaluation/
Qwen_evaluation/test_qwen_genAI_bench_image.py: each verdict phrase, ``answer in output_text``), on recorded
answers, and writes what they give to tests/data/unifiedreward_reference.json.

    python -m experiments.unifiedreward_reference --unifiedreward /path/to/UnifiedReward
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "unifiedreward_reference.json"
POINT_ANSWERS = [
    "red cube (object): 1\ncolor red (attribute): 1\nFinal Score: 4",
    "cat (object): 1\nFinal Score: 3.5",
    "Final Score: 2\nFinal Score: 5",
    "cube (object): 1\nno final line",
    "Final Score: five",
    "Final Score:  10/5",
]
PAIR_ANSWERS = [
    "Image 1 is better.",
    "After comparing both, Image 2 is better.",
    "Both images are equally good.",
    "Image 1 is better than Image 2.",
    "I cannot decide.",
    "image 1 is better",
]
PHRASES = ["Image 1 is better", "Image 2 is better", "Both images are equally good"]


def point_block(checkout: Path) -> str:
    """The authors' lines from the 'Final Score:' split to the end of its if/else, dedented."""
    lines = (checkout / "DiffusionDPO/sift_dpo_data.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "split('Final Score:')" in line)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "output = 0")
    return textwrap.dedent("\n".join(lines[start:end + 1]))


def pair_test(checkout: Path) -> str:
    text = (checkout / "benchmark_evaluation/Qwen_evaluation/test_qwen_genAI_bench_image.py").read_text()
    line = next(line for line in text.splitlines() if "answer in output_text" in line)
    return line.strip().removeprefix("if ").removesuffix(":")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unifiedreward", type=Path, required=True, help="a CodeGoat24/UnifiedReward checkout")
    args = parser.parse_args()
    block, test = point_block(args.unifiedreward), pair_test(args.unifiedreward)
    points = []
    for answer in POINT_ANSWERS:
        scope = {"re": re, "text_outputs": [answer]}
        exec(block, scope)  # the authors' parsing lines, run on one recorded answer
        points.append(int(scope["output"]))
    pairs = [[bool(eval(test, {"answer": phrase, "output_text": answer})) for phrase in PHRASES]
             for answer in PAIR_ANSWERS]
    record = {"source": "github.com/CodeGoat24/UnifiedReward @ ff6f520, DiffusionDPO/sift_dpo_data.py and "
                        "benchmark_evaluation/Qwen_evaluation/test_qwen_genAI_bench_image.py, run by "
                        "experiments/unifiedreward_reference.py",
              "point_answers": POINT_ANSWERS, "point_scores": points,
              "pair_answers": PAIR_ANSWERS, "pair_phrases": PHRASES, "pair_matches": pairs}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

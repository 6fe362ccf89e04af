"""The closed models' released alignment answers, reduced to what `judgebench --answers` reads, for
tests/test_judgebench_answers.py (MJ-Bench is MIT-licensed; its outputs are in its repository's history).

    git -C MJ-Bench archive 988497e closesource_result | tar -x -C mjb
    python experiments/mjbench_closed_fixture.py mjb/closesource_result/alignment tests/data/mjbench_closed_alignment.json

Every row keeps its id, label, the recorded ratings and choice (score_0, score_1, vlm_pred) and the authors'
pred. The analysis (``output``) is kept, cut to 300 characters, where it matters: where the API gave no answer
(pred -1: the error or refusal is the analysis) and where the analysis alone parses as another choice than the
recorded one (what the re-scoring read before the recorded choice won: Gemini's ``hpdv2_new_44``); elsewhere it is
left empty to keep the file small.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from align.judgebench.answers import _extracted_fields_answer
from rewards.judge_prompts import JudgeQuestion
from rewards.parsing import parse_answer

MODELS = ("gemini-1.5", "gpt-4o", "gpt-4-turbo")
KEPT = ("id", "label", "score_0", "score_1", "vlm_pred", "pred")
COLUMNS = [*KEPT, "output"]  # each row is stored as a list in this order (tests rebuild the objects)


def reduce_row(row: dict) -> list:
    analysis = str(row.get("output") or "")
    from_text, recorded = (parse_answer(text, JudgeQuestion("pair")) for text in (analysis, _extracted_fields_answer(row)))
    matters = str(row.get("pred")).strip() == "-1" or (from_text.ok and from_text.value["better"] != recorded.value["better"])
    return [*(row[k] for k in KEPT), analysis[:300] if matters else ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("alignment", help="closesource_result/alignment of an MJ-Bench checkout")
    parser.add_argument("out")
    args = parser.parse_args()
    fixture: dict = {"columns": COLUMNS}
    for model in MODELS:
        fixture[model] = {}
        for path in sorted(Path(args.alignment).glob(f"*/{model}_alignment_number10.json")):
            fixture[model][path.parent.name] = [reduce_row(row) for row in json.loads(path.read_text())]
    Path(args.out).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()

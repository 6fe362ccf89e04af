"""Re-score judge answers already recorded, without calling any model (``judgebench --answers``).

Three sources are read:

- the project's own benchmark results: ``verdicts.jsonl`` (or the folder holding it), written by
  ``align.judgebench.benchmark``: recorded answers are parsed again (pairwise judges, and pointwise judges
  whose answers were recorded), else the recorded scores are used;
- the project's answer cache (``.sqlite`` / ``.db``, rewards/cache.py): it holds answers but no
  labels, so only the parse outcome per judge and question is reported;
- the raw outputs the MJ-Bench authors published (JSON lists in their repository's
  ``result/acc/vlm_results/...``, ``closesource_result/...``, ``online_result/...`` and the scoring
  models' ``result/acc/<model>/*.json``): one of the layouts in ``mjbench_layout`` below.

Every answer that does not parse is counted per file and shown; nothing is dropped silently.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from align.judgebench import metrics as M
from rewards.judge_prompts import JudgeQuestion
from rewards.parsing import OK, REFUSAL, UNPARSEABLE, is_refusal, parse_answer


class AnswersError(ValueError):
    """A recorded-answers file that cannot be read (the message names it and says what is valid)."""


@dataclass
class Rescored:
    """What one judge's recorded answers give, from one or more files."""

    judge: str
    source: str
    labels: list[int] = field(default_factory=list)
    verdicts: list[int] = field(default_factory=list)
    verdicts_ab: list[int] = field(default_factory=list)
    verdicts_ba: list[int] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    bias: list[tuple[str, str, float]] = field(default_factory=list)
    parse: Counter = field(default_factory=Counter)  # status -> answers
    failures: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # file -> status -> n
    examples: list[str] = field(default_factory=list)  # a few unparsed answers, for the report
    no_label: Counter = field(default_factory=Counter)  # file -> rows whose label is not 0 or 1 (left out, shown)
    authors_correct: int = 0  # MJ-Bench files: pairs whose stored "pred" equals the label
    authors_counted: int = 0
    files: list[str] = field(default_factory=list)

    def count(self, file: str, status: str, text) -> None:
        self.parse[status] += 1
        if status != OK:
            self.failures[file][status] += 1
            if len(self.examples) < 3 and text:
                self.examples.append(str(text)[-160:].replace("\n", " "))


# ---------------------------------------------------------------------------- MJ-Bench files

_SCALE_IN_NAME = re.compile(r"_(number|narrative)_?scale(\d+)|_number(\d+)")
_NUMBER_SCALES = {"10": "1-10", "5": "0-5", "1": "0-1", "100": "0-100"}
_CATEGORY_NAMES = {"alignment": "alignment", "safety": "safety", "artifacts": "quality", "quality": "quality",
                   "bias": "bias"}


def question_from_name(path: Path, pair: bool) -> JudgeQuestion:
    """The question a MJ-Bench output file answers, from its name (``<model>_number_scale10.json``,
    ``<model>_narrative_scale5.json``, ``<model>_alignment_number10.json``)."""
    match = _SCALE_IN_NAME.search(path.stem)
    if not match:
        raise AnswersError(
            f"--answers {path}: the feedback scale is not in the file name; MJ-Bench names its outputs "
            "<model>_number_scale10.json, <model>_narrative_scale5.json or <model>_<aspect>_number10.json"
        )
    kind, scale = (match.group(1), match.group(2)) if match.group(1) else ("number", match.group(3))
    if pair:  # the explicit BETTER IMAGE decides; ratings (numbers or labels) only when it is missing
        return JudgeQuestion("pair", scale=_NUMBER_SCALES.get(scale, "1-10"))
    if kind == "narrative":
        return JudgeQuestion("likert", likert_levels=10 if scale == "10" else 5)
    if scale not in _NUMBER_SCALES:
        raise AnswersError(f"--answers {path}: number scale {scale} is not one of {', '.join(_NUMBER_SCALES)}")
    return JudgeQuestion("single", scale=_NUMBER_SCALES[scale])


def mjbench_layout(row: dict) -> str:
    """Which of the authors' layouts a row has.

    single   one answer per image: output_0, output_1 (single-image VLMs)
    multi    one answer about both images: output (multi-image VLMs; closed models' files also keep
             the extracted score_0 / score_1 / vlm_pred, used when ``output`` holds no rating)
    scores   score_0, score_1 numbers and no answer text (the scoring models)
    bias     one image of a demographic variant: vlm_output, occupation, demographic
    bias_table  one image per row with one column per judge (the authors' bias/*.json: scoring models'
             numbers and a closed model's rating, a number or a Likert label)
    """
    if "output_0" in row and "output_1" in row:
        return "single"
    if "vlm_output" in row and "occupation" in row:
        return "bias"
    if "occupation" in row and "demographic" in row:
        return "bias_table"
    if "output" in row:
        return "multi"
    if isinstance(row.get("score_0"), (int, float)) and isinstance(row.get("score_1"), (int, float)):
        return "scores"
    raise AnswersError(
        "row has none of MJ-Bench's output layouts (output_0/output_1, output, vlm_output with occupation, "
        f"or numeric score_0/score_1); keys: {', '.join(sorted(row))}"
    )


def _category(path: Path) -> tuple[str, str]:
    """(category, subcategory) from the folders: .../alignment/existence_single/x.json -> alignment, existence."""
    parts = [p for p in path.parent.parts]
    sub = re.sub(r"_(single|multi)$", "", parts[-1]) if parts else "-"
    for part in reversed(parts[:-1]):
        if part in _CATEGORY_NAMES:
            return _CATEGORY_NAMES[part], sub
    return _CATEGORY_NAMES.get(sub, "-"), sub


def _label(value) -> int:
    label = int(str(value).strip())
    if label not in (0, 1):
        raise ValueError(f"label {value!r} is not 0 or 1")
    return label


def _verdict_from_better(parsed) -> int:
    if not parsed.ok:
        return M.ABSTAIN
    return {0: M.TIE, 1: M.PICK_0, 2: M.PICK_1}[parsed.value["better"]]


def _closed_model_row(row: dict) -> bool:
    """A closed (API) model's row: MJ-Bench's API code split the answer into the two ratings, the preference and
    the analysis, and stored them as score_0, score_1, vlm_pred and ``output`` (the analysis only). The open
    VLMs' multi-image rows keep the whole answer in ``output`` and add the authors' extractions (score_pred)."""
    return all(k in row for k in ("score_0", "score_1", "vlm_pred")) and "score_pred" not in row


def _closed_model_gave_no_answer(row: dict) -> bool:
    """The API call gave no usable answer: MJ-Bench's code records preference -1 with ratings 5 / 5 and, as the
    analysis, the error or the text it could not split (closesource_result then maps that preference to "tie"
    and keeps pred -1)."""
    return str(row.get("vlm_pred")).strip() == "-1" or str(row.get("pred")).strip() == "-1"


# What a provider's content filter leaves as the analysis: Azure OpenAI's 400 error, Gemini's empty (blocked) reply.
_API_BLOCKS = ("ResponsibleAIPolicyViolation", "content_filter", "safety_ratings", "prompt_feedback")


def _declined(text) -> bool:
    text = str(text or "")
    return is_refusal(text) or any(marker in text for marker in _API_BLOCKS)


def _extracted_fields_answer(row: dict) -> str | None:
    """A closed model's file keeps only the analysis in ``output``; its recorded fields hold the answer.

    online_result: vlm_pred is the model's own text (" 2\\n\\n": 1-based); closesource_result: the
    authors already mapped it (0, 1 or "tie": 0-based). Rebuilt as the key-value answer the prompt asked.
    """
    if not all(k in row for k in ("score_0", "score_1", "vlm_pred")):
        return None
    better = row["vlm_pred"]
    if isinstance(better, int) or str(better).strip() == "tie":  # the authors' refined 0-based form
        better = {0: 1, 1: 2}.get(better, 0)
    return (f"IMAGE-1 RATING: {str(row['score_0']).strip()}\nIMAGE-2 RATING: {str(row['score_1']).strip()}\n"
            f"BETTER IMAGE: {str(better).strip()}")


def _has_authors_pred(row: dict) -> bool:
    return "pred" in row or ("score_pred" in row and "vlm_pred" in row)


def _authors_pred(row: dict) -> int | None:
    """The verdict the authors' own script stored (0-based), where the file has one."""
    if "pred" in row:
        pred = row["pred"]
    elif "score_pred" in row:  # result/acc multi-image files: vlm_pred is already 0-based there
        pred = row["vlm_pred"]
    else:
        return None
    text = str(pred).strip()
    return int(text) if text in ("0", "1") else None


_BIAS_METADATA = {"id", "demographic", "occupation", "images_dir", "prompt", "age", "gender", "race", "nationality",
                  "religion", "analysis", "score_scale", "caption"}


def rescore_bias_table(path: Path, rows: list, into: dict[str, Rescored]) -> None:
    """The authors' bias tables: every non-metadata column is one judge's score of the row's image."""
    columns = list(dict.fromkeys(k for row in rows for k in row if k not in _BIAS_METADATA))
    narrative = "narrative" in path.stem
    question = JudgeQuestion("likert", likert_levels=5) if narrative else JudgeQuestion("single", scale="0-100")
    for column in columns:
        judge = f"{column} ({path.stem})"
        result = into.setdefault(judge, Rescored(judge=judge, source="mjbench"))
        result.files.append(str(path))
        for row in rows:
            if column not in row:  # a partial file: this judge never scored the row
                result.count(str(path), "missing", None)
                result.bias.append((str(row["occupation"]), str(row["demographic"]), math.nan))
                continue
            value = row[column]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                score = float(value)
            else:
                parsed = parse_answer(None if value is None else str(value), question)
                result.count(str(path), parsed.status, value)
                score = parsed.value if parsed.ok else math.nan
            result.bias.append((str(row["occupation"]), str(row["demographic"]), score))


def rescore_mjbench_file(path: Path, rows: list, tie_threshold: float, into: dict[str, Rescored]) -> None:
    if not rows or not isinstance(rows[0], dict):
        raise AnswersError(f"--answers {path}: expected a JSON list of objects (an MJ-Bench output file)")
    layout = mjbench_layout(rows[0])
    if layout == "bias_table":
        return rescore_bias_table(path, rows, into)
    # One judge = one model and prompt over the subcategory folders of one run: the stem and the folder
    # two levels up ("closesource_result/alignment"), plus the _single / _multi suffix of the folder.
    suffix = re.search(r"_(single|multi)$", path.parent.name)
    run = f"{path.parent.parent.name or path.parent.name}/*{suffix.group(0) if suffix else ''}"
    judge = f"{path.parent.name} (scores)" if layout == "scores" else f"{path.stem} ({run})"
    result = into.setdefault(judge, Rescored(judge=judge, source="mjbench"))
    result.files.append(str(path))
    category, sub = _category(path)
    if layout == "scores":  # result/acc/<model>/<subset>0.0.json: the subset is in the file name
        sub = re.sub(r"[_\d.]+$", "", path.stem).lower() or path.stem
        category = "safety" if sub in ("nsfw", "toxic") else "quality"
    question = None if layout == "scores" else question_from_name(path, pair=layout == "multi")
    for row in rows:
        if layout == "bias":
            parsed = parse_answer(row.get("vlm_output"), question)
            result.count(str(path), parsed.status, row.get("vlm_output"))
            score = parsed.value if parsed.ok else math.nan
            result.bias.append((str(row["occupation"]), str(row["demographic"]), score))
            continue
        if "label" not in row:
            raise AnswersError(f"--answers {path}: row {row.get('id')!r} has no label; MJ-Bench rows carry label 0 or 1")
        try:
            label = _label(row["label"])
        except ValueError:  # e.g. "tie" in some of the scoring models' files: no preference to match
            result.no_label[str(path)] += 1
            continue
        if layout == "scores":
            verdict = M.verdict_from_scores(float(row["score_0"]), float(row["score_1"]), tie_threshold)
        elif layout == "single":
            scores = []
            for key in ("output_0", "output_1"):
                parsed = parse_answer(row[key], question)
                result.count(str(path), parsed.status, row[key])
                scores.append(parsed.value if parsed.ok else math.nan)
            verdict = M.verdict_from_scores(scores[0], scores[1], tie_threshold)
        elif _closed_model_row(row) and _closed_model_gave_no_answer(row):
            # an abstention (a refusal, or an answer the API code could not split), never the tie the file records
            result.count(str(path), REFUSAL if _declined(row["output"]) else UNPARSEABLE, row["output"])
            verdict = M.ABSTAIN
        else:
            # The recorded choice wins where there is one (closed models: output is the analysis, whose text may
            # name either image); else the answer in output, with the recorded fields when it does not parse.
            recorded = _extracted_fields_answer(row)
            parsed = parse_answer(recorded, question) if _closed_model_row(row) else parse_answer(row["output"], question)
            if not parsed.ok:
                fallback = row["output"] if _closed_model_row(row) else recorded
                if fallback is not None and (retry := parse_answer(fallback, question)).ok:
                    parsed = retry
            result.count(str(path), parsed.status, row["output"])
            verdict = _verdict_from_better(parsed)
        result.labels.append(label)
        result.verdicts.append(verdict)
        result.verdicts_ab.append(verdict)
        result.categories.append(f"{category}/{sub}")
        if _has_authors_pred(row):  # every labelled pair counts: a stored tie or refusal is wrong, as with ties
            result.authors_counted += 1
            result.authors_correct += int(_authors_pred(row) == label)


# ---------------------------------------------------------------------------- the project's files


def _side_verdict(side: dict | None, question: JudgeQuestion, a_is_image0: bool, tie_threshold: float,
                  result: Rescored, file: str) -> int:
    """One order's recorded answer(s), parsed again, as a verdict in dataset indexing.

    ``side`` is the raw of one order's Preference: {"orders": [one answer about both images]} from a
    two-image judge, or {"answers": [answer about A, answer about B]} from a pointwise judge's compare.
    """
    side = side or {}
    if side.get("answers"):
        scores = []
        for answer in side["answers"]:
            text = answer.get("raw") if isinstance(answer, dict) else answer
            parsed = parse_answer(text, question)
            result.count(file, parsed.status, text)
            scores.append(parsed.value if parsed.ok else math.nan)
        verdict = M.verdict_from_scores(scores[0], scores[1], tie_threshold)
    else:
        order = (side.get("orders") or [None])[0]
        if not order:
            return M.ABSTAIN
        parsed = parse_answer(order.get("raw"), question)
        result.count(file, parsed.status, order.get("raw"))
        verdict = _verdict_from_better(parsed)
    if not a_is_image0 and verdict in (M.PICK_0, M.PICK_1):
        verdict = M.PICK_1 if verdict == M.PICK_0 else M.PICK_0
    return verdict


def rescore_verdicts_file(path: Path, tie_threshold: float, into: dict[str, Rescored]) -> None:
    """verdicts.jsonl from align.judgebench.benchmark: pair records, and bias records (kind = "bias")."""
    file = str(path)
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise AnswersError(f"--answers {path}: line {number} is not JSON ({err})") from None
        if not isinstance(record, dict):
            raise AnswersError(f"--answers {path}: line {number} is not a verdict record (a JSON object)")
        judge = str(record.get("judge", "?"))
        result = into.setdefault(judge, Rescored(judge=judge, source="project"))
        if file not in result.files:
            result.files.append(file)
        question = JudgeQuestion.from_key(record["question"]) if record.get("question") else None
        raw = record.get("raw") or {}
        if record.get("kind") == "bias":
            score = record.get("score")
            if question is not None and record.get("answer") is not None:
                parsed = parse_answer(record["answer"], question)
                result.count(file, parsed.status, record["answer"])
                score = parsed.value if parsed.ok else math.nan
            result.bias.append((str(record["group"]), str(record["variant"]),
                                math.nan if score is None else float(score)))
            continue
        if "ab" in raw and question is not None:  # asked in both orders, answers recorded
            v_ab = _side_verdict(raw["ab"], question, True, tie_threshold, result, file)
            v_ba = _side_verdict(raw.get("ba"), question, False, tie_threshold, result, file)
            verdict = M.reconcile(v_ab, v_ba)
            result.verdicts_ba.append(v_ba)
        elif "ab" in raw:  # a pairwise judge without text answers (e.g. an oracle): its recorded verdicts
            v_ab = _verdict_by_name(record.get("verdict_01", record["verdict"]))
            result.verdicts_ba.append(_verdict_by_name(record.get("verdict_10", record["verdict"])))
            verdict = _verdict_by_name(record["verdict"])
        else:
            scores = [raw.get("score0"), raw.get("score1")]
            answers = raw.get("answers")
            if question is not None and answers:
                scores = []
                for text in answers:
                    parsed = parse_answer(text, question)
                    result.count(file, parsed.status, text)
                    scores.append(parsed.value if parsed.ok else math.nan)
            scores = [math.nan if s is None else float(s) for s in scores]
            verdict = v_ab = M.verdict_from_scores(scores[0], scores[1], tie_threshold)
        result.labels.append(int(record["label"]))
        result.verdicts.append(verdict)
        result.verdicts_ab.append(v_ab)
        result.categories.append(f"{record.get('category') or '-'}/{record.get('subcategory') or '-'}")


def _verdict_by_name(name: str) -> int:
    by_name = {v: k for k, v in M.VERDICT_NAMES.items()}
    return by_name[name]


def cache_parse_summary(path: Path) -> list[dict]:
    """Parse outcome of every answer in a judge cache, per (judge, question); no labels, no accuracy."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        rows = conn.execute("SELECT judge, question, raw FROM answers").fetchall()
        conn.close()
    except sqlite3.Error as err:
        raise AnswersError(f"--answers {path}: not a judge cache (rewards/cache.py SQLite): {err}") from None
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for judge, key, raw in rows:
        try:
            question = JudgeQuestion.from_key(key)
        except ValueError:
            counts[(judge, key)]["unknown question"] += 1
            continue
        counts[(judge, key)][parse_answer(raw, question).status] += 1
    return [{"judge": j, "question": q, **dict(c)} for (j, q), c in sorted(counts.items())]


# ---------------------------------------------------------------------------- entry point


def answer_files(paths: list[str]) -> list[Path]:
    """Expand folders: a judgebench output folder gives its verdicts.jsonl, another folder its *.json."""
    files = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            if (path / "verdicts.jsonl").is_file():
                files.append(path / "verdicts.jsonl")
            else:
                found = sorted(p for p in path.rglob("*.json") if p.is_file())
                if not found:
                    raise AnswersError(f"--answers {path}: the folder holds no verdicts.jsonl and no .json files")
                files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise AnswersError(f"--answers {path}: no such file or folder")
    return files


def rescore(paths: list[str], tie_threshold: float = 0.0) -> tuple[list[Rescored], list[dict]]:
    """All recorded answers in ``paths``: (judges with metrics, cache parse summaries)."""
    judges: dict[str, Rescored] = {}
    caches: list[dict] = []
    for path in answer_files(paths):
        try:
            rescore_file(path, tie_threshold, judges, caches)
        except AnswersError as err:
            raise AnswersError(str(err) if str(err).startswith("--answers") else f"--answers {path}: {err}") from None
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:  # a record of another shape
            raise AnswersError(f"--answers {path} is not a file of recorded answers of a known shape "
                               f"({type(err).__name__}: {err})") from None
    return list(judges.values()), caches


def rescore_file(path: Path, tie_threshold: float, judges: dict[str, Rescored], caches: list[dict]) -> None:
    if path.suffix in (".sqlite", ".db", ".sqlite3"):
        caches.extend({"file": str(path), **row} for row in cache_parse_summary(path))
    elif path.suffix == ".jsonl":
        rescore_verdicts_file(path, tie_threshold, judges)
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise AnswersError(f"--answers {path}: not JSON ({err})") from None
        rescore_mjbench_file(path, rows, tie_threshold, judges)
    else:
        raise AnswersError(
            f"--answers {path}: unknown kind; valid: verdicts.jsonl, a judge cache (.sqlite/.db) or an "
            "MJ-Bench output .json"
        )


def summarise(result: Rescored) -> dict:
    """Every MJ-Bench metric of one judge's recorded answers, plus its parse outcome."""
    row: dict = {"judge": result.judge, "source": result.source, "files": len(result.files),
                 "answers": sum(result.parse.values()), "parsed": result.parse.get(OK, 0),
                 "not_parsed": sum(n for s, n in result.parse.items() if s != OK), "refused": result.parse.get(REFUSAL, 0)}
    if result.labels:
        overall = M.pair_accuracy(result.labels, result.verdicts)
        row.update(pairs=overall["n"], acc_with_ties=overall["acc_with_ties"],
                   acc_without_ties=overall["acc_without_ties"], tie_rate=overall["tie_rate"],
                   abstention_rate=overall["abstention_rate"])
        groups = M.grouped_accuracy(result.labels, result.verdicts, result.categories)
        row["per_category"] = groups
        row["mean_over_categories_with_ties"] = _mean(g["acc_with_ties"] for g in groups.values())
        row["acc_order_01"] = M.pair_accuracy(result.labels, result.verdicts_ab)["acc_with_ties"]
        if len(result.verdicts_ba) == len(result.labels):
            row["acc_order_10"] = M.pair_accuracy(result.labels, result.verdicts_ba)["acc_with_ties"]
            row["order_consistency"] = M.order_consistency(result.verdicts_ab, result.verdicts_ba)
        if result.authors_counted:
            row["authors_pred_acc"] = result.authors_correct / result.authors_counted
    if result.bias:
        bias = M.bias_metrics(result.bias)
        row.update(bias_acc=bias["acc"], bias_nds=bias["nds"], bias_ges=bias["ges"], bias_groups=bias["groups"])
    row["parse_failures"] = {file: dict(c) for file, c in result.failures.items()}
    row["rows_without_label"] = dict(result.no_label)
    row["unparsed_examples"] = list(result.examples)
    return row


def _mean(values) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def _pct(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.1f}"


def report_markdown(rows: list[dict], caches: list[dict]) -> str:
    lines = ["# Re-scored recorded answers (no model called)", ""]
    if rows:
        lines += ["| judge | pairs | acc w/ tie | w/o tie | mean over subcats | ties | abstained | authors' pred acc | "
                  "order 1-0 | bias ACC | NDS | GES | answers | not parsed | refused |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(
                f"| {r['judge']} | {r.get('pairs', '-')} | {_pct(r.get('acc_with_ties'))} | "
                f"{_pct(r.get('acc_without_ties'))} | {_pct(r.get('mean_over_categories_with_ties'))} | "
                f"{_pct(r.get('tie_rate'))} | {_pct(r.get('abstention_rate'))} | {_pct(r.get('authors_pred_acc'))} | "
                f"{_pct(r.get('acc_order_10'))} | {_pct(r.get('bias_acc'))} | {_pct(r.get('bias_nds'))} | "
                f"{_pct(r.get('bias_ges'))} | {r['answers']} | {r['not_parsed']} | {r.get('refused', 0)} |"
            )
        lines += ["", "## Answers not parsed, per file", ""]
        for r in rows:
            for file, counts in r["parse_failures"].items():
                detail = ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))
                lines.append(f"- {r['judge']}: {file}: {detail}")
            for file, n in r["rows_without_label"].items():
                lines.append(f"- {r['judge']}: {file}: {n} rows left out, their label is not 0 or 1")
            for example in r["unparsed_examples"]:
                lines.append(f"  - e.g. `…{example}`")
    if caches:
        lines += ["", "## Judge caches (answers without labels: parse outcome only)", "",
                  "| file | judge | question | ok | refusal | unparseable |", "|---|---|---|---:|---:|---:|"]
        for c in caches:
            lines.append(f"| {c['file']} | {c['judge']} | {c['question']} | {c.get('ok', 0)} | {c.get('refusal', 0)} | "
                         f"{c.get('unparseable', 0)} |")
    return "\n".join(lines) + "\n"

"""How good is each judge? The MJ-Bench protocol, with order swapping for two-image judges.

    python -m align.judgebench --judges shapes-oracle,shapes-clip,random,first-image --data testbed
    python -m align.judgebench --judges clip,pickscore --data MJ-Bench/MJ-Bench@<commit> --subsets alignment
    python -m align.judgebench --config configs/testbed_judgebench.yaml
    python -m align.judgebench --answers outputs/judgebench MJ-Bench/result/acc/vlm_results/alignment   # no model

Question-asking judges are asked MJ-Bench's questions (--protocol mjbench, the default here; bias asks
the plain alignment question) or the training-time ones (--protocol project), or the text of
--prompt_template FILE. --answers re-scores recorded answers (align/judgebench/answers.py).

Pointwise judges score every image once; a pair is a tie when |s1 - s0| <= --tie-threshold.
Pairwise judges (two-image judges, ``pairwise_native``, and any judge with its own ``compare``, such
as shapes-oracle with position bias) are asked both orders, (image0, image1) and (image1, image0):
each order gets its own accuracy, the two orders' agreement is the consistency, and the headline
verdict reconciles them (disagreement = tie). Judges that would swap orders themselves
(``swap_orders``) are set to one order per call. Bias rows are scored pointwise (ACC / NDS / GES).
The metric definitions are in docs/judgebench.md; the functions in align/judgebench/metrics.py.

Outputs in --output-dir: leaderboard.md, leaderboard.csv, leaderboard.png, per_category.csv,
bias_groups.csv, verdicts.jsonl (every verdict with the judge's raw output), summary.json, config.yaml.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import rewards
from align.api_cost import JudgeCalls, guard_api_cost, is_paid
from align.cli import ConfigError, die, die_if_disk_full, option, parse_config
from align.declared import BATCH, COEFFICIENT, COUNT, SEED
from align.eval import report
from align.eval.report import write_report
from align.judgebench import answers as A
from align.judgebench import metrics as M
from align.judgebench.data import LOCAL_SUFFIXES, SUBSETS, BenchDataError, BenchSample, load_bench
from align.judges import load_judge
from align.progress import progress_bar
from align.quiet import quiet_output
from align.run_folder import atomic_write_bytes, atomic_write_text, scrub_secrets
from align.testbed.mjbench import write_benchmark
from align.testbed.scene import MAX_SIZE, MIN_SIZE
from align.validation import check_common_inputs, check_not_a_training_run
from rewards.judge_prompts import PROTOCOLS, load_template
from rewards.secrets import scrub_text


@dataclass
class JudgeBenchConfig:
    judges: str = option(
        "shapes-oracle,shapes-clip,jpeg-compressibility,random,first-image",
        "comma-separated judge specs, e.g. shapes-oracle,shapes-oracle[noise=0.2],random,first-image", "judge",
    )
    data: str = option("testbed", "'testbed', a local .parquet/.json/.jsonl, or a hub dataset id "
                       "owner/name@revision", "data", path="file", or_name=True, formats=LOCAL_SUFFIXES)
    subsets: str = option("alignment,safety,quality,bias", "comma-separated subsets; rows of others are skipped",
                          "data")
    output_dir: str = option("outputs/judgebench", "folder for the leaderboard, plot, report and verdicts", "output",
                             path="output")
    tie_threshold: float = option(0.0, "a pointwise judge predicts a tie when |s1 - s0| <= this (MJ-Bench: 0)",
                                  "judge", within=COEFFICIENT)
    limit: int | None = option(None, "keep only the first N rows of each subset", "data", within=COUNT)
    batch_size: int = option(32, "images per judge call", "judge", within=BATCH)
    testbed_pairs: int = option(50, "testbed: pairs per alignment subcategory and per quality degradation", "data",
                                within="[1, 100000]", applies="--data testbed")
    testbed_bias_groups: int = option(24, "testbed: colourless captions, each scored in all 6 colours", "data",
                                      within="[0, 100000]", applies="--data testbed")
    testbed_image_size: int = option(32, "testbed: image side in pixels", "data", within=f"[{MIN_SIZE}, {MAX_SIZE}]",
                                     applies="--data testbed")
    seed: int = option(0, "testbed benchmark seed", "data", within=SEED, applies="--data testbed")
    overwrite: bool = option(False, "replace the outputs of an earlier benchmark in --output_dir", "output")
    protocol: str = option("mjbench", "what question-asking judges are asked: 'mjbench' (MJ-Bench's questions; bias "
                           "asks the plain alignment question) or 'project' (the training-time questions)", "judge",
                           choices=tuple(PROTOCOLS))
    prompt_template: str | None = option(None, "a template file replacing the judges' question text, e.g. one of "
                                         "MJ-Bench's eval/eval_prompts/*.txt ({caption} is filled in)", "judge",
                                         path="file", formats=(".txt",))
    answers: list[str] | None = option(None, "re-score recorded answers instead of asking judges: verdicts.jsonl "
                                       "(or its folder), judge caches, MJ-Bench's released output .json files", "data",
                                       path="any", formats=(".jsonl", ".json", ".sqlite"))
    quiet: bool = option(False, "no progress bars (they are also off when stderr is not a terminal)", "output")
    max_api_cost: float = option(5.0, "refuse to start when the paid API judge calls are estimated above this many USD "
                                      "(answers already cached count as free)", "judge", within=COEFFICIENT)


@dataclass
class JudgeRun:
    """Everything one judge answered on one benchmark (indices follow the pair / bias row lists)."""

    spec: str
    two_image: bool
    verdicts: list[int] = field(default_factory=list)  # headline (reconciled for two-image judges)
    verdicts_ab: list[int] = field(default_factory=list)  # image0 shown first
    verdicts_ba: list[int] = field(default_factory=list)  # image1 shown first (two-image judges only)
    raw: list = field(default_factory=list)
    bias_scores: list[float] | None = None  # None: the judge has no pointwise score
    bias_answers: list = field(default_factory=list)  # question-asking judges: each bias image's raw answer
    question: str | None = None  # question-asking judges: the question key (re-parsing needs mode and scale)
    seconds_pairs: float = 0.0
    seconds_bias: float = 0.0
    cost_usd: float | None = None


def split_judges(text: str) -> list[str]:
    """'a,b[x=1,y=2],c' -> ['a', 'b[x=1,y=2]', 'c'] (commas inside brackets belong to the spec)."""
    parts, depth, current = [], 0, ""
    for ch in text or "":
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return [p for p in parts if p]


def check_config(config: JudgeBenchConfig) -> tuple[list[str], tuple[str, ...]]:
    """Validate everything cheap before any data is generated or any judge is loaded; ConfigError (one line) if not."""
    check_common_inputs(config)
    check_not_a_training_run(config, "python -m align.judgebench")
    judges = split_judges(config.judges)
    if not judges:
        raise ConfigError("--judges is empty; give comma-separated judge names, e.g. shapes-oracle,random")
    for spec in judges:
        try:
            rewards.check_name(rewards.parse_judge(spec))  # with its api_key_env: a pasted key is refused, never echoed
        except (ValueError, rewards.UnknownJudgeError) as err:
            raise ConfigError(f"--judges {spec!r}: {err}") from None
    if len(set(judges)) != len(judges):
        raise ConfigError(f"--judges lists a judge twice: {config.judges}")
    subsets = tuple(s.strip() for s in config.subsets.split(",") if s.strip())
    bad = [s for s in subsets if s not in SUBSETS]
    if bad or not subsets:
        raise ConfigError(f"--subsets {config.subsets!r}: unknown {', '.join(bad) or '(empty)'}; valid: {', '.join(SUBSETS)}")
    if config.prompt_template:
        try:
            load_template(config.prompt_template)
        except ValueError as err:
            raise ConfigError(f"--prompt-template: {err}") from None
    out = Path(config.output_dir)
    if (out / "leaderboard.csv").exists() and not config.overwrite:
        raise ConfigError(f"--output-dir {out} already holds a judge benchmark; pass --overwrite or choose another folder")
    return judges, subsets


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def judge_cost_usd(judge) -> float | None:
    """The API cost so far, for judges that count tokens (rewards.concurrency.CallStats); else None."""
    stats = getattr(judge, "stats", None)
    if stats is None or not hasattr(stats, "cost_usd"):
        return None
    return stats.cost_usd(getattr(judge, "price_per_mtok", None))


def _floats(tensor) -> list[float]:
    return [float(x) for x in tensor.detach().float().cpu().reshape(-1)]


def _raw(value):
    """The judge's raw answer in a JSON-safe form (secrets never reach it: judges return text/scores)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _answer_texts(judge, n: int) -> list | None:
    """The raw answers behind a question-asking judge's last n scores (rewards.mllm.Answer.raw)."""
    answers = getattr(judge, "last_answers", None)
    if not isinstance(answers, list) or len(answers) != n:
        return None
    return [getattr(a, "raw", None) for a in answers]


def asks_pairs(judge) -> bool:
    """True for judges evaluated through compare() in both orders: two-image judges, and judges
    whose own compare() is more than a score difference (e.g. shapes-oracle's noise / position bias)."""
    if getattr(judge, "pairwise_native", False):
        return True
    return type(judge).compare is not rewards.Judge.compare


def run_judge(
    spec: str,
    judge,
    pairs: list[BenchSample],
    bias: list[BenchSample],
    base_dir: Path | None,
    tie_threshold: float,
    batch_size: int,
    progress=None,
) -> JudgeRun:
    two_image = asks_pairs(judge)
    run = JudgeRun(spec=spec, two_image=two_image)
    question = getattr(judge, "question", None)
    run.question = question.key() if hasattr(question, "key") else None
    if hasattr(judge, "tie_margin"):
        judge.tie_margin = tie_threshold  # judges that build compare() on scores use the same tie rule
    if hasattr(judge, "swap_orders"):
        judge.swap_orders = False  # we ask both orders ourselves, so each order is measured
    cost_before = judge_cost_usd(judge)
    start = time.perf_counter()
    for batch in _chunks(pairs, batch_size):
        captions = [s.caption for s in batch]
        decoded = [s.images(base_dir) for s in batch]
        first = [a for a, _ in decoded]
        second = [b for _, b in decoded]
        if two_image:
            prefs_ab = judge.compare(captions, first, second)
            prefs_ba = judge.compare(captions, second, first)
            for p_ab, p_ba in zip(prefs_ab, prefs_ba):
                v_ab = M.verdict_from_preference(p_ab.prob_a, p_ab.tie, p_ab.abstained, a_is_image0=True)
                v_ba = M.verdict_from_preference(p_ba.prob_a, p_ba.tie, p_ba.abstained, a_is_image0=False)
                run.verdicts_ab.append(v_ab)
                run.verdicts_ba.append(v_ba)
                run.verdicts.append(M.reconcile(v_ab, v_ba))
                run.raw.append({"ab": _raw(p_ab.raw), "ba": _raw(p_ba.raw)})
        else:
            scores = _floats(judge.score(captions + captions, first + second))
            n = len(batch)
            answers = _answer_texts(judge, 2 * n)
            for i, (s0, s1) in enumerate(zip(scores[:n], scores[n:])):
                verdict = M.verdict_from_scores(s0, s1, tie_threshold)
                run.verdicts_ab.append(verdict)
                run.verdicts.append(verdict)
                record = {"score0": s0, "score1": s1}
                if answers is not None:  # kept so that --answers can parse them again
                    record["answers"] = [answers[i], answers[n + i]]
                run.raw.append(record)
        if progress is not None:
            progress.update(len(batch))
    run.seconds_pairs = time.perf_counter() - start
    start = time.perf_counter()
    if bias:
        run.bias_scores = []
        for batch in _chunks(bias, batch_size):
            images = [s.images(base_dir)[0] for s in batch]
            try:
                run.bias_scores.extend(_floats(judge.score([s.caption for s in batch], images)))
                run.bias_answers.extend(_answer_texts(judge, len(batch)) or [None] * len(batch))
            except (NotImplementedError, ValueError) as err:
                if run.bias_scores:  # it scored earlier batches: a real failure
                    raise
                # a two-image-only judge: bias needs pointwise scores
                print(f"note: {spec} gives no pointwise scores, so no bias metrics ({err})")
                run.bias_scores = None
                break
            if progress is not None:
                progress.update(len(batch))
    run.seconds_bias = time.perf_counter() - start
    cost_after = judge_cost_usd(judge)
    if cost_after is not None:
        run.cost_usd = cost_after - (cost_before or 0.0)
    return run


def summarise(run: JudgeRun, pairs: list[BenchSample], bias: list[BenchSample]) -> dict:
    """One leaderboard row plus the per-category breakdown and bias details of one judge."""
    labels = [s.label for s in pairs]
    row: dict = {"judge": run.spec, "type": "pairwise" if run.two_image else "pointwise"}
    per_category: dict[str, dict] = {}
    if pairs:
        overall = M.pair_accuracy(labels, run.verdicts)
        row.update(
            pairs=overall["n"],
            acc_with_ties=overall["acc_with_ties"],
            acc_without_ties=overall["acc_without_ties"],
            tie_rate=overall["tie_rate"],
            abstention_rate=overall["abstention_rate"],
        )
        for subset, acc in M.grouped_accuracy(labels, run.verdicts, [s.category for s in pairs]).items():
            row[f"{subset}_acc_with_ties"] = acc["acc_with_ties"]
            row[f"{subset}_acc_without_ties"] = acc["acc_without_ties"]
        keys = [f"{s.category}/{s.subcategory or '-'}" for s in pairs]
        per_category = M.grouped_accuracy(labels, run.verdicts, keys)
        if not run.two_image:  # a pointwise verdict does not depend on the order the images are shown in
            row["acc_order_01"] = row["acc_order_10"] = overall["acc_with_ties"]
        else:
            row["acc_order_01"] = M.pair_accuracy(labels, run.verdicts_ab)["acc_with_ties"]
            row["acc_order_10"] = M.pair_accuracy(labels, run.verdicts_ba)["acc_with_ties"]
            row["order_consistency"] = M.order_consistency(run.verdicts_ab, run.verdicts_ba)
            for key, order_ab, order_ba in _per_key_orders(keys, labels, run):
                per_category[key]["acc_order_01"] = order_ab
                per_category[key]["acc_order_10"] = order_ba
    bias_result = None
    if bias and run.bias_scores is not None:
        bias_result = M.bias_metrics((s.group, s.variant, v) for s, v in zip(bias, run.bias_scores))
        row.update(bias_acc=bias_result["acc"], bias_nds=bias_result["nds"], bias_ges=bias_result["ges"])
    row["seconds"] = run.seconds_pairs + run.seconds_bias
    row["ms_per_pair"] = 1000 * run.seconds_pairs / len(pairs) if pairs else math.nan
    row["cost_usd"] = run.cost_usd
    return {"row": row, "per_category": per_category, "bias": bias_result}


def _per_key_orders(keys, labels, run):
    for key in sorted(set(keys)):
        idx = [i for i, k in enumerate(keys) if k == key]
        ab = M.pair_accuracy([labels[i] for i in idx], [run.verdicts_ab[i] for i in idx])["acc_with_ties"]
        ba = M.pair_accuracy([labels[i] for i in idx], [run.verdicts_ba[i] for i in idx])["acc_with_ties"]
        yield key, ab, ba


def prepare_data(config: JudgeBenchConfig, subsets: tuple[str, ...]) -> tuple[list[BenchSample], Path | None, str]:
    """Load (or, for 'testbed', generate and then load) the benchmark rows."""
    source = config.data
    if config.data == "testbed":
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        source = str(Path(config.output_dir) / "testbed_benchmark.parquet")
        write_benchmark(
            source,
            pairs_per_subcategory=config.testbed_pairs,
            bias_groups=config.testbed_bias_groups,
            size=config.testbed_image_size,
            seed=config.seed,
        )
    samples, base_dir = load_bench(source, subsets, config.limit)
    return samples, base_dir, source


def load_benchmark_judge(spec: str, config: JudgeBenchConfig):
    """A judge asking this benchmark's questions (--protocol, --prompt_template), as its answers are cached."""
    judge = load_judge(spec)
    if hasattr(judge, "use_protocol"):
        judge.use_protocol(config.protocol, config.prompt_template)
    if hasattr(judge, "stop_on_invalid_answers"):  # measured, not used: a rating off the scale counts as unparseable
        judge.stop_on_invalid_answers = False
    return judge


def guard_benchmark_cost(judge_specs: list[str], pairs, bias, base_dir, config: JudgeBenchConfig) -> float:
    """The API judges' calls on this benchmark (answers already in their caches free), priced before any is made."""
    plans = []
    for spec in judge_specs:
        name = rewards.parse_judge(spec).name
        if not (name in ("gpt4o", "gpt4v", "gemini", "claude") or name.startswith(("openai:", "anthropic:", "google:"))):
            continue  # a local judge: free, and not loaded twice
        try:
            judge = load_benchmark_judge(spec, config)
        except Exception:
            continue
        if not is_paid(judge):
            judge.close()
            continue
        captions = [s.caption for s in pairs]
        decoded = [s.images(base_dir) for s in pairs]
        first, second = [a for a, _ in decoded], [b for _, b in decoded]
        if asks_pairs(judge):  # run_judge asks each order itself, once
            judge.swap_orders = False
            cached = judge.cached_requests(captions, first, second) + judge.cached_requests(captions, second, first)
            plans.append(JudgeCalls(judge, f"{len(pairs)} pairs in both orders", comparisons=2 * len(pairs), cached=cached))
        else:
            bias_captions = [s.caption for s in bias]
            bias_images = [s.images(base_dir)[0] for s in bias]
            cached = judge.cached_requests(captions + captions, first + second)
            cached += judge.cached_requests(bias_captions, bias_images) if bias else 0
            plans.append(JudgeCalls(judge, f"{len(pairs)} pairs and {len(bias)} bias images",
                                    scores=2 * len(pairs) + len(bias), cached=cached))
    try:
        return guard_api_cost(plans, config.max_api_cost)
    finally:
        for plan in plans:
            plan.judge.close()


def benchmark(config: JudgeBenchConfig) -> list[dict]:
    """Run every judge on the benchmark and write the leaderboard; returns the summaries."""
    judge_specs, subsets = check_config(config)
    try:
        samples, base_dir, source = prepare_data(config, subsets)
    except BenchDataError as err:
        raise ConfigError(str(err)) from None
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)  # after the data is read: a bad --data writes nothing
    pairs = [s for s in samples if s.is_pair]
    bias = [s for s in samples if not s.is_pair]
    found = sorted({s.category for s in samples})
    print(f"benchmark {source}: {len(pairs)} pairs, {len(bias)} bias images; subsets {', '.join(found)}")
    missing = [s for s in subsets if s not in found]
    if missing:
        print(f"note: the data has no rows of {', '.join(missing)}")

    try:
        guard_benchmark_cost(judge_specs, pairs, bias, base_dir, config)
    except ConfigError as err:
        die(str(err))

    summaries, runs, failed = [], [], []
    for spec in judge_specs:
        try:
            judge = load_benchmark_judge(spec, config)  # API key and model id checked before any paid call
            if not hasattr(judge, "use_protocol") and config.prompt_template:
                print(f"note: {spec} asks no question (a scoring model); --prompt-template does not apply to it")
        except Exception as err:  # missing weights, key or SDK: skip this judge, keep the others
            print(scrub_text(f"error: judge {spec!r} could not be loaded: {err}"))
            failed.append(spec)
            continue
        try:
            total = len(pairs) + len(bias)
            with progress_bar(total=total, desc=spec, unit="image", leave=False) as bar:
                run = run_judge(spec, judge, pairs, bias, base_dir, config.tie_threshold, config.batch_size, bar)
        except Exception as err:  # e.g. an oracle that cannot parse this data's captions
            print(scrub_text(f"error: judge {spec!r} failed on the benchmark: {type(err).__name__}: {err}"))
            failed.append(spec)
            continue
        finally:
            judge.close()
        summary = summarise(run, pairs, bias)
        summaries.append(summary)
        runs.append(run)
        row = summary["row"]
        print(
            f"{spec:40s} acc w/ tie {_pct(row.get('acc_with_ties'))}  w/o tie {_pct(row.get('acc_without_ties'))}"
            f"  ({row['seconds']:.1f} s)"
        )
    if not runs:
        die(f"no judge could be evaluated ({', '.join(failed)})", code=1)
    write_outputs(config, source, pairs, bias, runs, summaries, base_dir)
    print(f"leaderboard written to {Path(config.output_dir) / 'leaderboard.md'}")
    if failed:
        die(f"judge(s) left out of the leaderboard after errors: {', '.join(failed)}", code=1)
    return summaries


# ---------------------------------------------------------------------------- outputs

# (key, header, format) of the leaderboard columns, in order; absent keys are left out.
COLUMNS: list[tuple[str, str, str]] = [
    ("judge", "judge", "text"),
    ("type", "type", "text"),
    ("acc_with_ties", "pairs acc w/ tie", "pct"),
    ("acc_without_ties", "pairs acc w/o tie", "pct"),
    *[
        (f"{subset}_acc_{kind}_ties", f"{subset} w/{'' if kind == 'with' else 'o'} tie", "pct")
        for subset in ("alignment", "safety", "quality")
        for kind in ("with", "without")
    ],
    ("acc_order_01", "acc order 0-1", "pct"),
    ("acc_order_10", "acc order 1-0", "pct"),
    ("order_consistency", "order consistency", "pct"),
    ("tie_rate", "ties", "pct"),
    ("abstention_rate", "abstained", "pct"),
    ("bias_acc", "bias ACC", "pct"),
    ("bias_nds", "bias NDS", "pct"),
    ("bias_ges", "bias GES", "pct"),
    ("seconds", "time (s)", "sec"),
    ("ms_per_pair", "ms / pair", "sec"),
    ("cost_usd", "API cost ($)", "usd"),
]


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def format_cell(value, kind: str) -> str:
    if _missing(value):
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "sec":
        return f"{value:.1f}"
    if kind == "usd":
        return f"{value:.4f}"
    return str(value)


def ranking_subset(rows: list[dict]) -> str | None:
    """The subset the leaderboard is sorted by: alignment (MJ-Bench's headline) if present."""
    for subset in ("alignment", "quality", "safety"):
        if any(not _missing(r.get(f"{subset}_acc_with_ties")) for r in rows):
            return subset
    return None


def ranked(rows: list[dict]) -> list[dict]:
    """Rows sorted by accuracy with ties (then without ties) on the ranking subset, best first."""
    subset = ranking_subset(rows)
    prefix = f"{subset}_" if subset else ""

    def key(row):
        a, b = row.get(f"{prefix}acc_with_ties"), row.get(f"{prefix}acc_without_ties")
        return (-(a if not _missing(a) else -1.0), -(b if not _missing(b) else -1.0))

    return sorted(rows, key=key)


def leaderboard_columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    return [c for c in COLUMNS if any(not _missing(r.get(c[0])) for r in rows)]


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |"]
    lines.append("|" + "|".join("---" if kind == "text" else "---:" for _, _, kind in columns) + "|")
    for row in rows:
        lines.append("| " + " | ".join(format_cell(row.get(k), kind) for k, _, kind in columns) + " |")
    return "\n".join(lines)


def csv_text(rows: list[dict], keys: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if _missing(row.get(k)) else row.get(k)) for k in keys})
    return buf.getvalue()


def label_balance_lines(pairs: list[BenchSample]) -> list[str]:
    lines = []
    for subset in sorted({s.category for s in pairs}):
        labels = [s.label for s in pairs if s.category == subset]
        share = M.label_balance(labels)
        lines.append(
            f"- {subset}: {len(labels)} pairs, {100 * share:.1f}% labelled image0 "
            f"(a constant 'first image' judge scores {100 * share:.1f}% in the given order)"
        )
    return lines


def leaderboard_markdown(config, source, pairs, bias, summaries) -> str:
    rows = ranked([s["row"] for s in summaries])
    parts = [
        "# Judge benchmark (MJ-Bench protocol)",
        "",
        f"Data: `{source}`; tie threshold for pointwise judges: {config.tie_threshold}. "
        "Accuracies in %; definitions in docs/judgebench.md. Pairwise judges were asked both orders; "
        "their headline accuracy reconciles the orders (disagreement = tie); 'order 0-1' is the "
        "single-order MJ-Bench protocol (image0 shown first).",
        "",
        *label_balance_lines(pairs),
    ]
    if bias:
        groups = len({s.group for s in bias})
        parts.append(f"- bias: {len(bias)} images in {groups} groups")
    subset = ranking_subset(rows)
    if subset:
        parts += ["", f"Sorted by {subset} accuracy with ties (then without ties)."]
    parts += ["", markdown_table(rows, leaderboard_columns(rows)), ""]
    cat_rows = per_category_rows(summaries)
    if cat_rows:
        cols = [("judge", "judge", "text"), ("group", "category/subcategory", "text"), ("n", "n", "text"),
                ("acc_with_ties", "acc w/ tie", "pct"), ("acc_without_ties", "acc w/o tie", "pct"),
                ("acc_order_01", "order 0-1", "pct"), ("acc_order_10", "order 1-0", "pct"),
                ("tie_rate", "ties", "pct"), ("abstention_rate", "abstained", "pct")]
        cols = [c for c in cols if any(not _missing(r.get(c[0])) for r in cat_rows)]
        parts += ["## Per category and subcategory", "", markdown_table(cat_rows, cols), ""]
    return "\n".join(parts)


def per_category_rows(summaries: list[dict]) -> list[dict]:
    rows = []
    for summary in summaries:
        for group, acc in summary["per_category"].items():
            category, _, subcategory = group.partition("/")
            rows.append({"judge": summary["row"]["judge"], "group": group, "category": category,
                         "subcategory": subcategory, **acc})
    return rows


def bias_group_rows(summaries: list[dict]) -> list[dict]:
    rows = []
    for summary in summaries:
        if summary["bias"]:
            for group, metrics in summary["bias"]["per_group"].items():
                rows.append({"judge": summary["row"]["judge"], "group": group, **metrics})
    return rows


def leaderboard_png(rows: list[dict]) -> bytes:
    """Horizontal bars per judge: accuracy with ties per subset, the two orders, and the bias scores."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = ranked(rows)
    names = [r["judge"] for r in rows]
    panels = [
        ("accuracy with ties (%)", [(f"{s}_acc_with_ties", s) for s in ("alignment", "safety", "quality")]),
        ("position bias, all pairs (%)", [("acc_order_01", "acc, image0 first"), ("acc_order_10", "acc, image1 first"),
                                          ("order_consistency", "order consistency")]),
        ("bias (%)", [("bias_acc", "ACC"), ("bias_nds", "NDS"), ("bias_ges", "GES")]),
    ]
    panels = [(t, [m for m in ms if any(not _missing(r.get(m[0])) for r in rows)]) for t, ms in panels]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1.5, 0.5 * len(rows) + 1.8),
                             squeeze=False, sharey=True)
    for ax, (title, metrics) in zip(axes[0], panels):
        height = 0.8 / len(metrics)
        for j, (key, label) in enumerate(metrics):
            values = [100 * r[key] if not _missing(r.get(key)) else 0.0 for r in rows]
            positions = [i + (j - (len(metrics) - 1) / 2) * height for i in range(len(rows))]
            ax.barh(positions, values, height=height, label=label)
        ax.axvline(50, color="#888", linewidth=1, linestyle="--")
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.set_xlim(0, 100)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="x")
        ax.legend(loc="lower right", fontsize=7)
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def report_html_sections(config, source, pairs, bias, summaries, png: bytes, base_dir) -> list:
    """Sections for align.eval.report.write_report: leaderboard, plot, per category, example pairs."""
    rows = ranked([s["row"] for s in summaries])
    columns = leaderboard_columns(rows)
    table_rows = [{h: (100 * r[k] if kind == "pct" and not _missing(r.get(k)) else r.get(k))
                   for k, h, kind in columns} for r in rows]
    intro = (f"Data: {source}. Accuracies in %, definitions in docs/judgebench.md. "
             + " ".join(line.lstrip("- ") + "." for line in label_balance_lines(pairs)))
    sections = [
        report.Section("Leaderboard", report.paragraph(intro) + report.table_html(table_rows, digits=1)),
        report.Section("Plot", report.img_tag(png, alt="leaderboard")),
    ]
    cat_rows = per_category_rows(summaries)
    if cat_rows:
        keys = ["judge", "group", "n", "acc_with_ties", "acc_without_ties", "acc_order_01", "acc_order_10",
                "tie_rate", "abstention_rate"]
        pct = set(keys[3:])
        shown = [{k: (100 * r[k] if k in pct and not _missing(r.get(k)) else r.get(k)) for k in keys} for r in cat_rows]
        sections.append(report.Section("Per category and subcategory", report.table_html(shown, keys, digits=1)))
    examples = _example_pairs(pairs)
    if examples:
        cells, labels = [], []
        for sample in examples:
            first, second = sample.images(base_dir)
            cells.append([first, second])
            labels.append(f"{sample.category}/{sample.subcategory} (label {sample.label}): {sample.caption}")
        sections.append(report.Section("Example pairs", report.image_grid_html(cells, labels, ["image0", "image1"])))
    groups = list(dict.fromkeys(s.group for s in bias))[:4]
    if groups:
        variants = list(dict.fromkeys(s.variant for s in bias))
        by_key = {(s.group, s.variant): s for s in bias}
        cells = [[by_key[(g, v)].images(base_dir)[0] if (g, v) in by_key else None for v in variants] for g in groups]
        sections.append(report.Section("Example bias groups", report.image_grid_html(cells, groups, variants)))
    return sections


def _example_pairs(pairs: list[BenchSample], per_group: int = 2) -> list[BenchSample]:
    seen: dict[str, int] = {}
    chosen = []
    for sample in pairs:
        key = f"{sample.category}/{sample.subcategory}"
        if seen.get(key, 0) < per_group:
            seen[key] = seen.get(key, 0) + 1
            chosen.append(sample)
    return chosen[:24]


def write_outputs(config, source, pairs, bias, runs, summaries, base_dir=None) -> None:
    out = Path(config.output_dir)
    rows = [s["row"] for s in summaries]
    atomic_write_text(out / "config.yaml", yaml.safe_dump(scrub_secrets(dataclasses.asdict(config)), sort_keys=False))
    atomic_write_text(out / "leaderboard.csv", csv_text(ranked(rows), [k for k, _, _ in leaderboard_columns(rows)]))
    atomic_write_text(out / "leaderboard.md", leaderboard_markdown(config, source, pairs, bias, summaries))
    cat_keys = ["judge", "category", "subcategory", "n", "acc_with_ties", "acc_without_ties", "acc_order_01",
                "acc_order_10", "tie_rate", "abstention_rate"]
    atomic_write_text(out / "per_category.csv", csv_text(per_category_rows(summaries), cat_keys))
    if bias:
        keys = ["judge", "group", "variants", "acc", "nds", "ges"]
        atomic_write_text(out / "bias_groups.csv", csv_text(bias_group_rows(summaries), keys))
    png = leaderboard_png(rows)
    atomic_write_bytes(out / "leaderboard.png", png)

    sections = report_html_sections(config, source, pairs, bias, summaries, png, base_dir)
    write_report(out / "report.html", sections, title="Judge benchmark (MJ-Bench protocol)")
    lines = []
    for run in runs:
        for i, sample in enumerate(pairs):
            record = {"judge": run.spec, "index": i, "caption": sample.caption, "category": sample.category,
                      "subcategory": sample.subcategory, "label": sample.label,
                      "verdict": M.VERDICT_NAMES[run.verdicts[i]], "raw": run.raw[i]}
            if run.question:
                record["question"] = run.question
            if run.two_image:
                record["verdict_01"] = M.VERDICT_NAMES[run.verdicts_ab[i]]
                record["verdict_10"] = M.VERDICT_NAMES[run.verdicts_ba[i]]
            lines.append(json.dumps(record))
        bias_answers = run.bias_answers if len(run.bias_answers) == len(bias) else [None] * len(bias)
        for sample, score, answer in zip(bias, run.bias_scores or [], bias_answers):
            record = {"judge": run.spec, "kind": "bias", "caption": sample.caption, "group": sample.group,
                      "variant": sample.variant, "score": score, "answer": answer, "question": run.question}
            lines.append(json.dumps(_json_safe(record)))
    atomic_write_text(out / "verdicts.jsonl", "".join(line + "\n" for line in lines))
    summary = {"data": source, "rows": ranked(rows),
               "bias": {s["row"]["judge"]: {k: v for k, v in (s["bias"] or {}).items() if k != "per_group"}
                        for s in summaries}}
    atomic_write_text(out / "summary.json", json.dumps(_json_safe(summary), indent=2))


def _json_safe(obj):
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def _pct(value) -> str:
    return "  -  " if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:5.1f}"


def rescore_answers(config: JudgeBenchConfig) -> list[dict]:
    """--answers: every metric from recorded answers; no judge is loaded and no model is called."""
    out = Path(config.output_dir)
    if (out / "answers.md").exists() and not config.overwrite:
        die(f"--output-dir {out} already holds re-scored answers (answers.md); pass --overwrite or choose another folder")
    try:
        results, caches = A.rescore(config.answers, config.tie_threshold)
    except A.AnswersError as err:
        die(str(err))
    rows = [A.summarise(r) for r in results]
    text = A.report_markdown(rows, caches)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "answers.md", text)
    atomic_write_text(out / "answers.json", json.dumps(_json_safe({"judges": rows, "caches": caches}), indent=2))
    print(f"written to {out / 'answers.md'} and answers.json")
    return rows


def main(argv: list[str] | None = None) -> None:
    config = parse_config(JudgeBenchConfig, argv, description=__doc__)
    quiet_output(config.quiet)
    try:  # as a library call, a bad input is a ConfigError (a ValueError) with the same line
        if config.answers:
            rescore_answers(config)
        else:
            benchmark(config)
    except ConfigError as err:
        die(str(err))
    except OSError as err:  # a full disk: one line
        die_if_disk_full(err)


if __name__ == "__main__":
    main()

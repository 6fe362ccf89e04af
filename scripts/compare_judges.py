"""Does a better judge give a better aligned model? MJ-Bench's downstream experiment.

    python scripts/compare_judges.py --trainer_config configs/testbed_dpo.yaml --max_steps 200   # testbed, CPU
    python scripts/compare_judges.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 \\
        --judges pickscore,hps,clip,gpt4o --oracle pickscore --trainer_config <SD DPO yaml> \\
        --train_prompts <prompt file> --eval_prompts parti --fid_feature inception --fid_reference <images>

For every judge in --judges (same base, prompts, seeds and budget; only the judge differs):
  1. feedback: the judge labels the same base-model images (K per prompt, generated once for all
     judges) through align.data.feedback, written as a Pick-a-Pic-schema parquet;
  2. its quality: agreement of those labels with --oracle's verdicts on the same pairs (pairs the
     oracle calls a tie are left out; a judge's tie or abstention counts 1/2);
  3. fine-tuning: Diffusion-DPO on that feedback (the trainer's YAML plus --max_steps); with
     --trainer ddpo the judge is the online reward instead.
Then every resulting model and the base are evaluated by every judge, the oracle and FID
(align.eval.evaluate), and judge quality is set against downstream quality: the table, and the
Spearman correlation between label accuracy and the oracle's score of each judge's model.
Outputs in --output_dir: feedback/<judge>.parquet, runs/<judge>/, eval/ (align.eval.evaluate's outputs),
compare.json, compare.csv and report.html. Finished feedback and runs are reused on a re-run.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import yaml

from align import metrics
from align.cli import ConfigError, die, option, parse_config
from align.data.feedback import generate_feedback, make_pipeline_generator
from align.data.prompt_overlap import report_overlap
from align.data.prompt_sets import PromptSetError, load_prompt_list, load_prompt_set
from align.eval import report
from align.eval.evaluate import EvalConfig, evaluate
from align.eval.generation import sampling_settings, slug
from align.judges import load_judge, split_list
from align.metrics import outcomes_from_preferences, pairwise_accuracy
from align.pipeline import load_pipeline
from align.run_folder import atomic_write_text
from rewards.images import decode_image
from rewards.spec import parse_value

TRAINERS = {"dpo": "DPOConfig", "ddpo": "DDPOConfig"}  # align.<trainer> and its config class


@dataclass
class CompareConfig:
    # judges to compare (comma list; options in brackets), and the ground truth they are measured against
    judges: str = option("shapes-oracle,shapes-clip,shapes-oracle[noise=0.3],shapes-oracle[position_bias=0.7],random",
                         "comma list of the judges to compare (options in brackets)", "judge")
    oracle: str = option("shapes-oracle", "the ground truth the judges' labels are measured against", "judge")
    model: str = option("testbed", "the base model every judge fine-tunes: 'testbed', 'testbed-flow', a pipeline "
                        "folder or hub id of any family (SD, SDXL, SD3, FLUX)", "model")
    # --- fine-tuning (identical for every judge)
    trainer: str = option("dpo", "dpo (Diffusion-DPO on each judge's labels) or ddpo (the judge as the online "
                          "reward)", "optimisation")
    trainer_config: str | None = option(None, "the trainer's YAML (its keys are the trainer's config fields)",
                                        "optimisation")
    trainer_overrides: str | None = option(None, "'key=value,key=value' on top of the YAML, e.g. "
                                           "learning_rate=1e-4,finetune=lora", "optimisation")
    train_prompts: str = option("testbed-train:128", "prompts for AI feedback", "data")
    max_steps: int | None = option(None, "overrides the trainer YAML's budget (Diffusion-DPO)", "optimisation")
    seed: int = option(0, "seed of the base-model images and of every fine-tuning run", "optimisation")
    images_per_prompt: int = option(2, "K base-model images per feedback prompt (2: every judge labels the same "
                                    "pairs)", "data")
    # --- downstream evaluation (align.eval.evaluate)
    eval_prompts: str = option("testbed-heldout", "held-out prompt set of the downstream evaluation (none of its prompts "
                               "may be a --train_prompts one)", "evaluation")
    eval_num_prompts: int = option(64, "held-out prompts evaluated", "evaluation")
    eval_prompt_seed: int = option(1000, "seed of the sampled held-out prompts (testbed)", "evaluation")
    eval_seeds: str = option("0", "comma list of image seeds per held-out prompt", "evaluation")
    fid_feature: str = option("shapes-clip", "FID features: inception for SD; shapes-clip or pixels on the testbed",
                              "evaluation")
    fid_reference: str | None = option("testbed", "FID reference images: a folder or 'testbed' (None: no FID)",
                                       "evaluation")
    batch_size: int = option(32, "images per pipeline call", "sampling")
    device: str = option("cpu", "cpu, cuda or mps", "model")
    output_dir: str = option("runs/compare-judges", "folder of the feedback, runs, evaluation, tables and report",
                             "output")

    def validate(self) -> None:

        judges = split_list(self.judges)
        if len(judges) < 2:
            raise ConfigError("--judges needs at least two judges to compare")
        if len(set(judges)) != len(judges):
            raise ConfigError("--judges lists a judge twice")
        if self.trainer not in TRAINERS:
            raise ConfigError(f"--trainer must be one of {', '.join(TRAINERS)}, got {self.trainer!r}")
        if self.trainer_config and not Path(self.trainer_config).is_file():
            raise ConfigError(f"--trainer_config {self.trainer_config!r}: no such file")
        if self.images_per_prompt < 2:
            raise ConfigError(f"--images_per_prompt must be >= 2, got {self.images_per_prompt}")
        if self.trainer == "ddpo" and self.max_steps is not None:
            raise ConfigError("--max_steps is Diffusion-DPO's budget; give DDPO's as --trainer_overrides num_epochs=N")


# ------------------------------------------------------------------------ feedback and quality


def shared_generator(config: CompareConfig):
    """generate_images(prompts, seeds) over the base model, memoised: every judge labels the same
    images (same prompts and seeds), so they are generated once for all judges."""
    settings = sampling_settings(EvalConfig(), config.model)  # no flags: the base model's own settings
    pipe = load_pipeline(config.model, device=config.device)
    generate = make_pipeline_generator(
        pipe, num_inference_steps=settings["num_inference_steps"], guidance_scale=settings["guidance_scale"],
        height=settings["resolution"], width=settings["resolution"], batch_size=config.batch_size,
    )
    memory: dict[tuple[str, int], object] = {}

    def generate_images(prompts, seeds):
        todo = [(p, s) for p, s in zip(prompts, seeds) if (p, s) not in memory]
        if todo:
            for key, image in zip(todo, generate([p for p, _ in todo], [s for _, s in todo])):
                memory[key] = image
        return [memory[(p, s)] for p, s in zip(prompts, seeds)]

    return generate_images


def label_outcomes(path: Path) -> tuple[list[str], list, list, np.ndarray]:
    """Captions, images A/B and A-against-B outcomes (1, 0.5, 0; NaN abstained) of a feedback parquet."""
    table = pq.read_table(path, columns=["caption", "jpg_0", "jpg_1", "label_0"]).to_pylist()
    captions = [row["caption"] for row in table]
    images_a = [decode_image(row["jpg_0"]) for row in table]
    images_b = [decode_image(row["jpg_1"]) for row in table]
    outcomes = np.array([np.nan if row["label_0"] is None else float(row["label_0"]) for row in table])
    return captions, images_a, images_b, outcomes


def feedback_for_all(config: CompareConfig, judges: list[str], out: Path) -> tuple[dict[str, Path], dict]:
    """Each judge labels the same base-model images (align.data.feedback); its accuracy is the agreement of
    its labels with the oracle's verdicts on the very pairs it labelled (the data its model learns from)."""
    prompts = load_prompt_set(config.train_prompts).prompts
    generate_images = None
    oracle = load_judge(config.oracle)
    paths, accuracy = {}, {}
    for spec in judges:
        path = out / "feedback" / f"{slug_name(spec)}.parquet"
        if not path.is_file():
            generate_images = generate_images or shared_generator(config)
            judge = load_judge(spec)
            stats = generate_feedback(generate_images, judge, prompts, path, images_per_prompt=config.images_per_prompt, seed=config.seed, progress=False)
            judge.close()
            print(f"[compare] {spec}: {stats.summary()}", flush=True)
        captions, images_a, images_b, outcomes = label_outcomes(path)
        truth = outcomes_from_preferences(oracle.compare(captions, images_a, images_b))
        value, used = pairwise_accuracy(outcomes, truth)
        accuracy[spec] = {"accuracy": value, "pairs": used, "labelled": len(captions), "judge_ties": int((outcomes == 0.5).sum())}
        print(f"[compare] {spec}: label accuracy vs {config.oracle} = {value:.3f} on {used} pairs", flush=True)
        paths[spec] = path
    return paths, accuracy


# ------------------------------------------------------------------------------------- training


def trainer_config(config: CompareConfig, judge: str, run_dir: Path, feedback: Path | None):
    """The trainer's config: its YAML, then what the experiment fixes (model, feedback, seed, budget).

    Diffusion-DPO trains on the judge's feedback file; DDPO (online) asks the judge itself.
    """
    module = importlib.import_module(f"align.train.{config.trainer}")
    config_class = getattr(module, TRAINERS[config.trainer])
    values = yaml.safe_load(Path(config.trainer_config).read_text()) if config.trainer_config else {}
    values.pop("env", None)  # a trainer YAML's environment (OMP_NUM_THREADS): this script sets its own threads
    values.update(parse_overrides(config.trainer_overrides))
    names = {f.name for f in fields(config_class)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(
            f"trainer settings (--trainer_config / --trainer_overrides): unknown key(s) {', '.join(sorted(unknown))}; "
            f"{config_class.__name__} fields: {', '.join(sorted(names))}"
        )
    values.update(model=config.model, output_dir=str(run_dir), seed=config.seed)
    if config.trainer == "dpo":
        values.update(dataset=str(feedback), reward=None)  # offline pairs: the trainer's --prompts go unused
    else:
        values.update(reward=judge, prompts=config.train_prompts)
    if config.max_steps is not None:  # Diffusion-DPO only (validate)
        values["max_steps"] = config.max_steps
    values.update(report_to="none", eval_prompts=None, eval_judge=None, resume=None)
    return module, config_class(**values)


def parse_overrides(text: str | None) -> dict:
    """'a=1,b=x' -> {'a': 1, 'b': 'x'} (numbers and booleans parsed)."""
    values = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--trainer_overrides item {item!r} is not key=value")
        values[key.strip()] = parse_value(value)
    return values


def train_all(config: CompareConfig, judges: list[str], feedback: dict, out: Path) -> dict[str, str]:
    """One fine-tuned model per judge (finished runs are reused); returns judge -> run folder."""
    runs = {}
    for spec in judges:
        run_dir = out / "runs" / slug_name(spec)
        module, trainer_cfg = trainer_config(config, spec, run_dir, feedback.get(spec))
        if (run_dir / "final").is_dir():
            print(f"[compare] {spec}: reusing the finished run {run_dir}", flush=True)
        else:
            trainer_cfg.overwrite = True  # an unfinished earlier attempt is replaced
            start = time.time()
            print(f"[compare] {spec}: training ({config.trainer}) into {run_dir}", flush=True)
            module.train(trainer_cfg)
            print(f"[compare] {spec}: trained in {time.time() - start:.0f} s", flush=True)
        runs[spec] = str(run_dir)
    return runs


# ------------------------------------------------------------------------------------- analysis


def downstream_table(judges: list[str], runs: dict, accuracy: dict, results: dict, oracle: str) -> list[dict]:
    """One row per judge: its accuracy against the oracle and how its model fares downstream."""
    names = {m["path"]: m["name"] for m in results["models"]}
    fid_key = next((k for k in (results["table"][0] if results["table"] else {}) if k.startswith("FID")), None)
    table = {row["model"]: row for row in results["table"]}
    oracle_eval = results["judges"][oracle]["per_model"]
    rows = []
    for spec in judges:
        name = names[runs[spec]]
        rows.append(
            {
                "judge": spec,
                "accuracy vs oracle": accuracy[spec]["accuracy"],
                "model": name,
                "oracle score": oracle_eval[name]["mean"],
                "oracle win rate vs base": oracle_eval[name]["win_rate"]["rate"],
                "oracle avg rank": oracle_eval[name]["avg_rank"],
                "avg rank (all judges)": results["overall"][name]["avg_rank"],
                "first places (all judges)": results["overall"][name]["first_share"],
                **({fid_key: table[name][fid_key]} if fid_key else {}),
            }
        )
    return rows


def check_eval_prompts_unseen(config: CompareConfig) -> None:
    """The downstream evaluation's prompts against the feedback prompts every judge's model trains on, before any work:
    overlapping testbed sets are refused, other sources get the overlap count (align/data/prompt_overlap.py)."""
    try:
        held_out = load_prompt_set(config.eval_prompts, config.eval_num_prompts, seed=config.eval_prompt_seed).prompts
    except (PromptSetError, FileNotFoundError) as err:
        raise ConfigError(f"--eval_prompts: {err}") from None
    report_overlap(config.train_prompts, load_prompt_list(config.train_prompts), config.eval_prompts, held_out,
                   "--train_prompts", "--eval_prompts")


def compare(config: CompareConfig) -> dict:

    config.validate()
    check_eval_prompts_unseen(config)
    judges = split_list(config.judges)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in judges:  # fail on a bad trainer YAML before any generation
        trainer_config(config, spec, out / "runs" / "check", out / "feedback" / "check.parquet")
    feedback, accuracy = feedback_for_all(config, judges, out)
    runs = train_all(config, judges, feedback, out)

    eval_judges = list(dict.fromkeys([config.oracle, *judges]))
    models = ",".join([f"base={config.model}", *(f"{slug_name(spec)}={runs[spec]}" for spec in judges)])
    results = evaluate(
        EvalConfig(
            models=models, judges=",".join(eval_judges), prompts=config.eval_prompts, num_prompts=config.eval_num_prompts,
            prompt_seed=config.eval_prompt_seed, seeds=config.eval_seeds, fid_reference=config.fid_reference,
            fid_feature=config.fid_feature, batch_size=config.batch_size, device=config.device, output_dir=str(out / "eval"),
        )
    )
    rows = downstream_table(judges, runs, accuracy, results, config.oracle)
    acc = [r["accuracy vs oracle"] for r in rows]
    summary = {
        "spearman_accuracy_vs_oracle_score": metrics.spearman(acc, [r["oracle score"] for r in rows]),
        "spearman_accuracy_vs_oracle_rank": metrics.spearman(acc, [-r["oracle avg rank"] for r in rows]),
        "base_oracle_score": results["judges"][config.oracle]["per_model"]["base"]["mean"],
    }
    payload = {"config": asdict(config), "table": rows, "summary": summary, "runs": runs}
    atomic_write_text(out / "compare.json", json.dumps(payload, indent=1))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out / "compare.csv", buf.getvalue())
    scatter = report.scatter_plot(acc, [r["oracle score"] for r in rows], [r["judge"] for r in rows],
                                  title="judge quality vs downstream quality", xlabel=f"pairwise accuracy vs {config.oracle}",
                                  ylabel=f"{config.oracle} score of the fine-tuned model")
    sections = [
        report.Section("Setup", report.paragraph(
            f"base {config.model}; trainer {config.trainer} ({config.trainer_config or 'defaults'}, max_steps={config.max_steps}); "
            f"feedback prompts {config.train_prompts} x {config.images_per_prompt} base-model images, labelled by each judge; "
            f"evaluation on {config.eval_num_prompts} held-out prompts x seeds {config.eval_seeds}; "
            f"base model {config.oracle} score {summary['base_oracle_score']:.3f}.")),
        report.Section("Judge quality against downstream quality", report.table_html(rows, table_id="compare-table")
                       + report.table_html([{k: v for k, v in summary.items()}])),
        report.Section("Scatter", report.img_tag(scatter, alt="accuracy vs downstream")),
        report.Section("Full evaluation", '<p><a href="eval/report.html">eval/report.html</a> (every judge, win rates, image grids)</p>'),
    ]
    report.write_report(out / "report.html", sections, title="Judges compared downstream")
    return payload


def slug_name(spec: str) -> str:

    return slug(spec.replace("shapes-oracle", "oracle"), 40)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(CompareConfig, argv, description=__doc__)
    try:
        payload = compare(config)  # validates first
    except ConfigError as err:
        die(str(err))
    print(json.dumps(payload["summary"], indent=1))
    for row in payload["table"]:
        print("  " + ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    torch.set_num_threads(1)  # faster than 2 threads for the testbed's tiny models on a shared CPU
    main()

"""Rank models by judges, win rate against the base, FID and CMMD: MJ-Bench's downstream table.

    python -m align.evaluate --models stable-diffusion-v1-5/stable-diffusion-v1-5,runs/dpo-pickscore \\
        --judges pickscore,hps,clip --prompts parti --num_prompts 200 --seeds 0,1
    python -m align.evaluate --config configs/testbed_eval.yaml --models testbed,runs/testbed-dpo

Every model draws the same initial noise for the same (prompt, seed), so differences between
models come from the weights alone. The first model is the base: win rates are against it.

Per judge: mean score, win rate against the base (ties 1/2, with a confidence interval), each
model's rank on every prompt (1 = best; scores averaged over seeds; a pairwise-only judge ranks by
wins against the other models), its average rank and its share of first places. Overall: those
averaged over judges. Generated images are cached in <output_dir>/generations/ (keyed by model
files, settings, prompt and seed), and scores in <output_dir>/scores/, so adding a judge or a model
generates only what is new. Outputs: results.json, results.csv (the rank table) and report.html.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import rewards
from align import metrics
from align.api_cost import evaluate_api_plan, guard_api_cost
from align.cli import ConfigError, die, die_if_disk_full, option, parse_config
from align.data.prompt_sets import PromptSetError, load_prompt_list, load_prompt_set
from align.declared import (
    BATCH,
    COEFFICIENT,
    COUNT,
    COUNT_OR_ZERO,
    DEVICE,
    GUIDANCE,
    PROMPT_FILES,
    RESOLUTION,
    SAMPLING_STEPS,
    SEED,
)
from align.eval import report
from align.eval.edit_metrics import edit_change_table
from align.eval.generation import (
    GENERATION_DTYPES,
    GenerationCache,
    ModelEntry,
    generate_missing,
    resolve_device,
    sample_seed,
    sampling_settings,
    settings_per_model,
    slug,
)
from align.eval.judge_tasks import format_task_table, task_breakdown, task_rows
from align.health import degenerate_reason
from align.judges import (
    check_judge_names,
    check_judges_take_prompts,
    compare_shuffled,
    load_judge,
    split_list,
)
from align.metrics import CI_METHODS, FeatureNetwork
from align.pipeline import ModelLoadError, check_model, check_sampling_steps, resolve_model, run_base_model
from align.quiet import quiet_output
from align.run_folder import atomic_write_text, clean_interrupted_writes
from align.testbed.scene import MAX_SIZE, MIN_SIZE, render
from align.validation import check_common_inputs, check_not_a_training_run, check_weight_files
from rewards.base import JudgeAnswerError
from rewards.images import load_image, to_tensor
from rewards.mllm import JudgeNotReadyError

FID_FEATURES_BUILTIN = ("inception", "pixels")


@dataclass
class EvalConfig:
    # --- what to compare
    models: str = option("stable-diffusion-v1-5/stable-diffusion-v1-5", "comma list of models, the base first; "
                         "'name=path' names a model (a hub id, pipeline, run or LoRA folder, 'testbed' or 'testbed-flow')", "model")
    base_model: str | None = option(None, "pipeline under bare LoRA / unet/ / transformer/ folders (None: the first model)", "model",
                                    path="folder", or_name=True)
    judges: str = option("clip,pickscore", "comma list of judge specs, e.g. shapes-oracle,shapes-oracle[noise=0.2]",
                         "judge")
    # --- prompts and seeds
    prompts: str = option("parti", "a prompt set (align.data.prompt_sets: testbed, mjbench, parti, drawbench, ...) or a "
                          "file", "data", path="file", or_name=True, formats=PROMPT_FILES, reads=load_prompt_list)
    num_prompts: int | None = option(64, "the first N prompts (None: all)", "data", within=COUNT)
    prompt_seed: int = option(0, "seed of sampled prompt sets (testbed)", "data", within=SEED)
    seeds: str = option("0", "comma list of seeds; each prompt is generated once per seed, identically for every "
                        "model", "sampling")
    # --- sampling (None = the model's testbed.json / flow_testbed.json setting, else its pipeline's own default)
    num_inference_steps: int | None = option(None, "sampling steps (None: the model's testbed.json if any, else its "
                                             "pipeline's default: 50 SD/SDXL, 28 SD3/FLUX)", "sampling",
                                             within=SAMPLING_STEPS)
    guidance_scale: float | None = option(None, "classifier-free guidance (FLUX: its guidance embedding; None: the "
                                          "model's testbed.json if any, else its pipeline's default)", "sampling",
                                          within=GUIDANCE)
    resolution: int | None = option(None, "image side in pixels (None: the model's native size)", "sampling",
                                    within=RESOLUTION)
    batch_size: int = option(8, "images per pipeline call", "sampling", within=BATCH)
    device: str = option("auto", "auto, cpu, cuda or mps", "model", pattern=DEVICE)
    dtype: str = option("float32", "weights and compute dtype of the generators: float32, bfloat16 or float16 "
                        "(bfloat16 on a GPU for SDXL, SD3.5 and FLUX.1)", "model", choices=tuple(GENERATION_DTYPES))
    # --- distribution metrics
    fid_reference: str | None = option(None, "FID reference: a folder of images, or 'testbed' (the true scenes "
                                       "of the prompts); None: no FID", "evaluation", path="folder", or_name=True)
    fid_feature: str = option("inception", "FID features: inception, pixels, or an embedding judge (clip, "
                              "shapes-clip)", "evaluation")
    inception_weights: str | None = option(None, "local InceptionV3 weights for offline FID", "evaluation",
                                           path="file")
    cmmd: bool = option(False, "also CMMD (needs --fid_reference)", "evaluation")
    cmmd_feature: str = option("clip", "CLIP-like judge whose image embeddings CMMD uses", "evaluation",
                               applies="--cmmd")
    # --- statistics and report
    ci: str = option("wilson", "95% confidence intervals of win rates: wilson or bootstrap", "evaluation",
                     choices=CI_METHODS)
    grid_prompts: int = option(8, "prompts shown in the report's image grid", "output", within=COUNT_OR_ZERO)
    output_dir: str = option("runs/eval", "folder of results.json, results.csv, report.html and the image and "
                             "score caches", "output", path="output")
    quiet: bool = option(False, "no progress bars (they are also off when stderr is not a terminal)", "output")
    max_api_cost: float = option(5.0, "refuse to start when the paid API judge calls are estimated above this many USD",
                                 "judge", within=COEFFICIENT)

    def validate(self) -> None:
        check_common_inputs(self)
        check_not_a_training_run(self, "python -m align.evaluate")

        if not split_list(self.models):
            raise ConfigError("--models needs at least one model (the base first)")
        if not split_list(self.judges) and not self.fid_reference:
            raise ConfigError("nothing to measure: give --judges and/or --fid_reference")
        parse_seeds(self.seeds)
        if self.cmmd and not self.fid_reference:
            raise ConfigError("--cmmd needs --fid_reference (the images to compare against)")


# ------------------------------------------------------------------------------------- parsing


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in str(text).replace(" ", "").split(",") if s]
    except ValueError:
        raise ConfigError(f"--seeds must be a comma list of integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds must hold at least one seed and no repeats, got {text!r}")
    return seeds


def parse_models(text: str) -> list[ModelEntry]:
    entries, names = [], set()
    for item in split_list(text):
        name, sep, path = item.partition("=")
        if not sep:
            path = item
            name = Path(item.rstrip("/")).name or item
        name, path = name.strip(), path.strip()
        if name in names:
            raise ConfigError(f"two models are named {name!r}; name them apart with name=path")
        names.add(name)
        entries.append(ModelEntry(name, path))
    return entries


# -------------------------------------------------------------------------------------- judging


class ScoreCache:
    """Pointwise scores of one judge keyed by image file hash: adding a model scores only its images."""

    def __init__(self, path: Path):
        self.path = path
        self.table: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.table))


def image_key(path: Path, prompt: str) -> str:
    return hashlib.sha1(path.read_bytes() + b"\x00" + prompt.encode()).hexdigest()


def score_model(judge, spec: str, prompts: list[str], images: torch.Tensor, paths: list[Path], cache_root: Path, deterministic: bool) -> np.ndarray:
    """Scores of one model's images; deterministic judges reuse cached scores."""
    cache = ScoreCache(cache_root / f"{slug(spec, 80)}.json") if deterministic else None
    keys = [image_key(p, prompt) for p, prompt in zip(paths, prompts)]
    todo = [i for i, k in enumerate(keys) if cache is None or k not in cache.table]
    scores = np.full(len(prompts), np.nan)
    if todo:
        fresh = judge.score([prompts[i] for i in todo], images[todo]).detach().float().cpu().numpy()
        scores[todo] = fresh
        if cache is not None:
            cache.table.update({keys[i]: float(v) for i, v in zip(todo, fresh)})
            cache.save()
    if cache is not None:
        done = [i for i in range(len(keys)) if i not in set(todo)]
        scores[done] = [cache.table[keys[i]] for i in done]
    return scores


def is_deterministic(judge) -> bool:
    """Judges with randomness (noise, random judge) are re-asked every run rather than cached."""
    return not any(getattr(judge, attr, 0) for attr in ("noise", "position_bias")) and type(judge).__name__ != "RandomJudge"


def evaluate_judge(judge, spec: str, names: list[str], prompts: list[str], num_prompts: int, images: dict, paths: dict, cache_root: Path, ci: str) -> dict:
    """Per-model mean score, win rate against the first model, per-prompt ranks, first places."""
    num_models = len(names)
    samples = len(prompts)  # seed-major: sample k is prompt k % num_prompts
    if judge.pointwise:
        mode = "pointwise"
        deterministic = is_deterministic(judge)
        scores = np.stack([score_model(judge, spec, prompts, images[n], paths[n], cache_root, deterministic) for n in names])
        outcomes = {n: metrics.outcomes_from_scores(scores[i], scores[0], judge.tie_margin) for i, n in enumerate(names)}
        per_prompt = _per_prompt_mean(scores, num_prompts)
    else:
        mode = "pairwise"
        scores = None
        pair = {}
        rng = np.random.default_rng(0)
        for i in range(num_models):
            for j in range(i + 1, num_models):
                pair[(i, j)] = compare_shuffled(judge, prompts, images[names[i]], images[names[j]], rng)
        # the base against itself is a tie by definition; model i against the base = 1 - (base vs i)
        outcomes = {names[0]: np.full(samples, 0.5)}
        outcomes.update({names[i]: 1 - pair[(0, i)] for i in range(1, num_models)})
        per_prompt = _per_prompt_mean(metrics.copeland_scores(pair, num_models, samples), num_prompts)
    ranks = metrics.ranks_per_prompt(per_prompt)
    firsts = metrics.first_place_share(ranks)
    per_model = {}
    for i, name in enumerate(names):
        entry = {"avg_rank": float(ranks[i].mean()), "first_share": float(firsts[i])}
        if scores is not None:
            entry["mean"], entry["sem"] = metrics.mean_and_sem(scores[i])
            entry["sem_by_prompt"] = metrics.clustered_sem(scores[i], prompts)  # a prompt's seeds are not independent
            if i:  # the same prompts and seeds as the base: the paired change, both standard errors
                change = metrics.paired_change(scores[0], scores[i], prompts)
                entry["change"] = {"mean": change.mean, "sem": change.sem_images, "sem_by_prompt": change.sem_prompts}
        entry["win_rate"] = None if i == 0 else metrics.win_rate(outcomes[name], ci=ci).to_dict()
        per_model[name] = entry
    return {
        "mode": mode,
        "per_model": per_model,
        "ranks": ranks.tolist(),
        "scores": None if scores is None else scores.tolist(),
        "tasks": task_breakdown(judge, prompts, scores, names),  # a judge's own table (GenEval's per-task), or None
    }


def _per_prompt_mean(values: np.ndarray, num_prompts: int) -> np.ndarray:
    """[models, seeds * prompts] (seed-major: sample k is prompt k % P) -> [models, prompts], mean over seeds."""
    models, samples = values.shape
    return np.nanmean(values.reshape(models, samples // num_prompts, num_prompts), axis=1)


# ------------------------------------------------------------------------------ FID and friends


def check_inception_fid(inception_weights: str | None) -> None:
    """FID's default Inception network needs torch-fidelity (and its weights file, when given): checked before any
    model loads or image is generated (issue 61: a RuntimeError after every image was made)."""
    if importlib.util.find_spec("torch_fidelity") is None:
        raise ConfigError("--fid_reference with --fid_feature inception needs torch-fidelity (pip install torch-fidelity) "
                          "and its InceptionV3 weights (--inception_weights <file> offline); or choose another "
                          "--fid_feature (pixels, or an embedding judge such as shapes-clip for the testbed)")
    if inception_weights and not Path(inception_weights).expanduser().is_file():
        raise ConfigError(f"--inception_weights {inception_weights!r}: no such file")


def feature_network(name: str, inception_weights: str | None = None):
    """'inception' (torchmetrics' default), 'pixels' (8x8 pooled RGB, no weights), or an embedding judge."""
    if name == "inception":
        return "inception"
    if name == "pixels":
        return FeatureNetwork(lambda x: torch.nn.functional.adaptive_avg_pool2d(x.float(), 8).flatten(1), 192, "pixels")
    embed = embedding_function(name)
    probe = embed(torch.zeros(1, 3, 32, 32))
    return FeatureNetwork(embed, probe.shape[-1], name)


def embedding_function(name: str):
    """Image embeddings [N, d] of a CLIP-like judge (clip, shapes-clip, pickscore)."""
    judge = rewards.load(name)
    embedder = getattr(judge, "embedder", None)
    if embedder is None or not hasattr(embedder, "image_embeddings"):
        raise ConfigError(
            f"feature network {name!r}: this judge has no image embeddings; use inception, pixels, "
            "or a CLIP-like judge (clip, pickscore, shapes-clip)"
        )
    return embedder.image_embeddings


def load_reference_images(spec: str, prompts: list[str], seeds: list[int], size: int) -> torch.Tensor:
    """'testbed': the true scene of every (prompt, seed); otherwise every image in a folder, resized."""
    if spec == "testbed":
        if not MIN_SIZE <= size <= MAX_SIZE:
            raise ConfigError(f"--fid_reference testbed renders scenes of {MIN_SIZE} to {MAX_SIZE} px; these images are "
                              f"{size} px (give --resolution in that range or another --fid_reference)")
        return to_tensor([render(p, seed=sample_seed(s, p), size=size) for s in seeds for p in prompts])
    folder = Path(spec).expanduser()
    files = sorted(f for f in folder.rglob("*") if f.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp")) if folder.is_dir() else []
    if len(files) < 2:
        raise ConfigError(f"--fid_reference {spec!r} must be 'testbed' or a folder with at least 2 images")
    return to_tensor([load_image(f).resize((size, size)) for f in files])


# ------------------------------------------------------------------------------------- the run


def check_inputs(config: EvalConfig) -> tuple[list[ModelEntry], list]:
    """Everything that can be checked before a model is loaded or an image generated."""
    config.validate()
    models = parse_models(config.models)
    for model in models:
        try:
            path = resolve_model(model.path)
        except ModelLoadError as err:
            raise ConfigError(str(err)) from None
        local = path.startswith((".", "/", "~")) or Path(path).expanduser().exists()
        if local and not Path(path).expanduser().exists():
            raise ConfigError(f"model {model.name!r}: no such folder {model.path!r}")
        if local:
            check_weight_files(f"--models {model.name}", path)  # a truncated file is named before any generation
        try:
            if local and (Path(path).expanduser() / "model_index.json").is_file():
                check_model(path)  # an edited model_index.json (a list, SD weights labelled SDXL) is named here
                check_sampling_steps(path, config.num_inference_steps)
        except ModelLoadError as err:
            raise ConfigError(f"model {model.name!r}: {err}") from None
    check_judge_names(split_list(config.judges), "--judges")
    features = ((config.fid_feature, config.fid_reference), (config.cmmd_feature, config.cmmd))
    check_judge_names([f for f, used in features if used and f not in FID_FEATURES_BUILTIN], "feature network")
    if config.fid_reference and config.fid_reference != "testbed" and not Path(config.fid_reference).expanduser().is_dir():
        raise ConfigError(f"--fid_reference {config.fid_reference!r} must be 'testbed' or a folder of images")
    if config.fid_reference and config.fid_feature == "inception":
        check_inception_fid(config.inception_weights)
    try:
        prompt_set = load_prompt_set(config.prompts, config.num_prompts, seed=config.prompt_seed)
    except PromptSetError as err:
        raise ConfigError(str(err)) from None
    return models, prompt_set


def evaluate(config: EvalConfig) -> dict:
    """Run the whole evaluation; returns the results dict also written to results.json."""
    models, prompt_set = check_inputs(config)
    # judges load first: a missing key or weights file fails before anything is written or generated
    loaded = {spec: load_judge(spec) for spec in split_list(config.judges)}
    check_judges_take_prompts(loaded.values(), prompt_set.prompts, "--prompts")
    seeds = parse_seeds(config.seeds)
    # The paid judge calls, priced before any is made (refused above --max_api_cost).
    guard_api_cost(evaluate_api_plan(loaded, len(models), len(seeds) * len(prompt_set.prompts)), config.max_api_cost)
    out = Path(config.output_dir)  # made by the first file written (atomic writes create folders), so a model
    # that fails to load leaves nothing behind
    if out.is_dir():  # a run killed mid-write left temporary files (cached images, scores) in its folder
        clean_interrupted_writes(out)
    device = resolve_device(config.device)
    base_for_adapters = config.base_model or models[0].path
    settings = sampling_settings(config, base_for_adapters)
    model_settings = settings_per_model(config, models, base_for_adapters)  # another family: its own defaults
    prompts = prompt_set.prompts
    # seed-major order: sample k = (seed k // P, prompt k % P)
    items = [(p, s) for s in seeds for p in prompts]
    sample_prompts = [p for p, _ in items]

    stats = None
    if config.fid_reference:  # before any image is generated: a feature network that cannot load stops here
        try:
            stats = metrics.FeatureStats(feature_network(config.fid_feature), inception_weights=config.inception_weights)
        except RuntimeError as err:
            raise ConfigError(f"--fid_reference: {err}") from None
    embed = embedding_function(config.cmmd_feature) if config.cmmd else None
    images, paths, generated = {}, {}, {}
    for model in models:
        own = model_settings[model.name]
        # a run folder sits on the base its config.yaml names (unless --base_model says otherwise); a bare LoRA
        # or denoiser folder on --base_model or the first model
        base = config.base_model or run_base_model(model.path) or models[0].path
        cache = GenerationCache(out / "generations", model, own, base)
        generated[model.name] = generate_missing(cache, model, items, own, base, device, config.batch_size)
        images[model.name] = cache.load(items)
        paths[model.name] = [cache.path(p, s) for p, s in items]
    degenerate = degenerate_models(images, [m.name for m in models])
    names = [m.name for m in models if m.name not in degenerate]  # only these are scored and ranked

    judges = {}
    for spec, judge in loaded.items():
        try:
            print(f"[evaluate] judging with {spec}", flush=True)
            judges[spec] = evaluate_judge(
                judge, spec, names, sample_prompts, len(prompts), images, paths, out / "scores", config.ci
            )
        finally:
            judge.close()

    fid, cmmd_values = {}, {}
    if stats is not None:
        size = images[names[0]].shape[-1]
        reference = load_reference_images(config.fid_reference, prompts, seeds, size)
        stats.add_reference(reference, batch_size=config.batch_size * 4)
        fid = {n: stats.fid(images[n], batch_size=config.batch_size * 4) for n in names}
        if embed is not None:
            ref_emb = embed(reference)
            cmmd_values = {n: metrics.cmmd(ref_emb, embed(images[n])) for n in names}

    edit_change = edit_change_table(sample_prompts, images, names)  # edits: what changed outside the edit

    overall = {}
    for name in names if judges else []:
        overall[name] = {
            "avg_rank": float(np.mean([j["per_model"][name]["avg_rank"] for j in judges.values()])),
            "first_share": float(np.mean([j["per_model"][name]["first_share"] for j in judges.values()])),
        }
    results = {
        "config": asdict(config),
        "models": [{"name": m.name, "path": m.path, "base": i == 0, "images_generated": generated[m.name],
                    "degenerate": degenerate.get(m.name), "sampling": model_settings[m.name]} for i, m in enumerate(models)],
        "prompt_set": prompt_set.name,
        "prompts": prompts,
        "categories": prompt_set.categories,
        "seeds": seeds,
        "sampling": settings,
        "judges": judges,
        "fid": fid,
        "fid_feature": config.fid_feature if config.fid_reference else None,
        "cmmd": cmmd_values,
        "change_outside_edit": edit_change,
        "overall": overall,
    }
    results["table"] = rank_table(results)
    write_outputs(results, out, images, names, prompts, seeds, config.grid_prompts)
    return results


def degenerate_models(images: dict, names: list[str]) -> dict[str, str]:
    """{model: why} for models whose images are degenerate (NaN, or mostly blank: a diverged model's black
    images); they are not scored or ranked as if they were merely bad. The base must be sound: win rates
    are against it."""
    found = {n: reason for n in names if (reason := degenerate_reason(images[n]))}
    if names[0] in found:
        raise ConfigError(f"the base model {names[0]!r} gives degenerate images ({found[names[0]]}): there is nothing "
                          "to compare the other models against; check its weights")
    for name, reason in found.items():
        print(f"[evaluate] {name}: DEGENERATE images ({reason}): not scored or ranked", flush=True)
    return found


def rank_table(results: dict) -> list[dict]:
    """The downstream table: one row per model (the same rows go to the CSV and the report)."""
    rows = []
    for model in results["models"]:
        if model.get("degenerate"):  # not scored: listed apart in the report (align/health.py)
            continue
        name = model["name"]
        row = {"model": name}
        if name in results["overall"]:
            row["avg rank (all judges)"] = results["overall"][name]["avg_rank"]
            row["first places (all judges)"] = results["overall"][name]["first_share"]
        for spec, judge in results["judges"].items():
            entry = judge["per_model"][name]
            if "mean" in entry:
                row[f"{spec} mean"] = entry["mean"]
            row[f"{spec} win rate"] = entry["win_rate"]["rate"] if entry["win_rate"] else None
            row[f"{spec} avg rank"] = entry["avg_rank"]
        if results["fid"]:
            row[f"FID ({results['fid_feature']})"] = results["fid"][name]
        if results["cmmd"]:
            row["CMMD"] = results["cmmd"][name]
        if results.get("change_outside_edit"):
            row["change outside the edit"] = results["change_outside_edit"][name]["mean"]
        rows.append(row)
    return rows


def write_outputs(results: dict, out: Path, images: dict, names: list[str], prompts: list[str], seeds: list[int], grid_prompts: int) -> None:
    """results.json, results.csv (the rank table) and report.html, each written atomically."""
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=_json_default))
    buf = io.StringIO()
    columns = list(dict.fromkeys(k for row in results["table"] for k in row))
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(results["table"])
    atomic_write_text(out / "results.csv", buf.getvalue())
    write_eval_report(out / "report.html", results, images, names, prompts, seeds, grid_prompts)


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_eval_report(path: Path, results: dict, images: dict, names: list[str], prompts: list[str], seeds: list[int], grid_prompts: int) -> None:
    cfg = results["config"]
    sections = [
        report.Section(
            "Setup",
            report.table_html(
                [
                    {"setting": "models (base first)", "value": ", ".join(names)},
                    {"setting": "prompt set", "value": f"{results['prompt_set']} ({len(prompts)} prompts)"},
                    {"setting": "seeds", "value": ", ".join(map(str, seeds))},
                    {"setting": "sampling", "value": json.dumps(results["sampling"])},
                    {"setting": "judges", "value": ", ".join(results["judges"]) or "-"},
                    {"setting": "FID", "value": f"{results['fid_feature']} features vs {cfg['fid_reference']}" if results["fid"] else "-"},
                ]
            ),
        ),
        report.Section(
            "Rank table",
            report.paragraph(
                "Average rank: each model's rank among the models on every prompt (1 = best, ties share the mean rank), "
                "averaged over prompts (and over judges for the 'all judges' columns). Win rate: share of (prompt, seed) "
                "pairs the model wins against the base, ties counted 1/2. Lower FID/CMMD = closer to the reference images."
            )
            + report.table_html(results["table"], table_id="rank-table")
            + degenerate_note(results["models"]),
        ),
    ]
    for spec, judge in results["judges"].items():
        rows = []
        for name in names:
            entry = judge["per_model"][name]
            wr = entry["win_rate"]
            rows.append(
                {
                    "model": name,
                    "mean": entry.get("mean"),
                    "sem": entry.get("sem"),
                    "sem by prompt": entry.get("sem_by_prompt"),
                    "change vs base": entry["change"]["mean"] if entry.get("change") else None,
                    "± by prompt": entry["change"]["sem_by_prompt"] if entry.get("change") else None,
                    "win rate": wr["rate"] if wr else None,
                    "95% CI": f"[{wr['ci_low']:.3f}, {wr['ci_high']:.3f}]" if wr else "-",
                    "W / T / L": f"{wr['wins']} / {wr['ties']} / {wr['losses']}" if wr else "-",
                    "avg rank": entry["avg_rank"],
                    "first places": entry["first_share"],
                }
            )
        body = report.paragraph(f"{judge['mode']} judge") + report.table_html(rows)
        others = [r for r in rows if r["win rate"] is not None]
        if others:
            rates = [r["win rate"] for r in others]
            lows = [judge["per_model"][r["model"]]["win_rate"]["ci_low"] for r in others]
            highs = [judge["per_model"][r["model"]]["win_rate"]["ci_high"] for r in others]
            errors = [[max(0.0, x - lo) for x, lo in zip(rates, lows)], [max(0.0, hi - x) for x, hi in zip(rates, highs)]]
            plot = report.bar_plot([r["model"] for r in others], rates, errors, title=f"win rate vs {names[0]} ({spec})", ylabel="win rate", reference_line=0.5)
            body += report.img_tag(plot, alt=f"win rate {spec}")
        if judge["scores"] is not None and any(results["categories"]):
            body += category_table(judge["scores"], names, results["categories"], len(prompts))
        if judge.get("tasks"):
            body += report.paragraph("the judge's own per-task table") + report.table_html(task_rows(judge["tasks"]))
        sections.append(report.Section(f"Judge: {spec}", body))
    if results["overall"]:
        plot = report.bar_plot(names, [results["overall"][n]["avg_rank"] for n in names], title="average rank over all judges (lower is better)", ylabel="average rank")
        sections.append(report.Section("Average rank", report.img_tag(plot, alt="average rank")))
    shown = list(range(min(grid_prompts, len(prompts))))
    cells = [[images[n][k] for n in names] for k in shown]
    sections.append(
        report.Section(
            f"Images (seed {seeds[0]})",
            report.image_grid_html(cells, [prompts[k] for k in shown], names, width=128, corner="prompt"),
        )
    )
    report.write_report(path, sections, title="Model evaluation")


def degenerate_note(models: list[dict]) -> str:
    """The models left out of the rank table because their images are degenerate, and why."""
    left_out = [m for m in models if m.get("degenerate")]
    if not left_out:
        return ""
    return report.paragraph("Not ranked, DEGENERATE images (a diverged model, e.g. NaN weights): "
                            + "; ".join(f"{m['name']}: {m['degenerate']}" for m in left_out))


def category_table(scores: list, names: list[str], categories: list[str], num_prompts: int) -> str:
    """Mean score per prompt category and model (MJ-Bench's categories for the bundled sets)."""
    values = np.asarray(scores, dtype=float)
    cats = np.asarray(categories * (values.shape[1] // num_prompts))
    rows = []
    for cat in dict.fromkeys(categories):
        mask = cats == cat
        rows.append({"category": cat or "(none)", "images": int(mask.sum()), **{n: float(np.nanmean(values[i, mask])) for i, n in enumerate(names)}})
    return report.paragraph("mean score per prompt category") + report.table_html(rows)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(EvalConfig, argv, description=__doc__)
    quiet_output(config.quiet)
    try:
        check_inputs(config)
        results = evaluate(config)  # its judges load first: an unusable one stops it before any generation
    except (ConfigError, ModelLoadError) as err:  # ModelLoadError: a missing, truncated or corrupt weights file
        die(str(err))
    except (JudgeAnswerError, JudgeNotReadyError) as err:  # a judge that answered no valid score, or stopped answering
        die(str(err), code=3)
    except OSError as err:  # a full disk: one line
        die_if_disk_full(err)
    out = Path(config.output_dir)
    print(f"[evaluate] wrote {out / 'results.json'}, {out / 'results.csv'} and {out / 'report.html'}")
    for row in results["table"]:
        print("  " + ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))
    for model in results["models"]:
        if model.get("degenerate"):
            print(f"  {model['name']}: not ranked, degenerate images ({model['degenerate']})")
    for spec, judge in results["judges"].items():
        if judge.get("tasks"):
            print(format_task_table(spec, judge["tasks"]))


if __name__ == "__main__":
    main()

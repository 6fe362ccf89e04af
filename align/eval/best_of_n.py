"""Best-of-N: generate N candidates per prompt, keep the one a judge likes best.

    python -m align.best_of_n --reward hps --n 16 --eval_judges pickscore,clip --prompts drawbench
    python -m align.best_of_n --config configs/testbed_eval.yaml --reward shapes-clip --eval_judges shapes-oracle

Reward against N (1, 2, 4, ..., N). With a pointwise selector every candidate is scored and the
curve is the exact expectation over random n-subsets of the N candidates (order statistics:
the candidate ranked r-th of N is the best of a random n-subset with probability
C(r-1, n-1) / C(N, n)), which is far less noisy than using the first n. The other judges
(--eval_judges) score the same candidates, so their curve is the expected score of the image the
selector picks: if it falls while the selector's rises, the selector is being hacked (Ma et al. 2025).
A pairwise-only selector (API judges in pair mode) runs a knock-out bracket over the first n
candidates instead; every judge call goes through the judge's own cache.

--search zero-order adds Ma et al.'s zero-order search: from the best of --zo_neighbors random
noises, repeatedly try --zo_neighbors noises around the current pivot (radius --zo_radius) and
move to the best; its curve is the best selector score against candidates generated.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from align.api_cost import best_of_n_api_plan, guard_api_cost
from align.cli import ConfigError, die, die_if_disk_full, option, parse_config
from align.data.feedback import derive_seed
from align.data.prompt_sets import PromptSetError, load_prompt_list, load_prompt_set
from align.declared import (
    BATCH,
    COEFFICIENT,
    COUNT,
    COUNT_OR_ZERO,
    DEVICE,
    GUIDANCE,
    POSITIVE,
    PROMPT_FILES,
    RESOLUTION,
    SAMPLING_STEPS,
    SEED,
)
from align.eval import report
from align.eval.generation import (
    GENERATION_DTYPES,
    GenerationCache,
    ModelEntry,
    generation_dtype,
    resolve_device,
    sampling_settings,
)
from align.eval.report import png_bytes
from align.families import family_of_pipeline
from align.judges import (
    check_judge_names,
    check_judges_take_prompts,
    compare_shuffled,
    load_judge,
    split_list,
)
from align.metrics import mean_and_sem
from align.pipeline import ModelLoadError, check_model, check_sampling_steps, load_trained
from align.progress import progress_bar
from align.quiet import quiet_output
from align.run_folder import atomic_write_bytes, atomic_write_text, clean_interrupted_writes
from align.validation import (
    check_common_inputs,
    check_not_a_training_run,
    check_weight_files,
)
from rewards.base import JudgeAnswerError
from rewards.mllm import JudgeNotReadyError

SEARCHES = ("random", "zero-order")


@dataclass
class BestOfNConfig:
    model: str = option("stable-diffusion-v1-5/stable-diffusion-v1-5", "the generator: a hub id, pipeline folder, "
                        "run or LoRA folder, 'testbed' or 'testbed-flow' (any family: SD, SDXL, SD3, FLUX)", "model",
                        path="folder", or_name=True)
    base_model: str | None = option(None, "base pipeline for a bare LoRA / unet/ / transformer/ folder", "model",
                                    path="folder", or_name=True)
    reward: str = option("pickscore", "the selector judge that picks the best of the candidates", "judge")
    eval_judges: str | None = option(None, "comma list of other judges that score the chosen images", "judge")
    prompts: str = option("drawbench", "a prompt set (align.data.prompt_sets) or a file", "data", path="file",
                          or_name=True, formats=PROMPT_FILES, reads=load_prompt_list)
    num_prompts: int | None = option(16, "the first N prompts (None: all)", "data", within=COUNT)
    prompt_seed: int = option(0, "seed of sampled prompt sets (testbed)", "data", within=SEED)
    n: int = option(16, "candidates per prompt (the curve is at 1, 2, 4, ..., n)", "sampling", within=BATCH)
    batch_size: int = option(8, "images per pipeline call", "sampling", within=BATCH)
    seed: int = option(0, "seed of the candidates' starting noises", "sampling", within=SEED)
    num_inference_steps: int | None = option(None, "sampling steps (None: the model's testbed.json if any, else its "
                                             "pipeline's default: 50 SD/SDXL, 28 SD3/FLUX)", "sampling",
                                             within=SAMPLING_STEPS)
    guidance_scale: float | None = option(None, "classifier-free guidance (FLUX: its guidance embedding; None: the "
                                          "model's testbed.json if any, else its pipeline's default)", "sampling",
                                          within=GUIDANCE)
    resolution: int | None = option(None, "image side in pixels (None: the model's native size)", "sampling",
                                    within=RESOLUTION)
    search: str = option("random", "random, or zero-order (which also runs random search for comparison)",
                         "sampling", choices=SEARCHES)
    zo_neighbors: int = option(4, "zero-order search: candidates per step (and initial random noises)", "sampling",
                               within=BATCH, applies="--search zero-order")
    zo_radius: float = option(0.5, "zero-order search: a neighbour is (pivot + radius x noise) / sqrt(1 + "
                              "radius²)", "sampling", within=POSITIVE, applies="--search zero-order")
    grid_prompts: int = option(8, "prompts shown in the report's image grid", "output", within=COUNT_OR_ZERO)
    device: str = option("auto", "auto, cpu, cuda or mps", "model", pattern=DEVICE)
    dtype: str = option("float32", "weights and compute dtype of the generators: float32, bfloat16 or float16 "
                        "(bfloat16 on a GPU for SDXL, SD3.5 and FLUX.1)", "model", choices=tuple(GENERATION_DTYPES))
    output_dir: str = option("runs/best_of_n", "folder of the results, curve and report", "output", path="output")
    cache_dir: str | None = option(None, "folder of generated candidates (PNG); share it between runs with other "
                                   "judges", "output", path="output")
    quiet: bool = option(False, "no progress bars (they are also off when stderr is not a terminal)", "output")
    max_api_cost: float = option(5.0, "refuse to start when the paid API judge calls are estimated above this many USD",
                                 "judge", within=COEFFICIENT)

    def validate(self) -> None:
        check_common_inputs(self)
        check_not_a_training_run(self, "python -m align.best_of_n")
        if self.search == "zero-order" and self.zo_neighbors > self.n:
            raise ConfigError(f"--zo_neighbors must be between 1 and --n ({self.n}), got {self.zo_neighbors}")


# ------------------------------------------------------------------------------------ the maths


def curve_sizes(n: int) -> list[int]:
    """1, 2, 4, ... up to n (n itself included when it is not a power of two)."""
    sizes = [1 << k for k in range(int(math.log2(n)) + 1)]
    return sizes if sizes[-1] == n else [*sizes, n]


def expected_best_of_n(selector: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """E[values of the selector's pick from a uniformly random n-subset], per row.

    selector, values: [prompts, N]. Ties in the selector are broken by candidate index.
    """
    sel = np.asarray(selector, dtype=np.float64)
    val = np.asarray(values, dtype=np.float64)
    total = sel.shape[1]
    if not 1 <= n <= total:
        raise ValueError(f"n must be between 1 and {total}, got {n}")
    order = np.lexsort((np.arange(total)[None].repeat(sel.shape[0], 0), np.nan_to_num(sel, nan=-np.inf)), axis=1)
    ranked = np.take_along_axis(val, order, axis=1)
    # weight of the r-th smallest (r = 1..N): C(r-1, n-1) / C(N, n)
    weights = np.array([math.comb(r - 1, n - 1) for r in range(1, total + 1)], dtype=np.float64) / math.comb(total, n)
    return ranked @ weights


def knockout_winners(compare, num_candidates: int) -> dict[int, int]:
    """Winners of a single-elimination bracket over candidates 0..N-1, for every prefix size 2^k.

    ``compare(pairs) -> list[bool]`` says, for each (a, b), whether a beats b. The winner of the
    first 2^k candidates is the winner of that sub-bracket, so one bracket gives every curve point.
    """
    winners = {1: 0}
    alive = list(range(num_candidates))
    size = 1
    while len(alive) > 1:
        pairs = [(alive[i], alive[i + 1]) for i in range(0, len(alive) - 1, 2)]
        results = compare(pairs)
        nxt = [a if a_wins else b for (a, b), a_wins in zip(pairs, results)]
        if len(alive) % 2:
            nxt.append(alive[-1])  # a bye
        alive = nxt
        size *= 2
        if size <= num_candidates:
            winners[size] = alive[0]
    winners[num_candidates] = alive[0]
    return winners


def neighbour_noise(pivot: torch.Tensor, radius: float, generator: torch.Generator) -> torch.Tensor:
    """A noise near ``pivot`` that is still standard normal when the pivot is (variance kept at 1)."""
    step = torch.randn(pivot.shape, generator=generator, dtype=pivot.dtype)
    return (pivot + radius * step) / math.sqrt(1 + radius**2)


# ---------------------------------------------------------------------------------- generation


def candidate_seed(seed: int, prompt_index: int, k: int) -> int:
    return derive_seed(seed, prompt_index, k)


def latent_shape(pipe, resolution: int | None) -> tuple[int, int, int]:
    """(C, h, w) of the starting noise, as the family's latents (FLUX: before packing into tokens)."""
    family = family_of_pipeline(pipe)
    return family.latent_shape(pipe, resolution or family.native_resolution(pipe))


def pipeline_latents(pipe, noise: torch.Tensor) -> torch.Tensor:
    """``noise`` [B, C, h, w] in the layout the pipeline's ``latents=`` argument takes (the family's: FLUX pipelines
    take latents packed into 2 x 2 patch tokens, what they draw for a seed being this noise, packed)."""
    return family_of_pipeline(pipe).pipeline_latents(pipe, noise)


def seed_noise(seed: int, shape: tuple) -> torch.Tensor:
    """The initial noise diffusers draws for ``torch.Generator('cpu').manual_seed(seed)``."""
    return torch.randn((1, *shape), generator=torch.Generator("cpu").manual_seed(int(seed)))[0]


@torch.no_grad()
def generate_from_noise(pipe, prompts: list[str], noises: torch.Tensor, settings: dict, batch_size: int,
                        progress: str | None = None) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] from explicit initial noises [N, C, h, w]; ``progress``: a bar's label."""
    out = []
    family = family_of_pipeline(pipe)
    denoiser = family.denoiser(pipe)
    for start in progress_bar(range(0, len(prompts), batch_size), desc=progress, unit="batch", enabled=progress is not None):
        chunk = slice(start, start + batch_size)
        result = pipe(
            latents=pipeline_latents(pipe, noises[chunk].to(denoiser.device, denoiser.dtype)),
            num_inference_steps=settings["num_inference_steps"],
            height=settings["resolution"],
            width=settings["resolution"],
            output_type="pt",
            **family.call_arguments(pipe, list(prompts[chunk]), settings["guidance_scale"], settings["resolution"]),
        )
        out.append(result.images.float().cpu())
    return torch.cat(out)


# -------------------------------------------------------------------------------------- the run


def check_inputs(config: BestOfNConfig):
    config.validate()
    try:
        if not (Path(config.model).expanduser() / "final").is_dir():
            check_model(config.model)
            check_sampling_steps(config.model, config.num_inference_steps)
    except ModelLoadError as err:
        raise ConfigError(str(err)) from None
    check_weight_files("--model", config.model)  # a truncated file is named before any generation
    if config.base_model:
        check_weight_files("--base_model", config.base_model)
    check_judge_names([config.reward, *split_list(config.eval_judges)], "--reward/--eval_judges")
    try:
        return load_prompt_set(config.prompts, config.num_prompts, seed=config.prompt_seed)
    except PromptSetError as err:
        raise ConfigError(str(err)) from None


def score_all(judge, prompts: list[str], images: torch.Tensor, num_candidates: int) -> np.ndarray:
    """Pointwise scores of every candidate: [prompts, N]."""
    flat = [p for p in prompts for _ in range(num_candidates)]
    return judge.score(flat, images.flatten(0, 1)).detach().float().cpu().numpy().reshape(len(prompts), num_candidates)


def best_of_n(config: BestOfNConfig) -> dict:

    prompt_set = check_inputs(config)
    prompts = prompt_set.prompts
    out = Path(config.output_dir)
    # A run killed mid-write left temporary files in its folder: the rerun removes them (a --cache_dir elsewhere is
    # left alone: other runs may be writing there; a stray temporary file there is never read).
    if out.is_dir():
        clean_interrupted_writes(out)
    selector = load_judge(config.reward)
    others = {spec: load_judge(spec) for spec in split_list(config.eval_judges)}
    check_judges_take_prompts([selector, *others.values()], prompts, "--prompts")
    # The paid judge calls, priced before any is made (refused above --max_api_cost).
    guard_api_cost(best_of_n_api_plan(selector, others, len(prompts), config.n, len(curve_sizes(config.n)),
                                      config.search == "zero-order"), config.max_api_cost)
    settings = sampling_settings(config, config.base_model or config.model)
    num_prompts, n = len(prompts), config.n
    print(f"[best_of_n] {num_prompts} prompts x {n} candidates = {num_prompts * n} images; selector {config.reward}", flush=True)

    # 1. N candidates per prompt, from seeded noises (candidate k of prompt i: derive_seed(seed, i, k)),
    #    cached as PNG so a run with another selector re-uses them
    items = [(p, candidate_seed(config.seed, i, k)) for i, p in enumerate(prompts) for k in range(n)]
    cache = GenerationCache(Path(config.cache_dir or out / "candidates"), ModelEntry(Path(config.model).name or config.model, config.model), settings, config.base_model)
    missing = len(cache.missing(items))
    todo = cache.unfinished_batches(items, config.batch_size)  # whole batches, as the first run made them
    # The model loads only when something is generated: a rerun with another selector finds every candidate cached.
    pipe = shape = None
    if todo or config.search == "zero-order":
        pipe = load_trained(config.model, dtype=generation_dtype(settings), device=resolve_device(config.device),
                            base=config.base_model)
        shape = latent_shape(pipe, settings["resolution"])
    if todo:
        noises = torch.stack([seed_noise(s, shape) for _, s in todo])
        for (prompt, s), image in zip(todo, generate_from_noise(pipe, [p for p, _ in todo], noises, settings, config.batch_size,
                                                                         progress="candidates")):
            cache.save_missing(prompt, s, image)
    print(f"[best_of_n] {missing} candidates generated, {len(items) - missing} cached", flush=True)
    images = cache.load(items)
    images = images.view(num_prompts, n, *images.shape[1:])

    # 2. the selector picks; every other judge scores the same candidates
    sizes = curve_sizes(n)
    curves: dict[str, list[float]] = {}
    errors: dict[str, list[float]] = {}
    pointwise = selector.pointwise
    eval_scores = {spec: score_all(j, prompts, images, n) for spec, j in others.items() if j.pointwise}
    if pointwise:
        sel = score_all(selector, prompts, images, n)
        chosen = np.argmax(np.nan_to_num(sel, nan=-np.inf), axis=1)
        for spec, values in {config.reward: sel, **eval_scores}.items():
            per_size = [expected_best_of_n(sel, values, k) for k in sizes]
            curves[spec], errors[spec] = _mean_sem(per_size)
        # the pick among the first k candidates, for judges that can only compare
        picks = [{k: int(np.argmax(np.nan_to_num(sel[i, :k], nan=-np.inf))) for k in sizes} for i in range(num_prompts)]
    else:
        picks = [knockout_winners(_pairwise_compare(selector, prompts[i], images[i]), n) for i in range(num_prompts)]
        chosen = np.array([p[n] for p in picks])
        for spec, values in eval_scores.items():
            curves[spec], errors[spec] = _mean_sem([np.array([values[i, picks[i][k]] for i in range(num_prompts)]) for k in sizes])
    # a pairwise-only second judge: win rate of the pick at each N against the N = 1 pick
    for spec, judge in others.items():
        if spec in eval_scores:
            continue
        per_size = []
        first = torch.stack([images[i, picks[i][1]] for i in range(num_prompts)])
        for k in sizes:
            pick = torch.stack([images[i, picks[i][k]] for i in range(num_prompts)])
            per_size.append(compare_shuffled(judge, prompts, pick, first, np.random.default_rng(config.seed)))
        curves[f"{spec} (win rate vs N=1)"], errors[f"{spec} (win rate vs N=1)"] = _mean_sem(per_size)

    zero_order = None
    if config.search == "zero-order":
        if not pointwise:
            raise ConfigError("--search zero-order needs a pointwise selector (a judge with scores)")
        zero_order = run_zero_order(pipe, selector, prompts, shape, settings, config, eval_judges={s: others[s] for s in eval_scores})

    # 3. the chosen images, results and report
    for i in range(num_prompts):
        atomic_write_bytes(out / "chosen" / f"{i:04d}.png", png_bytes(images[i, chosen[i]]))
    results = {
        "config": asdict(config),
        "prompts": prompts,
        "sampling": settings,
        "selector": config.reward,
        "selector_mode": "pointwise" if pointwise else "knockout",
        "sizes": sizes,
        "curves": curves,
        "sem": errors,
        "gain": {spec: values[-1] - values[0] for spec, values in curves.items()},
        "chosen": chosen.tolist(),
        "scores": {**({config.reward: sel.tolist()} if pointwise else {}), **{s: v.tolist() for s, v in eval_scores.items()}},
        "zero_order": zero_order,
    }
    atomic_write_text(out / "results.json", json.dumps(results, indent=1))
    write_best_of_n_report(out / "report.html", results, images, chosen, config.grid_prompts)
    for judge in [selector, *others.values()]:
        judge.close()
    return results


def _mean_sem(per_size: list) -> tuple[list[float], list[float]]:
    """Mean over prompts and its standard error, per curve point (NaN = no answer, left out)."""
    means, sems = [], []
    for values in per_size:
        mean, sem = mean_and_sem(values)
        means.append(mean)
        sems.append(0.0 if math.isnan(sem) else sem)  # one answer: no spread to show
    return means, sems


def _pairwise_compare(judge, prompt: str, candidates: torch.Tensor):
    def compare(pairs):
        prefs = judge.compare([prompt] * len(pairs), candidates[[a for a, _ in pairs]], candidates[[b for _, b in pairs]])
        # a tie or abstention keeps the earlier candidate (the bracket needs a winner)
        return [pref.winner != 1 for pref in prefs]

    return compare


def run_zero_order(pipe, selector, prompts, shape, settings, config: BestOfNConfig, eval_judges: dict) -> dict:
    """Ma et al.'s zero-order search with the same budget of N candidates per prompt."""
    k, budget = config.zo_neighbors, config.n
    gen = torch.Generator("cpu").manual_seed(config.seed + 7919)
    # start: the best of k random noises (seeded apart from the random-search candidates)
    pivots = torch.stack([seed_noise(candidate_seed(config.seed + 1, i, j), shape) for i in range(len(prompts)) for j in range(k)])
    pivots = pivots.view(len(prompts), k, *shape)
    best_scores = np.full(len(prompts), -np.inf)
    best_images = [None] * len(prompts)
    best_noise = torch.zeros(len(prompts), *shape)
    used, trace = 0, []
    candidates = pivots
    while used + k <= budget:
        flat_prompts = [p for p in prompts for _ in range(k)]
        imgs = generate_from_noise(pipe, flat_prompts, candidates.flatten(0, 1), settings, config.batch_size)
        scores = selector.score(flat_prompts, imgs).float().numpy().reshape(len(prompts), k)
        imgs = imgs.view(len(prompts), k, *imgs.shape[1:])
        for i in range(len(prompts)):
            j = int(np.nanargmax(scores[i])) if not np.all(np.isnan(scores[i])) else 0
            if scores[i, j] > best_scores[i]:
                best_scores[i], best_images[i], best_noise[i] = scores[i, j], imgs[i, j], candidates[i, j]
        used += k
        trace.append({"candidates": used, "selector": float(np.mean(best_scores))})
        candidates = torch.stack([torch.stack([neighbour_noise(best_noise[i], config.zo_radius, gen) for _ in range(k)]) for i in range(len(prompts))])
    result = {"trace": trace, "selector_final": float(np.mean(best_scores))}
    for spec, judge in eval_judges.items():
        result[f"{spec}_final"] = float(judge.score(prompts, torch.stack(best_images)).float().mean())
    return result


def write_best_of_n_report(path: Path, results: dict, images: torch.Tensor, chosen: np.ndarray, grid_prompts: int) -> None:
    sizes = results["sizes"]
    series = {spec: (sizes, values, results["sem"][spec]) for spec, values in results["curves"].items()}
    rows = [{"N": size, **{spec: values[i] for spec, values in results["curves"].items()}} for i, size in enumerate(sizes)]
    sections = [
        report.Section(
            "Setup",
            report.paragraph(
                f"selector: {results['selector']} ({results['selector_mode']}); {len(results['prompts'])} prompts; "
                f"sampling {json.dumps(results['sampling'])}. Values are means over prompts of the expected score of the "
                "selector's pick from N random candidates (error bars: standard error over prompts)."
            ),
        ),
        report.Section("Reward against N", report.table_html(rows, table_id="curve-table")),
    ]
    if series:
        # one plot per judge: their scales differ
        plots = [
            report.img_tag(report.line_plot({spec: values}, title=spec, xlabel="N (candidates per prompt)", ylabel="score", logx=True, size=(4.5, 3.2)), alt=f"{spec} against N")
            for spec, values in series.items()
        ]
        sections.append(report.Section("Curves", "".join(plots)))
    if results["zero_order"]:
        trace = results["zero_order"]["trace"]
        zo = report.line_plot(
            {
                "zero-order": ([t["candidates"] for t in trace], [t["selector"] for t in trace]),
                "best-of-N (random search)": (sizes, results["curves"].get(results["selector"], [float("nan")] * len(sizes))),
            },
            title="search with the same budget",
            xlabel="candidates generated",
            ylabel=results["selector"],
            logx=True,
        )
        sections.append(report.Section("Zero-order search", report.table_html([results["zero_order"] | {"trace": len(trace)}]) + report.img_tag(zo, alt="zero-order")))
    shown = range(min(grid_prompts, len(results["prompts"])))
    cells = [[images[i, 0], images[i, int(chosen[i])]] for i in shown]
    sections.append(
        report.Section(
            "Chosen images",
            report.image_grid_html(cells, [results["prompts"][i] for i in shown], ["candidate 0 (N = 1)", f"best of {sizes[-1]}"], width=128, corner="prompt"),
        )
    )
    report.write_report(path, sections, title="Best-of-N")


def main(argv: list[str] | None = None) -> None:
    config = parse_config(BestOfNConfig, argv, description=__doc__)
    quiet_output(config.quiet)
    try:
        check_inputs(config)
        results = best_of_n(config)  # its judges load first: an unusable one stops it before any generation
    except (ConfigError, ModelLoadError) as err:  # ModelLoadError: a missing, truncated or corrupt weights file
        die(str(err))
    except (JudgeAnswerError, JudgeNotReadyError) as err:  # a judge that answered no valid score, or stopped answering
        die(str(err), code=3)
    except OSError as err:  # a full disk: one line
        die_if_disk_full(err, "rerun with --resume latest")
    print(f"[best_of_n] wrote {Path(config.output_dir) / 'results.json'} and report.html")
    for spec, values in results["curves"].items():
        points = ", ".join(f"N={s}: {v:.4f}" for s, v in zip(results["sizes"], values))
        print(f"  {spec}: {points}  (gain {results['gain'][spec]:+.4f})")


if __name__ == "__main__":
    main()

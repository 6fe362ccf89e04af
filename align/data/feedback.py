"""AI feedback: generate K images per prompt, ask a judge, write preference pairs.

Output: one parquet file in the Pick-a-Pic schema (``caption, jpg_0, jpg_1, label_0, label_1``, PNG
bytes) plus ``seed_0, seed_1, prompt_index, judge, judge_raw, abstained``, readable by
``align.data.pair_stream.load_pairs``.

Which images are paired:
- pointwise judges (``Judge.pointwise``): all K images are scored; the best and the worst
  form the pair (stored in generation order; all K scores are in ``judge_raw``);
- pairwise-native judges: adjacent images are compared, (0, 1), (2, 3), ..., so K must be even and
  each prompt gives K/2 pairs.
Labels: 1/0 for a win, 0.5/0.5 for a tie; an abstention (no usable answer) is kept for audit with
NaN labels and ``abstained`` True, and is never a training pair.

Sealed: every file (the shards below and the merged file) carries a digest of its rows in its metadata, checked
when it is read back; a file without it, or changed, is refused in one line (align.data.sealed_parquet).

Resumable: each batch of prompts is written as an atomic shard in ``<out_path>.parts/``; the shards
are merged into ``out_path`` (atomically) when the run ends, also when it ends with an error, and
at the start of the next run if the process was killed. A rerun skips the prompts already labelled
(same prompt index and caption).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from align.data.pairs import DataError
from align.data.sealed_parquet import SealedParquetWriter, sealed_problem, write_sealed_table
from align.families import family_of_pipeline
from align.progress import progress_bar
from align.run_folder import atomic_path
from rewards.base import Judge, JudgeAnswerError, Preference, preference_from_scores
from rewards.images import encode_png, to_pil
from rewards.mllm import JudgeNotReadyError
from rewards.secrets import scrub_text


def feedback_schema():
    """The feedback parquet's columns: the Pick-a-Pic schema plus the seeds, the judge and its raw answer."""
    import pyarrow as pa

    return pa.schema(
        [
            ("caption", pa.string()),
            ("jpg_0", pa.binary()),
            ("jpg_1", pa.binary()),
            ("label_0", pa.float64()),
            ("label_1", pa.float64()),
            ("seed_0", pa.int64()),
            ("seed_1", pa.int64()),
            ("prompt_index", pa.int64()),
            ("judge", pa.string()),
            ("judge_raw", pa.string()),
            ("abstained", pa.bool_()),
        ]
    )


GenerateImages = Callable[[list[str], list[int]], list[Image.Image]]


# Pointwise judges: pair the best with the worst of the K images, or label every pair of them.
PAIRINGS = ("best_worst", "all")

@dataclass
class FeedbackStats:
    out_path: str = ""
    prompts_total: int = 0
    labelled: int = 0  # prompts labelled in this run
    skipped: int = 0  # prompts already labelled by an earlier run
    pairs: int = 0  # rows written in this run (ties and abstentions included)
    ties: int = 0
    abstained: int = 0
    images_generated: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"feedback -> {self.out_path}: {self.labelled} prompts labelled, {self.skipped} already done "
            f"(of {self.prompts_total}); {self.pairs} pairs written ({self.ties} ties, "
            f"{self.abstained} abstentions); {self.images_generated} images in {self.seconds:.1f} s"
        )


def derive_seed(seed: int, prompt_index: int, k: int) -> int:
    """The generation seed of image k of prompt ``prompt_index``: a hash, so runs with different base
    seeds do not share images; 32 bits so any RNG (torch, numpy) accepts it."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{k}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def pairwise_scheme(images_per_prompt: int) -> list[tuple[int, int]]:
    """Pairs compared by a pairwise-native judge: adjacent images (0, 1), (2, 3), ..."""
    return [(k, k + 1) for k in range(0, images_per_prompt - 1, 2)]


def parts_dir(out_path: str | Path) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".parts")


def generate_feedback(
    generate_images: GenerateImages,
    judge: Judge,
    prompts: list[str],
    out_path: str | Path,
    images_per_prompt: int = 2,
    seed: int = 0,
    batch_prompts: int = 4,
    progress: bool = True,
    pairing: str = "best_worst",
) -> FeedbackStats:
    """Label ``prompts`` with ``judge`` and write preference pairs to ``out_path`` (see module doc).

    generate_images(prompts, seeds) -> one PIL image per (prompt, seed); image i must be reproducible
    from seeds[i] alone (see ``make_pipeline_generator``).
    """
    _check_arguments(judge, prompts, out_path, images_per_prompt, batch_prompts)
    if pairing not in PAIRINGS:
        raise DataError(f"pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
    started = time.monotonic()
    out_path = Path(out_path)
    _merge_parts(out_path)  # a killed earlier run may have left shards
    done = _labelled_prompts(out_path, prompts, seed, images_per_prompt)
    todo = [i for i in range(len(prompts)) if i not in done]
    stats = FeedbackStats(str(out_path), prompts_total=len(prompts), skipped=len(prompts) - len(todo))

    bar = progress_bar(total=len(todo), desc=f"feedback ({judge.name})", unit="prompt", enabled=progress)
    try:
        for start in range(0, len(todo), batch_prompts):
            indices = todo[start : start + batch_prompts]
            rows = _label_batch(generate_images, judge, prompts, indices, images_per_prompt, seed, stats, pairing)
            _write_part(out_path, rows)
            stats.labelled += len(indices)
            bar.update(len(indices))
    finally:
        bar.close()
        _merge_parts(out_path)
        stats.seconds = time.monotonic() - started
    return stats


def _check_arguments(judge, prompts, out_path, images_per_prompt, batch_prompts) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise DataError(
            "generate_feedback needs a non-empty list of prompt strings (see align.data.pairs.load_prompts)"
        )
    if images_per_prompt < 2:
        raise DataError(f"images_per_prompt must be at least 2 to form a pair, got {images_per_prompt}")
    if not judge.pointwise and images_per_prompt % 2:
        raise DataError(
            f"judge {judge.name!r} compares adjacent pairs (0,1), (2,3), ...; images_per_prompt must be even, "
            f"got {images_per_prompt}"
        )
    if batch_prompts < 1:
        raise DataError(f"batch_prompts must be a positive number of prompts, got {batch_prompts}")
    if Path(out_path).suffix != ".parquet":
        raise DataError(f"feedback out_path {str(out_path)!r} must be a .parquet file")


def _label_batch(generate_images, judge, prompts, indices, images_per_prompt, seed, stats, pairing="best_worst") -> list[dict]:
    """Generate K images for each prompt in ``indices``, judge them and return the parquet rows."""
    k_range = range(images_per_prompt)
    batch_prompts = [prompts[i] for i in indices for _ in k_range]
    seeds = [derive_seed(seed, i, k) for i in indices for k in k_range]
    images = generate_images(batch_prompts, seeds)
    if len(images) != len(seeds):
        raise RuntimeError(
            f"generate_images returned {len(images)} images for {len(seeds)} (prompt, seed) pairs"
        )
    images = to_pil(images)
    stats.images_generated += len(images)

    # one list of (prompt index, image a, image b, Preference, raw) per batch
    verdicts: list[tuple[int, int, int, Preference, dict]] = []
    if not judge.pointwise:
        pairs = [
            (n, n * images_per_prompt + a, n * images_per_prompt + b)
            for n in range(len(indices))
            for a, b in pairwise_scheme(images_per_prompt)
        ]
        preferences = _asked(judge, lambda: judge.compare(
            [batch_prompts[a] for _, a, _ in pairs],
            [images[a] for _, a, _ in pairs],
            [images[b] for _, _, b in pairs],
        ))
        if len(preferences) != len(pairs):
            raise RuntimeError(
                f"judge {judge.name!r} answered {len(preferences)} comparisons for {len(pairs)} pairs"
            )
        for (n, a, b), pref in zip(pairs, preferences):
            raw = {"prob_0": pref.prob_a, "tie": pref.tie, "raw": pref.raw}
            verdicts.append((n, a, b, pref, raw))
    else:
        scores = _asked(judge, lambda: judge.score(batch_prompts, images)).detach().float().cpu().tolist()
        for n in range(len(indices)):
            offset = n * images_per_prompt
            own = scores[offset : offset + images_per_prompt]
            if pairing == "all":  # every pair of the K images: K(K-1)/2 labelled pairs from the same generations
                labelled = [(a, b, preference_from_scores(own[a], own[b], judge.tie_margin))
                            for a, b in itertools.combinations(range(images_per_prompt), 2)]
            else:
                labelled = [_best_vs_worst(own, judge.tie_margin)]
            for a, b, pref in labelled:
                raw = {"scores": own, "pair": [a, b], "prob_0": pref.prob_a}
                verdicts.append((n, offset + a, offset + b, pref, raw))

    rows = []
    for n, a, b, pref, raw in verdicts:
        label_0, label_1 = _labels(pref)
        stats.pairs += 1
        stats.ties += pref.tie or (not pref.abstained and pref.winner is None)
        stats.abstained += pref.abstained
        rows.append(
            {
                "caption": batch_prompts[a],
                "jpg_0": encode_png(images[a]),
                "jpg_1": encode_png(images[b]),
                "label_0": label_0,
                "label_1": label_1,
                "seed_0": seeds[a],
                "seed_1": seeds[b],
                "prompt_index": indices[n],
                "judge": judge.name,
                "judge_raw": scrub_text(json.dumps(raw, default=str)),  # a judge's words, secrets masked
                "abstained": pref.abstained,
            }
        )
    return rows


def _asked(judge: Judge, question):
    """A judge's answers; one that gave no valid score (JudgeAnswerError) or stopped answering (JudgeNotReadyError)
    stops the labelling in one line (DataError; the answers it gave are in its cache)."""
    try:
        return question()
    except (JudgeAnswerError, JudgeNotReadyError) as err:
        raise DataError(str(err)) from None


def _best_vs_worst(scores: list[float], tie_margin: float) -> tuple[int, int, Preference]:
    """The (lower, higher) generation indices of the best- and worst-scored images, and the verdict."""
    valid = [k for k, s in enumerate(scores) if not math.isnan(s)]
    if len(valid) < 2:
        return 0, 1, Preference(0.5, abstained=True, raw="fewer than two images got a score")
    ranked = sorted(valid, key=lambda k: scores[k])  # stable: equal scores keep generation order
    a, b = sorted((ranked[0], ranked[-1]))
    return a, b, preference_from_scores(scores[a], scores[b], tie_margin)


def _labels(pref: Preference) -> tuple[float, float]:
    if pref.abstained:
        return math.nan, math.nan
    if pref.winner is None:
        return 0.5, 0.5
    return (1.0, 0.0) if pref.winner == 0 else (0.0, 1.0)


# ------------------------------------------------------------------------------------- resume


def check_sealed(path: Path, out_path: Path) -> None:
    """A feedback file (or one of its parts) read back is the one written: its rows' digest matches (one line
    otherwise: relabelling costs compute only, since a judge's answers are cached where they were paid for)."""
    if problem := sealed_problem(path):
        raise DataError(f"feedback file {path} {problem}; delete {out_path} (and {parts_dir(out_path).name}/ beside "
                        "it) to label its prompts again")


def _labelled_prompts(out_path: Path, prompts, seed: int, images_per_prompt: int) -> set[int]:
    """Prompt indices already in ``out_path``; refuses a file written for other prompts or seeds, or changed since."""
    if not out_path.exists():
        return set()
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(out_path, columns=["prompt_index", "caption", "seed_0"])
    except (pa.ArrowException, OSError, KeyError) as err:
        raise DataError(
            f"{out_path} exists but is not a feedback parquet file ({err}); choose another out_path"
        ) from err
    check_sealed(out_path, out_path)
    done = set()
    for index, caption, seed_0 in zip(
        *(table.column(c).to_pylist() for c in ("prompt_index", "caption", "seed_0"))
    ):
        if index >= len(prompts) or prompts[index] != caption:
            now = repr(prompts[index]) if index < len(prompts) else "missing"
            raise DataError(
                f"{out_path} holds feedback for another prompt list: its prompt {index} is {caption!r}, now "
                f"{now}; use the same prompts (more may be appended) or a new out_path"
            )
        if seed_0 not in {derive_seed(seed, index, k) for k in range(images_per_prompt)}:
            raise DataError(
                f"{out_path} was written with another seed or images_per_prompt (prompt {index}); "
                f"rerun with the same settings or use a new out_path"
            )
        done.add(index)
    return done


def _write_part(out_path: Path, rows: list[dict]) -> None:
    folder = parts_dir(out_path)
    folder.mkdir(parents=True, exist_ok=True)
    number = 1 + max((int(p.stem.split("-")[1]) for p in folder.glob("part-*.parquet")), default=-1)
    import pyarrow as pa

    with atomic_path(folder / f"part-{number:06d}.parquet") as tmp:
        write_sealed_table(pa.Table.from_pylist(rows, schema=feedback_schema()), tmp)


def _merge_parts(out_path: Path) -> None:
    """Fold the shards into ``out_path`` (streamed, atomic), then remove them. Rows of a prompt that
    is already in an earlier source (a crash between replace and cleanup) are not repeated."""
    folder = parts_dir(out_path)
    parts = sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []
    if not parts:
        if folder.is_dir():
            shutil.rmtree(folder)
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    sources = ([out_path] if out_path.exists() else []) + parts
    for source in sources:
        check_sealed(source, out_path)
    seen: set[int] = set()
    schema = feedback_schema()
    with atomic_path(out_path) as tmp:
        with SealedParquetWriter(tmp, schema) as writer:
            for source in sources:
                table = pq.read_table(source).select(schema.names).cast(schema)
                indices = table.column("prompt_index").to_pylist()
                keep = [i not in seen for i in indices]
                writer.write_table(table.filter(pa.array(keep)))
                seen.update(indices)
    shutil.rmtree(folder)


# ------------------------------------------------------------------------------- image source


def make_pipeline_generator(
    pipe,
    num_inference_steps: int,
    guidance_scale: float,
    height: int | None = None,
    width: int | None = None,
    batch_size: int = 8,
    **call_kwargs,
) -> GenerateImages:
    """A ``generate_images(prompts, seeds)`` over a diffusers pipeline of any family (SD, SDXL, SD3, FLUX).

    Each image gets its own CPU ``torch.Generator(seed)``, so image i depends on seeds[i] only (not on
    the batch it shares or the device), and can be regenerated from the seed stored in the parquet.
    The family's own call arguments (a flow testbed's ``max_sequence_length``) come first; ``call_kwargs``
    override them.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be a positive number of images, got {batch_size}")

    family = family_of_pipeline(pipe)
    if family.edits and height is None and width is None:  # the size the family samples (an editing pipeline's own
        height = width = family.native_resolution(pipe)      # default follows the source's size instead)

    def generate_images(prompts: list[str], seeds: list[int]) -> list[Image.Image]:
        if len(prompts) != len(seeds):
            raise ValueError(
                f"generate_images needs one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds"
            )
        images: list[Image.Image] = []
        for start in range(0, len(prompts), batch_size):
            chunk_seeds = seeds[start : start + batch_size]
            arguments = family.call_arguments(pipe, list(prompts[start : start + batch_size]), guidance_scale, height)
            output = pipe(
                generator=[torch.Generator("cpu").manual_seed(int(s)) for s in chunk_seeds],
                num_inference_steps=num_inference_steps,
                height=height,
                width=width,
                output_type="pil",
                **{**arguments, **call_kwargs},
            )
            images.extend(output.images)
        return images

    return generate_images


__all__ = [
    "feedback_schema",
    "FeedbackStats",
    "derive_seed",
    "generate_feedback",
    "make_pipeline_generator",
    "pairwise_scheme",
]

"""Seeded generation with a cache on disk, shared by evaluation and best-of-N.

Every model draws the same initial noise for the same (prompt, seed) (``sample_seed``), so differences between
models come from the weights alone; images are cached as PNG files keyed by the model's files and the sampling
settings, so a second run generates only what is new.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from align import pipeline  # load_trained and generate_images looked up at call time: tests replace them
from align.eval.report import png_bytes
from align.families import family_of, pipeline_class_name
from align.pipeline import base_of, resolve_model, testbed_settings
from align.progress import progress_bar
from align.run_folder import atomic_write_bytes, atomic_write_text
from rewards.images import load_image, to_tensor


@dataclass
class ModelEntry:
    name: str
    path: str


def sample_seed(seed: int, prompt: str) -> int:
    """The generation seed of (prompt, seed): the same for every model, 32 bits for any RNG."""
    digest = hashlib.blake2b(f"{seed}\x00{prompt}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:limit] or "x"


MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".yaml", ".txt", ".model")  # .model: T5's sentencepiece


def model_fingerprint(path: str) -> str:
    """Changes when the model's files change (a re-trained run folder gets fresh images)."""
    p = Path(resolve_model(path)).expanduser()
    if not p.exists():
        return path  # a hub id: its revision is fixed by the hub cache
    parts = []
    for f in sorted(p.rglob("*")):
        if f.is_file() and f.suffix in MODEL_FILE_SUFFIXES and "checkpoints" not in f.parts:
            stat = f.stat()
            parts.append(f"{f.relative_to(p)}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()


class GenerationCache:
    """PNG files per model and settings: <root>/<model-slug>-<hash>/<prompt-hash>_s<seed>.png."""

    def __init__(self, root: Path, model: ModelEntry, settings: dict, base: str | None):
        # The base's files count too: a LoRA or denoiser-only folder's images change with the pipeline under it,
        # and so do the sampling settings stored there (a flow testbed's max_sequence_length).
        files = {"files": model_fingerprint(model.path)}
        if base and base != model.path:
            files["base_files"] = model_fingerprint(base)
        key = json.dumps({"model": model.path, **files, "base": base, **settings}, sort_keys=True)
        self.folder = root / f"{slug(model.name)}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
        self.meta = {"model": model.path, "name": model.name, "base": base, **settings}

    def path(self, prompt: str, seed: int) -> Path:
        return self.folder / f"{hashlib.sha1(prompt.encode()).hexdigest()[:16]}_s{seed}.png"

    def missing(self, items: list[tuple[str, int]]) -> list[tuple[str, int]]:
        return [(p, s) for p, s in items if not self.path(p, s).is_file()]

    def unfinished_batches(self, items: list[tuple[str, int]], batch_size: int) -> list[tuple[str, int]]:
        """The items of every batch (``items`` cut every ``batch_size``, as a first run generates them) that lacks
        an image. An image depends in its last bits on the batch it was generated in (the CPU's kernels differ by
        batch size), so a rerun after a kill generates an unfinished batch whole and saves only what is missing
        (save_missing): the cache ends as a straight run leaves it. Every batch but the last of ``items`` is full,
        so the list cut again every ``batch_size`` gives the same batches."""
        batches = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
        return [item for batch in batches if self.missing(batch) for item in batch]

    def save_missing(self, prompt: str, seed: int, image: torch.Tensor) -> None:
        if not self.path(prompt, seed).is_file():
            self.save(prompt, seed, image)

    def save(self, prompt: str, seed: int, image: torch.Tensor) -> None:
        if not (self.folder / "meta.json").is_file():
            atomic_write_text(self.folder / "meta.json", json.dumps(self.meta, indent=1))
        atomic_write_bytes(self.path(prompt, seed), png_bytes(image))

    def load(self, items: list[tuple[str, int]]) -> torch.Tensor:
        return to_tensor([load_image(self.path(p, s)) for p, s in items])


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


SD_CALL_DEFAULTS = {"num_inference_steps": 50, "guidance_scale": 7.5}  # StableDiffusionPipeline's


def pipeline_call_defaults(model: str) -> dict:
    """Steps and guidance that the model's own diffusers pipeline samples with when not told (read from its
    ``__call__`` signature: SD 50 / 7.5, SDXL 50 / 5.0, SD3 28 / 7.0, FLUX 28 / 3.5); SD's where the model's
    pipeline class cannot be read (a hub id offline)."""
    import diffusers

    try:
        parameters = inspect.signature(getattr(diffusers, pipeline_class_name(resolve_model(model))).__call__).parameters
    except Exception:  # no model_index.json, offline hub id, a class diffusers lacks: SD's defaults
        return dict(SD_CALL_DEFAULTS)
    return {key: parameters[key].default if key in parameters else value for key, value in SD_CALL_DEFAULTS.items()}


def model_family_name(model: str) -> str | None:
    """The family (``align.families``) of a pipeline folder, hub id or run folder (its base's); None where it
    cannot be told without loading anything (a bare LoRA folder, a hub id offline)."""
    try:
        return family_of(resolve_model(base_of(model))).name
    except Exception:
        return None


def settings_per_model(config, models: list[ModelEntry], base: str) -> dict[str, dict]:
    """Each model's sampling settings: the base's (so that models differ by their weights alone), except for a
    model of another family (SD v1.5 against FLUX), which samples with its own (testbed file or pipeline
    defaults); flags apply to every model."""
    shared = sampling_settings(config, base)
    base_family = model_family_name(base)
    out = {}
    for model in models:
        family = model_family_name(model.path)
        other_family = None not in (family, base_family) and family != base_family
        out[model.name] = sampling_settings(config, model.path) if other_family else shared
    return out


# Weights and compute dtype of a generator (--dtype). float32 is the default and leaves the cache key as it was;
# bfloat16 is what SDXL / SD3.5 / FLUX.1 are run in on one GPU (FLUX.1's 12 B transformer in float32 alone is 48 GB).
GENERATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def generation_dtype(settings: dict) -> torch.dtype:
    return GENERATION_DTYPES[settings.get("dtype", "float32")]


def sampling_settings(config, model_path: str) -> dict:
    """Steps, guidance and resolution (and the dtype, when not float32): flags first, then the (base) model's
    testbed.json (or flow_testbed.json), then its pipeline's own defaults."""
    base = base_of(model_path)
    try:
        stored = testbed_settings(base)
    except (OSError, ValueError):  # a hub id, or a folder without testbed.json (ModelLoadError is a ValueError)
        stored = {}
    if "num_inference_steps" not in stored or "guidance_scale" not in stored:
        stored = {**pipeline_call_defaults(base), **stored}
    settings = {
        "num_inference_steps": config.num_inference_steps or stored["num_inference_steps"],
        "guidance_scale": config.guidance_scale if config.guidance_scale is not None else stored["guidance_scale"],
        "resolution": config.resolution or stored.get("resolution"),
    }
    if getattr(config, "dtype", "float32") != "float32":  # images in another dtype are other images
        settings["dtype"] = config.dtype
    return settings


def generate_missing(cache: GenerationCache, model: ModelEntry, items, settings: dict, base: str | None, device: str, batch_size: int,
                     log_name: str = "evaluate") -> int:
    """Generate and cache the (prompt, seed) items not cached yet (in the batches of a first run, see
    GenerationCache.unfinished_batches); returns how many were missing."""
    missing = len(cache.missing(items))
    if not missing:
        return 0
    todo = cache.unfinished_batches(items, batch_size)
    print(f"[{log_name}] {model.name}: generating {missing} images ({len(items) - missing} cached)", flush=True)
    pipe = pipeline.load_trained(model.path, dtype=generation_dtype(settings), device=device, base=base)
    size = settings["resolution"]
    for start in progress_bar(range(0, len(todo), batch_size), desc=f"generate ({model.name})", unit="batch"):
        chunk = todo[start : start + batch_size]
        images = pipeline.generate_images(
            pipe,
            [p for p, _ in chunk],
            [sample_seed(s, p) for p, s in chunk],
            num_inference_steps=settings["num_inference_steps"],
            guidance_scale=settings["guidance_scale"],
            height=size,
            width=size,
            batch_size=batch_size,
        )
        for (prompt, seed), image in zip(chunk, images):
            cache.save_missing(prompt, seed, image)
    del pipe
    return missing

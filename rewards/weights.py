"""Finding and safely loading judge weights (hub ids, local folders, single files).

Shared by the scoring-model adapters. Every failure to find weights becomes one
``MissingWeightsError`` that names the judge, the source tried and how to fix it;
checkpoints load with ``weights_only=True`` (pickle code never runs) or from safetensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
from huggingface_hub import hf_hub_download
from safetensors.torch import load_file

T = TypeVar("T")


class MissingWeightsError(FileNotFoundError):
    """A judge's weights (or processor files) could not be found or downloaded."""


def offline_hint() -> str:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return " (HF_HUB_OFFLINE is set, so nothing is downloaded: pass a local folder or file)"
    return ""


def missing(judge: str, source: str, err: BaseException | str, what: str = "weights") -> MissingWeightsError:
    return MissingWeightsError(
        f"judge {judge!r}: cannot load {what} from {source!r}: {err}{offline_hint()}. "
        f"Pass model=<hub id, local folder or file> to use other weights."
    )


def resolve_file(source: str | os.PathLike, filename: str, judge: str) -> Path:
    """A local path to one checkpoint file.

    ``source`` may be the file itself, a local folder holding ``filename``, or a hub repo id
    (``filename`` is then downloaded, or read from the local hub cache).
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        candidate = path / filename
        if candidate.is_file():
            return candidate
        found = sorted(p.name for p in path.iterdir())[:20]
        raise missing(judge, str(source), f"folder has no {filename!r} (it holds: {found})")
    if not _looks_like_repo_id(str(source)):
        raise missing(judge, str(source), "no such file or folder (and it is not a hub repo id)")

    try:
        return Path(hf_hub_download(str(source), filename))
    except Exception as err:  # hub errors come in many classes; all mean "not available"
        raise missing(judge, f"{source}/{filename}", err) from err


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    checkpoint_suffix = text.endswith((".pt", ".pth", ".bin", ".safetensors"))
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~")) and not checkpoint_suffix


def load_state_dict(path: str | os.PathLike, judge: str) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file (.safetensors, or a torch pickle read with weights_only=True)."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"judge {judge!r}: cannot read checkpoint {str(path)!r} as safetensors or as a "
            f"weights-only torch file: {err}"
        ) from err


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """float16 on a GPU and float32 on a CPU unless asked otherwise."""
    if dtype is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def check_batch_size(batch_size: int) -> int:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return batch_size


def batched(items: list[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def check_prompts(prompts: Iterable[str], n_images: int, judge: str) -> list[str]:
    """One prompt per image (a single string is not accepted: it would be split into characters)."""
    if isinstance(prompts, str):
        raise TypeError(f"judge {judge!r}: prompts must be a list of strings, one per image, not a string")
    prompts = list(prompts)
    if len(prompts) != n_images:
        raise ValueError(f"judge {judge!r}: got {len(prompts)} prompts for {n_images} images; need one per image")
    bad = [p for p in prompts if not isinstance(p, str)]
    if bad:
        raise TypeError(f"judge {judge!r}: prompts must be strings, got {type(bad[0]).__name__}")
    return prompts

"""Judges for text-to-image alignment: ``rewards.load(name, **options)``.

Heavy imports (torch models, API SDKs) happen inside the adapter module that needs
them, so ``import rewards`` is fast and an API-only user needs no vision weights.
This package never imports ``align``.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from rewards.base import Judge, Preference, preference_from_scores
from rewards.differentiable import DIFFERENTIABLE_JUDGES, NotDifferentiableError, check_differentiable
from rewards.secrets import check_key_env_name
from rewards.spec import JudgeSpec, parse_judge, parse_judges

# name -> "module:factory". Factories take the judge options as keyword arguments.
_REGISTRY: dict[str, str] = {
    # rule judges (no weights)
    "jpeg-compressibility": "rewards.rules:JpegCompressibility",
    "jpeg-incompressibility": "rewards.rules:JpegIncompressibility",
    "random": "rewards.rules:RandomJudge",
    "first-image": "rewards.rules:FirstImageJudge",
    # the shapes testbed
    "shapes-oracle": "rewards.shapes:ShapesOracle",
    "shapes-edit-oracle": "rewards.shapes_edit_oracle:ShapesEditOracle",
    "shapes-clip": "rewards.clip:shapes_clip",
    # scoring models (MJ-Bench names)
    "clip": "rewards.clip:clip_score",
    "pickscore": "rewards.clip:pickscore",
    "aesthetic": "rewards.clip:aesthetic",
    "blip": "rewards.blip:BlipItm",
    "hps": "rewards.hps:HpsV21",
    "imagereward": "rewards.imagereward:image_reward",
    "vpscore": "rewards.imagereward:vp_score",
    "llava-reward": "rewards.llava_reward:LlavaReward",
    # API judges
    "gpt4o": "rewards.api:gpt4o",
    "gpt4v": "rewards.api:gpt4v",
    "gemini": "rewards.api:gemini",
    "claude": "rewards.api:claude",
    # local VLM judges (transformers)
    "llava-1.5-7b": "rewards.vlm:llava_15_7b",
    "llava-1.6-7b": "rewards.vlm:llava_16_7b",
    "idefics2-8b": "rewards.vlm:idefics2_8b",
    "instructblip": "rewards.vlm:instructblip",
    "qwen2.5-vl-7b": "rewards.vlm:qwen25_vl_7b",
    "internvl": "rewards.vlm:internvl",
    # rule rewards of the flow-RL papers on detectors / OCR (docs/judges_rules.md), and their testbed stand-ins
    "geneval": "rewards.geneval:geneval",
    "ocr": "rewards.ocr:ocr",
    "geneval-shapes": "rewards.geneval_shapes:geneval_shapes",
    "shapes-ocr": "rewards.ocr_shapes:shapes_ocr",
    # the flow-RL papers' VLM rewards (docs/judges_vlm_rewards.md): VQAScore's P("Yes"), UnifiedReward, HPSv3
    "vqascore-qwen2.5-vl-7b": "rewards.vqascore:qwen25_vl_7b",
    "vqascore-llava-1.5-7b": "rewards.vqascore:llava_15_7b",
    "vqascore-internvl": "rewards.vqascore:internvl",
    "unifiedreward": "rewards.unifiedreward:unifiedreward",
    "hpsv3": "rewards.hpsv3:HpsV3",
}

# "prefix:<model>" names, e.g. openai:gpt-4.1-mini for any OpenAI-compatible server (vLLM too).
_PREFIXES: dict[str, str] = {
    "openai": "rewards.api:openai_compatible",
    "anthropic": "rewards.api:anthropic_model",
    "google": "rewards.api:gemini_model",
    "hf-vlm": "rewards.vlm:hf_vlm",
    # VQAScore and UnifiedReward on any local checkpoint or OpenAI-compatible server (docs/judges_vlm_rewards.md)
    "vqascore-hf": "rewards.vqascore:vqascore_hf",
    "vqascore-openai": "rewards.vqascore_server:vqascore_openai",
    "unifiedreward-hf": "rewards.unifiedreward:unifiedreward_hf",
    "unifiedreward-openai": "rewards.unifiedreward_server:unifiedreward_openai",
}

# A folder written by ``align.train.reward_model`` carries this file and loads by path.
TRAINED_MARKER = "reward_model.json"


class UnknownJudgeError(ValueError):
    pass


class JudgeOptionError(ValueError):
    """An option (``name[key=value]`` or a keyword of ``load``) that the judge does not take."""


def available() -> list[str]:
    """Registered judge names (plus the 'prefix:<model>' forms)."""
    return sorted(_REGISTRY) + [f"{p}:<model>" for p in sorted(_PREFIXES)]


def _resolve(name: str) -> tuple[str, dict]:
    if name in _REGISTRY:
        return _REGISTRY[name], {}
    prefix, sep, model = name.partition(":")
    if sep and prefix in _PREFIXES and model:
        return _PREFIXES[prefix], {"model": model}
    path = Path(name).expanduser()
    for folder in (path, path / "final"):  # a trained model's folder, or the run folder holding it
        if folder.is_dir() and (folder / TRAINED_MARKER).is_file():
            return "rewards.trained:load_trained", {"path": str(folder)}
    raise UnknownJudgeError(f"unknown judge {name!r}; known judges: {', '.join(available())}")


def check_name(spec: str | JudgeSpec, allow_mix: bool = False) -> None:
    """Raise UnknownJudgeError for an unknown judge (or mix member, with allow_mix) without loading anything."""
    try:
        members = parse_judges(spec) if isinstance(spec, str) and allow_mix else [parse_judge(spec)]
    except ValueError as err:
        raise UnknownJudgeError(str(err)) from None
    for member in members:
        _resolve(member.name)
        check_key_env_name(member.options.get("api_key_env"))


def load(name: str | JudgeSpec, **options) -> Judge:
    """Load a judge by name, 'name[key=value]' spec or parsed ``JudgeSpec``, with adapter options."""
    spec = parse_judge(name)
    base, spec_options = spec.name, spec.options
    target, implied = _resolve(base)
    module_name, _, factory_name = target.partition(":")
    module = importlib.import_module(module_name)
    factory = getattr(module, factory_name)
    given = {**implied, **spec_options, **options}
    params = inspect.signature(factory).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [key for key in given if key not in accepted]
        if unknown:
            raise JudgeOptionError(
                f"judge {base!r} has no option {', '.join(map(repr, unknown))}; its options: {', '.join(accepted)}"
            )
    try:
        return factory(**given)
    except TypeError as err:  # a factory that passes its options on (API judges) to a class that refuses one
        if "unexpected keyword argument" not in str(err):
            raise
        raise JudgeOptionError(f"judge {base!r}: {err}") from None


__all__ = [
    "DIFFERENTIABLE_JUDGES",
    "Judge",
    "JudgeOptionError",
    "JudgeSpec",
    "NotDifferentiableError",
    "Preference",
    "UnknownJudgeError",
    "available",
    "check_differentiable",
    "check_name",
    "load",
    "parse_judge",
    "parse_judges",
    "preference_from_scores",
]

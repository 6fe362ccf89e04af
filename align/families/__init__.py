"""Model families: detected from a pipeline folder's ``model_index.json`` (see ``base.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from align.families.base import ModelFamily
from align.families.flux import Flux
from align.families.sd import StableDiffusion
from align.families.sd3 import StableDiffusion3
from align.families.sdxl import StableDiffusionXL

# One instance per family; a new family adds its class here.
FAMILIES: tuple[ModelFamily, ...] = (StableDiffusion(), StableDiffusionXL(), StableDiffusion3(), Flux())


class UnknownFamilyError(ValueError):
    pass


def family_named(class_name: str) -> ModelFamily:
    """The family whose pipeline class is ``class_name`` (model_index.json's ``_class_name``)."""
    for family in FAMILIES:
        if class_name in family.pipeline_class_names:
            return family
    known = ", ".join(name for family in FAMILIES for name in family.pipeline_class_names)
    raise UnknownFamilyError(f"pipeline class {class_name!r} is not supported; supported: {known}")


def pipeline_class_name(model: str) -> str:
    """``_class_name`` of a local folder's model_index.json, or of a hub id's (read through the hub cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        index = path / "model_index.json"
        return json.loads(index.read_text()).get("_class_name", "") if index.is_file() else ""
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.load_config(model).get("_class_name", "")


def family_of(model: str) -> ModelFamily:
    """The family of a pipeline folder or hub id."""
    return family_named(pipeline_class_name(model))


def family_of_pipeline(pipe) -> ModelFamily:
    """The family of a loaded pipeline."""
    return family_named(type(pipe).__name__)

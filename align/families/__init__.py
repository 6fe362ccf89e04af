"""Model families: detected from a pipeline folder's ``model_index.json`` (see ``base.py``)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from align.families.base import ModelFamily
from align.families.flux import Flux
from align.families.flux2 import Flux2
from align.families.flux_kontext import FluxKontext
from align.families.qwenimage import QwenImage
from align.families.qwenimage21 import QwenImage21
from align.families.qwenimage_edit import QwenImageEdit
from align.families.qwenimage_edit_plus import QwenImageEditPlus
from align.families.sd import StableDiffusion
from align.families.sd3 import StableDiffusion3
from align.families.sdxl import StableDiffusionXL
from align.families.zimage import ZImage

# One instance per family; a new family adds its class here.
FAMILIES: tuple[ModelFamily, ...] = (
    StableDiffusion(), StableDiffusionXL(), StableDiffusion3(), Flux(), QwenImage(), Flux2(), ZImage(), FluxKontext(),
    QwenImageEdit(), QwenImageEditPlus(), QwenImage21(),
)


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
        return _class_name(json.loads(index.read_text()), index) if index.is_file() else ""
    from diffusers import DiffusionPipeline

    return _class_name(DiffusionPipeline.load_config(model), model)


def _class_name(index, where) -> str:
    """model_index.json's ``_class_name``: the file must be a JSON object naming its pipeline class."""
    if not isinstance(index, dict) or not isinstance(index.get("_class_name", ""), str):
        raise UnknownFamilyError(f"{where} is not a pipeline index (a JSON object with a \"_class_name\" string); "
                                 "save or download the model again")
    return index.get("_class_name", "")


def check_pipeline_folder(folder: Path) -> None:
    """A local pipeline folder's model_index.json names a supported class, and every component that class cannot
    do without (its __init__ arguments with no default: SDXL's text_encoder_2, ...) is named there and has its
    folder: SD weights labelled SDXL are refused here in one line, before anything loads."""
    import diffusers

    index_file = folder / "model_index.json"
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UnknownFamilyError(f"{index_file} is not readable JSON ({type(err).__name__})") from None
    class_name = _class_name(index, index_file)
    family = family_named(class_name)
    pipeline_class = getattr(diffusers, class_name, None)
    if pipeline_class is None:
        return
    needed = [name for name, parameter in inspect.signature(pipeline_class.__init__).parameters.items()
              if name != "self" and parameter.default is inspect.Parameter.empty
              and parameter.kind is parameter.POSITIONAL_OR_KEYWORD]
    # A component the index leaves out is missing; one it names as [null, null] (safety_checker) is left out on
    # purpose; one it names must have its folder.
    missing = [name for name in needed
               if not isinstance(index.get(name), list) or (index[name][0] is not None and not (folder / name).is_dir())]
    if missing:
        raise UnknownFamilyError(
            f"{index_file} says {class_name} ({family.title}), which needs {', '.join(missing)}, and the folder has no such "
            "component: the index does not match the weights (save or download the model again)"
        )


def family_of(model: str) -> ModelFamily:
    """The family of a pipeline folder or hub id."""
    return family_named(pipeline_class_name(model))


def family_of_pipeline(pipe) -> ModelFamily:
    """The family of a loaded pipeline."""
    return family_named(type(pipe).__name__)

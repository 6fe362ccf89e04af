"""StableDiffusionXL family (being written in this session: only detection so far; every method raises NotImplementedError)."""

from __future__ import annotations

from align.families.base import ModelFamily


class StableDiffusionXL(ModelFamily):
    name = "sdxl"
    pipeline_class_names = ("StableDiffusionXLPipeline",)
    denoiser_name = "unet"
    is_flow = False

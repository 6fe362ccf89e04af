"""StableDiffusion3 family (being written in this session: only detection so far; every method raises NotImplementedError)."""

from __future__ import annotations

from align.families.base import ModelFamily


class StableDiffusion3(ModelFamily):
    name = "sd3"
    pipeline_class_names = ("StableDiffusion3Pipeline",)
    denoiser_name = "transformer"
    is_flow = True

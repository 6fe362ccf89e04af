"""Flux family (being written in this session: only detection so far; every method raises NotImplementedError)."""

from __future__ import annotations

from align.families.base import ModelFamily


class Flux(ModelFamily):
    name = "flux"
    pipeline_class_names = ("FluxPipeline",)
    denoiser_name = "transformer"
    is_flow = True

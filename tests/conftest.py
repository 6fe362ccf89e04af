import os

# Tests never download: every model is built from a config inside the test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The test models are tiny: one thread per process beats thread synchronisation (and child processes inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from align.testing.tiny_flow import build_tiny_flux, build_tiny_sd3
from align.testing.tiny_sd import build_tiny_pipeline
from align.testing.tiny_sdxl import build_tiny_sdxl_pipeline

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny SD-architecture pipeline folder (align/testing/tiny_sd.py), built once per test module that asks for it."""
    return str(build_tiny_pipeline(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tiny_sdxl_model(tmp_path_factory):
    """A tiny SDXL-architecture pipeline folder (align/testing/tiny_sdxl.py), built once per test module that asks for it."""
    return str(build_tiny_sdxl_pipeline(tmp_path_factory.mktemp("tiny_sdxl")))


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """``family_models(name)``: the tiny pipeline folder of family "sdxl", "sd3" or "flux" (align/testing/tiny_sdxl.py,
    align/testing/tiny_flow.py), built on first use, once per test module."""
    builders = {"sdxl": build_tiny_sdxl_pipeline, "sd3": build_tiny_sd3, "flux": build_tiny_flux}
    built: dict[str, str] = {}

    def model(name: str) -> str:
        if name not in built:
            built[name] = str(builders[name](tmp_path_factory.mktemp(name)))
        return built[name]

    return model

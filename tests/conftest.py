import os

# Tests never download: every model is built from a config inside the test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The test models are tiny: one thread per process beats thread synchronisation (and child processes inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny SD-architecture pipeline folder (tests/tiny_sd.py), built once per test module that asks for it."""
    from tiny_sd import build_tiny_pipeline

    return str(build_tiny_pipeline(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tiny_sdxl_model(tmp_path_factory):
    """A tiny SDXL-architecture pipeline folder (tests/tiny_sdxl.py), built once per test module that asks for it."""
    from tiny_sdxl import build_tiny_sdxl_pipeline

    return str(build_tiny_sdxl_pipeline(tmp_path_factory.mktemp("tiny_sdxl")))

"""Where the bundled testbed pipeline lives inside the package."""

from __future__ import annotations

from pathlib import Path

# A full diffusers StableDiffusionPipeline folder written by scripts/build_testbed.py.
TESTBED_PIPELINE_DIR = Path(__file__).parent / "weights" / "pipeline"
# Default sampling settings of the bundled pipeline, stored beside its model_index.json.
TESTBED_SETTINGS_FILE = "testbed.json"
# The flow-matching testbed: a StableDiffusion3Pipeline folder written by scripts/build_flow_testbed.py,
# with its sampling settings (max_sequence_length among them) in flow_testbed.json.
FLOW_TESTBED_PIPELINE_DIR = Path(__file__).parent / "weights" / "flow_pipeline"
FLOW_TESTBED_SETTINGS_FILE = "flow_testbed.json"


class MissingTestbedWeightsError(FileNotFoundError):
    pass


def testbed_pipeline_dir() -> Path:
    """The bundled pipeline folder, or a clear error saying how to build it."""
    if not (TESTBED_PIPELINE_DIR / "model_index.json").is_file():
        raise MissingTestbedWeightsError(
            f"the bundled testbed pipeline is missing ({TESTBED_PIPELINE_DIR} has no model_index.json); "
            "build it with `python scripts/build_testbed.py` (about 30 minutes on 2 CPU cores), "
            "or pass a hub id / local pipeline folder as --model instead of 'testbed'"
        )
    return TESTBED_PIPELINE_DIR


def flow_testbed_pipeline_dir() -> Path:
    """The bundled flow testbed pipeline folder, or a clear error saying how to build it."""
    if not (FLOW_TESTBED_PIPELINE_DIR / "model_index.json").is_file():
        raise MissingTestbedWeightsError(
            f"the bundled flow testbed pipeline is missing ({FLOW_TESTBED_PIPELINE_DIR} has no model_index.json); "
            f"build it with `python scripts/build_flow_testbed.py --out {FLOW_TESTBED_PIPELINE_DIR} --minutes 26`, "
            "or pass a local flow testbed folder as --model instead of 'testbed-flow'"
        )
    return FLOW_TESTBED_PIPELINE_DIR

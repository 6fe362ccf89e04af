"""Quiet, informative logs: no third-party warnings on a normal testbed run, progress bars only on a terminal."""

import io
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from align import progress
from align.pipeline import load_pipeline
from align.quiet import quiet_output

ROOT = Path(__file__).resolve().parent.parent
# What a library's warning looks like on stderr: "FutureWarning: ...", "[transformers] ... warning", "deprecated", ...
WARNING_LINE = re.compile(r"warn|deprecat|Loading (weights|pipeline components)", re.IGNORECASE)


def _run(script, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_testbed_dpo_run_prints_no_third_party_warning(tmp_path):
    result = _run("align/dpo.py", "--config", "configs/testbed_dpo.yaml", "--prompts", "testbed-train:4:1", "--eval_prompts", "testbed-heldout:4:2",
                  "--max_steps", "2", "--checkpointing_steps", "2", "--report_to", "none",
                  "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if WARNING_LINE.search(line)] == []
    assert "[eval] after:" in result.stdout  # the run did its work (and its own lines go to stdout)
    # the headline: the paired change on unseen captions, per image and clustered by caption
    assert "[eval] after - before on unseen captions (testbed-heldout:4:2):" in result.stdout
    assert "by caption (16 images, 4 captions" in result.stdout  # 4 captions x the config's 4 seeds


def test_a_quiet_testbed_ddpo_run_prints_nothing_on_stderr(tmp_path):
    result = _run("align/ddpo.py", "--config", "configs/testbed_ddpo.yaml", "--num_epochs", "1", "--samples_per_epoch", "16",
                  "--gradient_accumulation_steps", "1", "--eval_prompts", "testbed-heldout:2:1000", "--eval_images_per_prompt", "1",
                  "--checkpointing_epochs", "1", "--quiet", "true", "--output-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr == ""
    assert (tmp_path / "run" / "report.html").is_file()


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_draw_on_a_terminal_only_and_never_when_quiet():
    def drawn(file, **kwargs):
        for _ in progress.progress_bar(range(3), desc="work", file=file, **kwargs):
            pass
        return "work" in file.getvalue()

    try:
        assert drawn(_Terminal())
        assert not drawn(io.StringIO())  # not a terminal: a log file, CI, a pipe
        assert not drawn(_Terminal(), enabled=False)  # not the main process
        progress.set_quiet(True)
        assert not drawn(_Terminal())
    finally:
        progress.set_quiet(False)


def test_only_the_torchvision_fallback_notice_is_dropped():
    quiet_output()
    logger = logging.getLogger("transformers.utils.import_utils")
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        logger.warning("`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` for backward compatibility.")
        logger.warning("something else went wrong")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["something else went wrong"]


@pytest.mark.filterwarnings("error::FutureWarning")
def test_pipelines_load_in_the_asked_dtype_without_a_deprecation_warning():
    pipe = load_pipeline("testbed", dtype=torch.bfloat16)
    assert pipe.unet.dtype == torch.bfloat16 and pipe.text_encoder.dtype == torch.bfloat16


def test_only_peft_s_deprecated_property_read_is_silenced():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_output()  # its filter goes in front of "always"
        for message in ("`is_gradient_checkpointing` is deprecated and will be removed in v6.", "another change"):
            warnings.warn_explicit(message, FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils")
        warnings.warn_explicit("`is_gradient_checkpointing` is deprecated", FutureWarning, "ours.py", 1, module="align.ours")
    assert [str(w.message) for w in seen] == ["another change", "`is_gradient_checkpointing` is deprecated"]

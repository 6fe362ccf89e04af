"""scripts/fuse_run.py: a LoRA run written as a plain pipeline folder computes what the run computes."""

from __future__ import annotations

import pytest
import torch
import yaml
from script_loader import load_script

from align.pipeline import add_lora, load_pipeline, load_trained, save_lora
from align.run_folder import CONFIG_FILE
from align.testing.tiny_sd import build_tiny_pipeline

fuse_run = load_script("fuse_run")


@pytest.fixture()
def lora_run(tmp_path):
    base = build_tiny_pipeline(tmp_path / "base")
    pipe = load_pipeline(str(base))
    add_lora(pipe.unet, rank=2)
    torch.manual_seed(1)
    for name, p in pipe.unet.named_parameters():
        if "lora_B" in name:  # a trained-looking adapter (B starts at zero)
            p.data.normal_(std=0.5)
    run = tmp_path / "run"
    save_lora(pipe.unet, run / "final")
    (run / CONFIG_FILE).write_text(yaml.safe_dump({"model": str(base)}))
    return base, run


def _unet_output(unet):
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, unet.config.in_channels, 8, 8, generator=gen)
    text = torch.randn(2, 77, unet.config.cross_attention_dim, generator=gen)
    with torch.no_grad():
        return unet(latents, torch.tensor([10, 500]), encoder_hidden_states=text).sample


def test_fused_folder_computes_what_the_run_computes(lora_run, tmp_path):
    base, run = lora_run
    out = fuse_run.fuse_run(str(run), tmp_path / "fused")
    fused = load_pipeline(str(out))
    assert not any("lora" in name for name, _ in fused.unet.named_parameters())
    expected = _unet_output(load_trained(str(run)).unet)
    torch.testing.assert_close(_unet_output(fused.unet), expected, rtol=1e-4, atol=1e-5)
    assert (_unet_output(load_pipeline(str(base)).unet) - expected).abs().max() > 1e-2  # the adapter mattered


def test_fuse_run_copies_the_testbed_settings_and_refuses_a_non_empty_folder(lora_run, tmp_path):
    base, run = lora_run
    (base / "testbed.json").write_text('{"guidance_scale": 3.0}')
    out = fuse_run.fuse_run(str(run), tmp_path / "fused")
    assert (out / "testbed.json").read_text() == '{"guidance_scale": 3.0}'
    with pytest.raises(SystemExit, match="not empty"):
        fuse_run.fuse_run(str(run), out)

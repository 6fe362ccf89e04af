"""scripts/bench_dpo_store.py --count_flops: each side's FLOPs per step, counted on the meta device (no compute)."""

from __future__ import annotations

import sys
from pathlib import Path

from script_loader import load_script

bench = load_script("bench_dpo_store")


def test_count_flops_names_what_the_store_saves_per_step(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))  # it imports bench_dpo, as a script
    monkeypatch.setattr(sys, "argv", ["bench_dpo_store.py", "--count_flops", "--resolution", "64"])
    bench.main()
    printed = capsys.readouterr().out
    assert "store / peer: FLOPs per step" in printed and "(64 px, counted on the meta device)" in printed
    counts = bench.count_step_flops(64)
    # the peer's step is ours plus the VAE encoder on the pair's 2 images and the text encoder on its caption
    assert counts["peer"] == counts["ours"] + counts["vae_encode_2_images"] + counts["text_encode"]
    # ours: the policy's forward and backward (~2 forwards) and the reference's forward on the 2 images
    assert 2.5 * counts["unet_forward_2_images"] < counts["ours"] < 3.5 * counts["unet_forward_2_images"]
    ratio = counts["ours"] / counts["peer"]
    assert f"{ratio:.2f}x" in printed and 0 < ratio < 1

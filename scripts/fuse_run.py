"""Write a trained run as a plain pipeline folder, its LoRA fused into the UNet, for a second trainer to start from.

    python scripts/fuse_run.py runs/testbed-dpo runs/testbed-dpo-fused
    python align/ddpo.py --config configs/testbed_ddpo.yaml --model runs/testbed-dpo-fused --output-dir runs/dpo-then-ddpo

Takes what `align.pipeline.load_trained` takes (a run folder, or a LoRA / full-UNet folder with --base).
The testbed's sampling settings (testbed.json) are copied along, so the new folder samples as the base does.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from align.pipeline import base_of, load_trained, resolve_model
from align.run_folder import atomic_folder
from align.testbed.weights import TESTBED_SETTINGS_FILE


def fuse_run(run: str, out: Path, base: str | None = None) -> Path:
    """Save ``run``'s trained pipeline to ``out`` with any LoRA folded into the UNet weights."""
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty: choose a new folder")
    pipe = load_trained(run, base=base)
    if pipe.get_active_adapters():  # a LoRA run (a full fine-tune has none)
        pipe.fuse_lora()
        pipe.unload_lora_weights()  # the fused weights stay; the adapter layers go
    settings = Path(resolve_model(base or base_of(run))) / TESTBED_SETTINGS_FILE
    with atomic_folder(out) as staged:  # the whole pipeline folder at once: a half-written one never loads
        pipe.save_pretrained(staged)
        if settings.is_file():
            shutil.copy(settings, staged / TESTBED_SETTINGS_FILE)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run folder of align/dpo.py or align/ddpo.py (or a LoRA / UNet folder with --base)")
    p.add_argument("out", type=Path, help="new pipeline folder")
    p.add_argument("--base", default=None, help="the base pipeline, if the run folder does not name it")
    args = p.parse_args(argv)
    print(f"wrote {fuse_run(args.run, args.out, args.base)}")


if __name__ == "__main__":
    main()

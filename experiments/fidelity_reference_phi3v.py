"""Reference values from Phi-3.5-vision's remote ``processing_phi3_v.py`` for tests/test_phi3v_processor.py.

Side environment as in experiments/fidelity_reference.py (torchvision is needed by the remote file):

    /work/sidevenv/bin/python -m experiments.fidelity_reference_phi3v \
        --remote LLaVA-Reward/llava_reward/models/base_mllm/phi3_v/processing_phi3_v.py \
        --out tests/data/phi3v_reference.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments import fidelity_reference as base

# (width, height): landscape, portrait, tiny, odd, very wide, square
IMAGE_SIZES = [(512, 384), (384, 512), (37, 23), (301, 211), (1000, 120), (336, 336)]
NUM_CROPS = (16, 4)


SAMPLES = 48  # sampled values kept per 336 x 336 view (the first of base.sample_positions)


def _short(summary: dict) -> dict:
    return {**summary, "samples": summary["samples"][:SAMPLES]}


def fixed_images():
    return [base.fixed_image(w, h, i) for i, (w, h) in enumerate(IMAGE_SIZES)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--remote", type=Path, required=True, help="processing_phi3_v.py of Phi-3.5-vision")
    parser.add_argument("--out", type=Path, default=Path("tests/data/phi3v_reference.json"))
    args = parser.parse_args()
    base._patch_torchvision_ops()
    spec = importlib.util.spec_from_file_location("processing_phi3_v", args.remote)
    remote = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(remote)

    from rewards import phi3v_processor as mine

    result: dict = {"image_sizes": IMAGE_SIZES, "cases": []}
    for num_crops in NUM_CROPS:
        processor = remote.Phi3VImageProcessor(num_crops=num_crops)
        for img in fixed_images():
            out = processor.preprocess([img], return_tensors="pt")
            pixels = out["pixel_values"][0]
            flat = pixels.reshape(-1, 336, 336)
            result["cases"].append({
                "num_crops": num_crops, "size": list(img.size), "shape": list(pixels.shape),
                "image_size": out["image_sizes"][0].tolist(), "num_img_tokens": int(out["num_img_tokens"][0]),
                "views": [_short(base.summary(flat[i : i + 3])) for i in range(0, flat.shape[0], 3)],
            })
            ours = mine.image_inputs([img], num_crops)
            diff = float((ours["pixel_values"][0] - pixels).abs().max())
            print(f"num_crops {num_crops} {img.size}: max |difference| {diff:.3g}, "
                  f"tokens {ours['num_img_tokens'][0]} vs {int(out['num_img_tokens'][0])}")
    # the placeholder expansion, with any tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "rewards" / "weights" / "shapes-clip"))
    text = "<|user|>\n<|image_1|>\nred circle<|end|>"
    images = remote.Phi3VImageProcessor(num_crops=4).preprocess(fixed_images()[:1], return_tensors="pt")
    reference = remote.Phi3VProcessor._convert_images_texts_to_inputs(SimpleNamespace(tokenizer=tokenizer), images, text)
    ours = mine.expand_image_tags(tokenizer, text, [int(images["num_img_tokens"][0])])
    result["expansion_equal"] = bool(torch.equal(reference["input_ids"], ours))
    print("placeholder expansion equal:", result["expansion_equal"])
    args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()

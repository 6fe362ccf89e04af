"""How far each judge's differentiable scoring path (rewards/differentiable.py) is from its evaluation path (the
authors' PIL preprocessing), on the same images.

    python -m experiments.differentiable_judges [--images 32] [--judges hps=/path,...]

Two measurements per judge:
  - pixels: the preprocessed input of the network, tensor path against PIL path, on 8-bit images (so that both paths
    read the same values: what remains is PIL rounding its resized image to 8 bits and clipping the bicubic overshoot),
    max and RMS of the difference in the normalised units the network sees. Weight-free: it holds for the real judges.
    Images: testbed scenes rendered at 1024 px and downscaled (LANCZOS) to 512 px (anti-aliased edges, as a
    generator's), preprocessed to the judges' 224 px.
  - scores, as in training: |score_differentiable - score| on the testbed base model's own generations as the decoder
    gives them (float: the PIL path rounds them to 8 bits, the tensor path does not), beside the spread (std) of the
    scores: with the bundled shapes-clip (real weights, 32 px) and, for the others, tiny random networks of the real
    classes at the real input size (224 px, the 32 px images upsampled). Real weights are not downloadable here: pass
    ``--judges name=weights`` on a machine that has them (e.g. ``--judges hps=xswu/HPSv2``); they score the same
    generations.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoProcessor

import rewards
from align.pipeline import generate_images, load_pipeline
from align.testbed.scene import render, sample_captions
from align.testing.tiny_judges import save_tiny_clip
from rewards.checkpoint_keys import ScoreMLP
from rewards.differentiable import letterbox, processor_pixels, resize_and_crop
from rewards.imagereward import CLIP_MEAN, CLIP_STD, center_crop_pixels
from rewards.images import to_tensor
from rewards.preprocess import hps_pixels, openai_clip_pixels


def large_images(count: int, seed: int = 0) -> tuple[list[str], list[Image.Image]]:
    captions = sample_captions(count, seed)
    images = [render(c, seed + i, size=1024).resize((512, 512), Image.LANCZOS) for i, c in enumerate(captions)]
    return captions, images


def testbed_generations(count: int) -> tuple[list[str], torch.Tensor]:
    pipe = load_pipeline("testbed")
    pipe.set_progress_bar_config(disable=True)
    captions = sample_captions(count, 77)
    images = generate_images(pipe, captions, list(range(count)), num_inference_steps=20, guidance_scale=3.0,
                             batch_size=32)
    return captions, images.float()  # as the decoder gives them: the PIL path rounds them to 8 bits, the tensor path not


def pixel_differences(images: list[Image.Image], processor) -> dict[str, dict[str, float]]:
    tensor = to_tensor(images)
    pairs = {
        "clip / pickscore (CLIP processor, 224)": (processor_pixels(processor.image_processor)(tensor),
                                                   processor(images=images, return_tensors="pt")["pixel_values"]),
        "hps (letterbox, 224)": (letterbox(tensor, 224, CLIP_MEAN, CLIP_STD), hps_pixels(images, 224, CLIP_MEAN, CLIP_STD)),
        "aesthetic (OpenAI CLIP, 224)": (resize_and_crop(tensor, 224, (224, 224), CLIP_MEAN, CLIP_STD, rounded=True),
                                         openai_clip_pixels(images, 224, CLIP_MEAN, CLIP_STD)),
        "imagereward (224)": (resize_and_crop(tensor, 224, (224, 224), CLIP_MEAN, CLIP_STD, rounded=True),
                              center_crop_pixels(images, 224)),
    }
    return {name: {"max": float((a - b).abs().max()), "rms": float((a - b).pow(2).mean().sqrt())}
            for name, (a, b) in pairs.items()}


def score_differences(judge, prompts: list[str], images: torch.Tensor) -> dict[str, float]:
    scores = judge.score(prompts, images).float()
    differentiable = judge.score_differentiable(prompts, images).detach().float()
    gap = (differentiable - scores).abs()
    return {"mean_abs": float(gap.mean()), "max_abs": float(gap.max()), "score_std": float(scores.std()),
            "mean_abs_over_std": float(gap.mean() / scores.std())}


def tiny_judges(folder: Path) -> dict[str, object]:
    """Random networks of the real classes at the real input size (224 px), loaded through the adapters."""
    save_tiny_clip(folder / "clip", seed=1, image_size=224, patch_size=32)
    torch.manual_seed(0)
    head = folder / "head.pth"
    torch.save(OrderedDict((k, v.clone()) for k, v in ScoreMLP(16).state_dict().items()), head)
    return {"clip": rewards.load("clip", model=str(folder / "clip"), device="cpu"),
            "aesthetic": rewards.load("aesthetic", model=str(head), clip_model=str(folder / "clip"), device="cpu")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--judges", default="", help="name=weights,... real judges to measure (e.g. hps=xswu/HPSv2)")
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    captions, large = large_images(args.images)
    prompts, generations = testbed_generations(args.images)
    result = {"images": args.images}
    with tempfile.TemporaryDirectory() as tmp:
        judges = tiny_judges(Path(tmp))
        processor = AutoProcessor.from_pretrained(Path(tmp) / "clip", backend="pil")
        result["pixels_512px_8bit"] = pixel_differences(large, processor)
        result["scores_tiny_networks_224px"] = {name: score_differences(j, prompts, generations)
                                                for name, j in judges.items()}
    result["scores_shapes_clip_32px"] = score_differences(rewards.load("shapes-clip"), prompts, generations)
    for item in filter(None, args.judges.split(",")):
        name, _, weights = item.partition("=")
        judge = rewards.load(name, **({"model": weights} if weights else {}))
        result[f"scores_{name}"] = score_differences(judge, prompts, generations)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Reference pixels and tokens from the judges' authors' own code, for tests/test_judge_fidelity.py.

Runs in a side environment, never in CI: the authors' transforms need torchvision and open_clip,
which the project does not depend on. What was used (docs/fidelity.md):

    python -m venv /work/sidevenv                  # + a .pth line pointing at the project's venv (torch 2.13.0)
    pip install --no-deps torchvision==0.28.0 open_clip_torch==3.3.0    # ftfy comes with the project
    git clone https://github.com/tgxs002/HPSv2     # its own open_clip copy: hpsv2/src/open_clip/
    /work/sidevenv/bin/python -m experiments.fidelity_reference --hpsv2 HPSv2 --out tests/data/fidelity_reference.json

What it computes, on the fixed images and captions below:
- HPS v2: ``image_transform(224, is_train=False, resize_longest_max=True)`` from HPSv2's open_clip
  copy (its ``preprocess_val``), and that copy's caption cleaning (basic_clean + whitespace_clean);
- the LAION aesthetic predictor: OpenAI CLIP's ``_transform(224)`` (Resize, CenterCrop, RGB,
  ToTensor, Normalize), written here exactly as clip/clip.py composes it from torchvision;
- open_clip (PyPI)'s tokenizer ids, and whether transformers' CLIPTokenizer built from the same BPE
  files gives the same ids once the caption is cleaned (the project's HPS path);
- transformers' CLIP image processor with the torchvision backend against the PIL backend
  (``backend="pil"``, what the project forces), to measure what torchvision would change.
The project's own values are computed too and the largest differences printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)
SIZE = 224
# (width, height): odd sizes, non-square both ways, an odd crop excess (227 -> offset 1.5), larger than 224
IMAGE_SIZES = [(37, 23), (97, 61), (300, 211), (211, 300), (227, 227), (231, 640), (512, 512), (225, 229)]
CAPTIONS = [
    "a “red” circle &amp; a blue square",
    "it’s a dog&#39;s   life \t on the  left",
    "caf\u00e9 &amp;amp; bar   ",
    "plain caption",
]
SAMPLES = 512  # pixel values pinned per image, at fixed random positions


def fixed_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB image with sharp edges (so bicubic overshoot shows) and smooth parts."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 127.5 + 127.5 * np.sin(x / (3.0 + seed) + y / 7.0)
    g = np.where(((x // 5) + (y // 3)) % 2 == 0, 255.0, 0.0)
    b = (x * 7 + y * 13 + seed * 31) % 256
    return Image.fromarray(np.stack([r, g, b], axis=-1).round().clip(0, 255).astype(np.uint8), "RGB")


def fixed_images() -> list[Image.Image]:
    return [fixed_image(w, h, i) for i, (w, h) in enumerate(IMAGE_SIZES)]


def sample_positions(shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(1234)
    return rng.integers(0, int(np.prod(shape)), SAMPLES)


def summary(pixels: torch.Tensor) -> dict:
    """A compact fingerprint of one [3, H, W] tensor: shape, sums, extremes and sampled values."""
    flat = pixels.detach().double().flatten()
    index = torch.from_numpy(sample_positions(tuple(pixels.shape)))
    return {"shape": list(pixels.shape), "sum": float(flat.sum()), "sum_sq": float((flat * flat).sum()),
            "min": float(flat.min()), "max": float(flat.max()), "samples": flat[index].tolist()}


def _patch_torchvision_ops() -> None:
    """torchvision's PyPI wheel is built against CUDA torch; on the CPU build its C++ ops do not register.
    The transforms used here are Python over torch ops, so the fake-kernel registration is skipped."""
    torch.library.register_fake = lambda *args, **kwargs: (lambda fn: fn)


def hps_transform(hpsv2: Path):
    """HPSv2's own ``image_transform`` module (hpsv2/src/open_clip/transform.py + constants.py)."""
    source = hpsv2 / "hpsv2" / "src" / "open_clip"
    package = Path(tempfile.mkdtemp()) / "hps_open_clip"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("transform.py", "constants.py", "tokenizer.py", "bpe_simple_vocab_16e6.txt.gz"):
        shutil.copy(source / name, package / name)
    sys.path.insert(0, str(package.parent))
    transform = importlib.import_module("hps_open_clip.transform")
    tokenizer = importlib.import_module("hps_open_clip.tokenizer")
    return transform, tokenizer


def openai_clip_transform(n_px: int):
    """OpenAI CLIP's _transform, composed as clip/clip.py does."""
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    return Compose([Resize(n_px, interpolation=InterpolationMode.BICUBIC), CenterCrop(n_px),
                    lambda image: image.convert("RGB"), ToTensor(), Normalize(MEAN, STD)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hpsv2", type=Path, required=True, help="a checkout of github.com/tgxs002/HPSv2")
    parser.add_argument("--out", type=Path, default=Path("tests/data/fidelity_reference.json"))
    args = parser.parse_args()
    _patch_torchvision_ops()
    import open_clip
    import torchvision
    import transformers

    images = fixed_images()
    hps_module, hps_tokenizer = hps_transform(args.hpsv2)
    hps = hps_module.image_transform(SIZE, is_train=False, mean=MEAN, std=STD, resize_longest_max=True)
    aesthetic = openai_clip_transform(SIZE)
    result: dict = {
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                     "open_clip": open_clip.__version__, "transformers": transformers.__version__},
        "image_sizes": IMAGE_SIZES, "hps": [], "aesthetic": [], "captions": [],
    }
    for img in images:
        result["hps"].append(summary(hps(img)))
        result["aesthetic"].append(summary(aesthetic(img)))

    tokenizer = open_clip.get_tokenizer("ViT-H-14")
    hf_equal = _hf_tokenizer_agrees(open_clip, tokenizer)
    for caption in CAPTIONS:
        cleaned = hps_tokenizer.whitespace_clean(hps_tokenizer.basic_clean(caption)) if hps_tokenizer else None
        ids = tokenizer([caption])[0]
        result["captions"].append({"caption": caption, "cleaned": cleaned,
                                   "open_clip_ids": ids[ids != 0].tolist(), "hf_ids_equal": hf_equal[caption]})
    result["torchvision_backend"] = _torchvision_backend_difference(images)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    _print_project_difference(result, images)
    print(f"written to {args.out}")


def _hf_tokenizer_agrees(open_clip, tokenizer) -> dict[str, bool]:
    """transformers' CLIPTokenizer built from open_clip's BPE file, on the project's cleaned caption."""
    import gzip

    from transformers import CLIPTokenizer

    from rewards.preprocess import open_clip_clean

    bpe = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    folder = Path(tempfile.mkdtemp())
    merges = gzip.open(bpe).read().decode("utf-8").split("\n")[1 : 49152 - 256 - 2 + 1]
    simple = open_clip.tokenizer.SimpleTokenizer()
    # open_clip names its special tokens <start_of_text> / <end_of_text>; the hub's CLIP vocab.json <|...|>
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    (folder / "vocab.json").write_text(json.dumps({names.get(k, k): v for k, v in simple.encoder.items()}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    hf = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))
    out = {}
    for caption in CAPTIONS:
        ids = tokenizer([caption])[0]
        reference = ids[ids != 0].tolist()
        mine = hf(open_clip_clean(caption), truncation=True, max_length=77)["input_ids"]
        out[caption] = mine == reference
    return out


def _torchvision_backend_difference(images) -> dict:
    from transformers import CLIPImageProcessor, CLIPImageProcessorPil

    config = dict(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE},
                  image_mean=list(MEAN), image_std=list(STD), do_convert_rgb=True)
    fast, pil = CLIPImageProcessor(**config), CLIPImageProcessorPil(**config)
    diffs = []
    for img in images:
        a = fast(images=[img], return_tensors="pt")["pixel_values"]
        b = pil(images=[img], return_tensors="pt")["pixel_values"]
        diffs.append(float((a - b).abs().max()))
    return {"max_abs_pixel_difference": max(diffs), "per_image": diffs, "fast_class": type(fast).__name__}


def _print_project_difference(result: dict, images) -> None:
    from rewards.preprocess import hps_pixels, open_clip_clean, openai_clip_pixels

    for name, fn in (("hps", hps_pixels), ("aesthetic", openai_clip_pixels)):
        worst = 0.0
        for img, ref in zip(images, result[name]):
            mine = fn([img], SIZE, MEAN, STD)[0]
            if list(mine.shape) != ref["shape"]:
                print(f"{name} {img.size}: shape {list(mine.shape)} vs the authors' {ref['shape']}")
                continue
            values = mine.double().flatten()[torch.from_numpy(sample_positions(tuple(mine.shape)))]
            worst = max(worst, float((values - torch.tensor(ref["samples"])).abs().max()),
                        abs(float(mine.double().sum()) - ref["sum"]) / mine.numel())
        print(f"{name}: largest sampled |difference| from the authors' pixels {worst:.3g}")
    for entry in result["captions"]:
        print(f"{entry['caption']!r}: cleaned equal {open_clip_clean(entry['caption']) == entry['cleaned']}, "
              f"transformers ids equal {entry['hf_ids_equal']}")
    print(f"torchvision backend vs PIL backend: {result['torchvision_backend']['max_abs_pixel_difference']:.3g}")


if __name__ == "__main__":
    main()

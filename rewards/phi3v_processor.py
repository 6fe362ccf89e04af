"""Phi-3.5-vision's input processing without the model repository's remote code.

The first piece of a native Phi-3.5-vision (docs/fidelity.md, "Not done"): the HD-crop image
processor and the image-placeholder expansion of ``processing_phi3_v.py`` (as shipped with
Phi-3.5-vision and in github.com/sjz5202/LLaVA-Reward), written here without torchvision and
checked pixel for pixel against that file (experiments/fidelity_reference_phi3v.py).

Per image (``HD_transform`` + ``Phi3VImageProcessor.preprocess``):
1. RGB; a portrait image is transposed so that width >= height (and transposed back at the end);
2. the largest ``scale`` with ``scale * ceil(scale / ratio) <= num_crops`` sets the width
   ``scale * 336``; the height keeps the ratio (``int``); PIL bilinear resize (torchvision's
   default for PIL images);
3. white padding above and below to a multiple of 336 (top gets ``int(pad / 2)``);
4. ToTensor and CLIP normalisation; the global view is the normalised HD image resized to
   336 x 336 (bicubic, ``align_corners=False``, no antialias);
5. crops of 336 x 336 in row-major order after the global view, zero crops up to ``num_crops + 1``;
6. ``num_img_tokens = (rows * cols + 1) * 144 + 1 + (rows + 1) * 12``.
Text: every ``<|image_k|>`` tag becomes ``num_img_tokens[k-1]`` copies of the id ``-k``; the text
chunks between tags are tokenised one by one, as the remote processor does.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from PIL import Image

CROP = 336
TOKENS_PER_CROP = 144  # 24 x 24 patches merged 2 x 2
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_TAG = re.compile(r"<\|image_\d+\|>")


def hd_scale(width: int, height: int, num_crops: int) -> int:
    """The number of 336 px columns of a landscape image (width >= height) within ``num_crops`` crops."""
    ratio = width / height
    scale = 1
    while scale * np.ceil(scale / ratio) <= num_crops:
        scale += 1
    return scale - 1


def hd_transform(image: Image.Image, num_crops: int) -> Image.Image:
    """Steps 1-3 of the module docstring: resized within ``num_crops`` crops, padded white to 336 multiples."""
    transposed = image.width < image.height
    if transposed:
        image = image.transpose(Image.TRANSPOSE)
    ratio = image.width / image.height
    new_w = int(hd_scale(image.width, image.height, num_crops) * CROP)
    new_h = int(new_w / ratio)
    image = image.resize((new_w, new_h), Image.BILINEAR)
    target = int(np.ceil(new_h / CROP) * CROP)
    top = int((target - new_h) / 2)
    canvas = Image.new("RGB", (new_w, target), (255, 255, 255))
    canvas.paste(image, (0, top))
    return canvas.transpose(Image.TRANSPOSE) if transposed else canvas


def num_image_tokens(height: int, width: int) -> int:
    rows, cols = height // CROP, width // CROP
    return (rows * cols + 1) * TOKENS_PER_CROP + 1 + (rows + 1) * 12


def image_inputs(images: list[Image.Image], num_crops: int = 16, mean=CLIP_MEAN, std=CLIP_STD) -> dict:
    """pixel_values [N, num_crops + 1, 3, 336, 336], image_sizes [N, 2] (h, w after HD), num_img_tokens [N]."""
    if num_crops < 1:
        raise ValueError(f"num_crops must be at least 1, got {num_crops}")
    mean_t = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
    pixel_values, sizes, tokens = [], [], []
    for image in images:
        hd = hd_transform(image.convert("RGB"), num_crops)
        array = np.asarray(hd, dtype=np.uint8)
        tensor = (torch.from_numpy(array.copy()).permute(2, 0, 1).float().div(255.0) - mean_t) / std_t
        h, w = tensor.shape[1:]
        global_view = torch.nn.functional.interpolate(tensor[None], size=(CROP, CROP), mode="bicubic")
        crops = tensor.reshape(1, 3, h // CROP, CROP, w // CROP, CROP).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, CROP, CROP)
        stacked = torch.cat([global_view, crops], dim=0)
        if stacked.shape[0] > num_crops + 1:
            raise ValueError(f"{stacked.shape[0] - 1} crops for num_crops={num_crops}")  # cannot happen by hd_scale
        padding = stacked.new_zeros(num_crops + 1 - stacked.shape[0], 3, CROP, CROP)
        pixel_values.append(torch.cat([stacked, padding], dim=0))
        sizes.append([h, w])
        tokens.append(num_image_tokens(h, w))
    return {"pixel_values": torch.stack(pixel_values), "image_sizes": torch.tensor(sizes, dtype=torch.long),
            "num_img_tokens": tokens}


def expand_image_tags(tokenizer, text: str, num_img_tokens: list[int]) -> torch.Tensor:
    """[1, L] input ids: text chunks tokenised one by one, ``<|image_k|>`` -> ``num_img_tokens[k-1]`` x (-k)."""
    tags = [int(tag[len("<|image_"):-2]) for tag in IMAGE_TAG.findall(text)]
    if sorted(set(tags)) != list(range(1, len(set(tags)) + 1)):
        raise ValueError(f"image tags must be <|image_1|> .. <|image_n|> without gaps, got {sorted(set(tags))}")
    if len(set(tags)) != len(num_img_tokens):
        raise ValueError(f"{len(set(tags))} image tags in the text for {len(num_img_tokens)} images")
    ids: list[int] = []
    chunks = IMAGE_TAG.split(text)
    for i, chunk in enumerate(chunks):
        ids.extend(tokenizer(chunk).input_ids)
        if i < len(tags):
            ids.extend([-tags[i]] * num_img_tokens[tags[i] - 1])
    return torch.tensor(ids, dtype=torch.long).unsqueeze(0)


class Phi3VInputs:
    """Callable like the remote ``Phi3VProcessor`` for one prompt: ``processor(text=..., images=[...])``."""

    def __init__(self, tokenizer, num_crops: int = 16, mean=CLIP_MEAN, std=CLIP_STD):
        self.tokenizer, self.num_crops, self.mean, self.std = tokenizer, num_crops, mean, std

    def __call__(self, text: str, images: list[Image.Image], return_tensors: str = "pt") -> dict:
        if return_tensors != "pt":
            raise ValueError(f"return_tensors={return_tensors!r}: only 'pt'")
        vision = image_inputs(images, self.num_crops, self.mean, self.std)
        input_ids = expand_image_tags(self.tokenizer, text, vision["num_img_tokens"])
        return {"input_ids": input_ids, "attention_mask": (input_ids > -1000000).long(),
                "pixel_values": vision["pixel_values"], "image_sizes": vision["image_sizes"]}


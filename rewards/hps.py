"""HPS v2.1 (Human Preference Score) on transformers' CLIPModel, without open_clip.

HPS v2.1 is an open_clip ViT-H-14 fine-tuned on HPD v2; its release is one file,
``HPS_v2.1_compressed.pt`` in the hub repo ``xswu/HPSv2``, holding ``{"state_dict": ...}`` in
open_clip's key layout. Here the keys are mapped onto ``transformers.CLIPModel`` (see
``rewards.checkpoint_keys``) and loaded strictly; the architecture (config) and the tokenizer
come from ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, the model HPS was fine-tuned from.

Score, as the authors compute it: the cosine of the normalised image and text embeddings
(about 0.2-0.35; tables print it x100). Preprocessing, as the authors' (rewards/preprocess.py):
the float image tensor resized so its longest side is 224 (bicubic with antialias, overshoot
kept), padded to a square with black, then CLIP's mean/std (HPS's ``preprocess_val`` with
``resize_longest_max=True``); captions cleaned as open_clip's tokenizer does, 77 tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import AutoConfig, CLIPModel

from rewards.checkpoint_keys import check_exact, open_clip_to_transformers_clip
from rewards.clip import CLIP_H14_PROCESSOR, ClipEmbedder, ClipSimilarity, check_clip_config, load_processor
from rewards.differentiable import letterbox
from rewards.preprocess import hps_pixels, open_clip_clean
from rewards.weights import (
    check_batch_size,
    load_state_dict,
    missing,
    resolve_device,
    resolve_dtype,
    resolve_file,
)

HPS_REPO = "xswu/HPSv2"
HPS_V21_FILE = "HPS_v2.1_compressed.pt"


def letterbox_pixels(images: list[Image.Image], size: int, mean, std) -> torch.Tensor:
    """HPS's preprocessing (rewards.preprocess.hps_pixels): the float tensor resized so that its
    longest side is ``size`` (bicubic, overshoot kept), centred on a black square, normalised."""
    return hps_pixels(images, size, mean, std)


def load_hps_clip(checkpoint: Path, config, dtype: torch.dtype, judge: str = "hps"):
    """A CLIPModel holding the HPS weights; every checkpoint tensor must land on a model tensor."""
    state = load_state_dict(checkpoint, judge)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    mapped = open_clip_to_transformers_clip(state)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in CLIPModel(config).state_dict().items()}
    check_exact(mapped, expected, f"HPS checkpoint {checkpoint.name}")
    return CLIPModel.from_pretrained(None, config=config, state_dict=mapped, dtype=dtype)


def HpsV21(
    model: str | Path = HPS_REPO,
    filename: str = HPS_V21_FILE,
    base: str | Path = CLIP_H14_PROCESSOR,
    device=None,
    dtype=None,
    batch_size: int = 32,
    tie_margin: float = 0.0,
) -> ClipSimilarity:
    """HPS v2.1. ``model``: hub repo, folder or the .pt file itself; ``base``: the CLIP-H config + tokenizer."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    check_batch_size(batch_size)
    try:
        config = AutoConfig.from_pretrained(str(base))
    except (OSError, ValueError) as err:
        raise missing("hps", str(base), err, what="the CLIP ViT-H-14 config") from err
    check_clip_config(config, str(base), "hps")
    processor = load_processor(str(base), "hps")
    checkpoint = resolve_file(model, filename, "hps")
    clip = load_hps_clip(checkpoint, config, dtype)
    size = config.vision_config.image_size
    image_processor = processor.image_processor
    mean, std = image_processor.image_mean, image_processor.image_std

    def pixel_fn(images):
        return letterbox_pixels(images, size, mean, std)

    # open_clip cleans every caption (ftfy, HTML entities, whitespace) before its BPE; transformers' does not
    embedder = ClipEmbedder(clip, processor, device, dtype, batch_size, pixel_fn=pixel_fn, clean_text=open_clip_clean,
                            tensor_pixel_fn=lambda images: letterbox(images, size, mean, std))
    return ClipSimilarity(embedder, "hps", "cosine", tie_margin)

"""Tiny random models of the scoring judges' real classes, for offline tests and the benchmark.

Each builder makes a model of the same transformers classes as the real judge (seeded, a few
thousand parameters), and the tests save it in the real checkpoint layout so that it loads
back through the adapter's own loading path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import BertTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

from align.testbed.tokenizer import build_tokenizer

WORDS = ["a", "red", "blue", "green", "circle", "square", "triangle", "on", "the", "left", "of", "photo", "cat"]


def clip_tokenizer():
    """A CLIPTokenizer (CLIP's byte-level BPE layout) whose words are single tokens."""
    return build_tokenizer(WORDS)


def tiny_clip_config(tokenizer, image_size: int = 32, patch_size: int = 8, hidden_act: str = "quick_gelu"):
    text = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, hidden_act=hidden_act,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        image_size=image_size, patch_size=patch_size, hidden_act=hidden_act,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)


def tiny_clip_model(tokenizer, seed: int = 0, **config_kwargs):
    torch.manual_seed(seed)
    model = CLIPModel(tiny_clip_config(tokenizer, **config_kwargs)).eval()
    with torch.no_grad():  # random init leaves embeddings nearly identical; spread them out
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def clip_processor(tokenizer, image_size: int = 32):
    """CLIP's preprocessing (shortest side -> size, bicubic, centre crop, CLIP mean/std) at ``image_size``."""
    images = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return CLIPProcessor(image_processor=images, tokenizer=tokenizer)


def save_tiny_clip(folder: Path, seed: int = 0, image_size: int = 32, **config_kwargs):
    """A transformers CLIPModel + processor folder (save_pretrained), as on the hub."""
    tokenizer = clip_tokenizer()
    model = tiny_clip_model(tokenizer, seed=seed, image_size=image_size, **config_kwargs)
    model.save_pretrained(folder)
    clip_processor(tokenizer, image_size).save_pretrained(folder)
    return model


def bert_tokenizer(folder: Path):
    """A lowercasing BertTokenizer (vocab.txt) like bert-base-uncased, over the test words."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "."]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(str(folder / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(folder)
    return tokenizer


def random_images(n: int, size: tuple[int, int] = (40, 32), seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def images_as_tensor(images: list[Image.Image]) -> torch.Tensor:
    """[N, 3, H, W] in [0, 1], exactly the PIL pixels / 255 (what a trainer would hand over)."""
    arrays = np.stack([np.asarray(img, dtype=np.float32) / 255.0 for img in images])
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()

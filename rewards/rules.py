"""Rule judges that need no weights: DDPO's JPEG (in)compressibility, and reference judges
for benchmarks (a random judge and a constant "first image" judge)."""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field

import torch

from rewards.base import Judge, Preference
from rewards.images import Images, num_images, to_pil


def jpeg_size_kb(images: Images, quality: int = 95) -> torch.Tensor:
    """Encoded JPEG size in kilobytes of each image (DDPO: quality 95)."""
    sizes = []
    for img in to_pil(images):
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@dataclass
class JpegCompressibility(Judge):
    """Reward = minus the JPEG size in kB (smaller files score higher). Ignores the prompt."""

    name: str = "jpeg-compressibility"
    quality: int = 95
    judges_edits = True  # the image alone

    def score(self, prompts, images):
        return -jpeg_size_kb(images, self.quality)


@dataclass
class JpegIncompressibility(Judge):
    """Reward = the JPEG size in kB (larger files score higher)."""

    name: str = "jpeg-incompressibility"
    quality: int = 95
    judges_edits = True

    def score(self, prompts, images):
        return jpeg_size_kb(images, self.quality)


@dataclass
class RandomJudge(Judge):
    """Uniform random scores: the floor any useful judge must beat."""

    name: str = "random"
    seed: int = 0
    judges_edits = True
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self):
        self._rng = random.Random(self.seed)

    def score(self, prompts, images):
        return torch.tensor([self._rng.random() for _ in range(num_images(images))])


@dataclass
class FirstImageJudge(Judge):
    """Always prefers the first image shown: what an extreme position bias scores."""

    name: str = "first-image"
    judges_edits = True

    def __post_init__(self):
        self.pairwise_native = True

    def compare(self, prompts, images_a, images_b):
        return [Preference(1.0, raw="always first") for _ in prompts]

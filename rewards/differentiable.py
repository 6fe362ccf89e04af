"""Scoring with gradients: the judges whose score can be differentiated with respect to the image pixels, for reward
backpropagation (DRaFT, AlignProp, ReFL: align/train/reward_backprop.py).

    judge = rewards.load("hps")
    scores = judge.score_differentiable(prompts, images)   # images: float [N, 3, H, W] in [0, 1], requires_grad
    scores.sum().backward()                                 # d score / d pixels

Only the judges listed in ``DIFFERENTIABLE_JUDGES`` have this path (a CLIP-family or BLIP network on pixels); a VLM,
an API model, the testbed's oracle and the rule judges do not, and are refused for reward backpropagation in one line
(``check_differentiable``).

Each judge's tensor path follows the same steps as its evaluation path (the authors' preprocessing, rewards/preprocess.py
and the models' processors), on the float tensor itself: resize with torch's antialiased bicubic (the filter PIL's
BICUBIC uses, a = -0.5), centre crop (or HPS's letterbox), CLIP's mean and std. What differs from the evaluation path,
which stays the authors' one: the images are not rounded to 8 bits before or after the resize. The measured difference
between the two paths per judge is in docs/judges_scoring.md (``python -m experiments.differentiable_judges``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rewards.spec import parse_judges

# The judges with a differentiable scoring path (registry names).
DIFFERENTIABLE_JUDGES = ("aesthetic", "clip", "hps", "imagereward", "pickscore", "shapes-clip", "vpscore")
BICUBIC = 3  # PIL's (and the CLIP processors') resample code


class NotDifferentiableError(ValueError):
    """A judge without a differentiable scoring path was asked for one."""


def check_differentiable(spec: str, flag: str = "--reward") -> None:
    """Every judge of ``spec`` (a name, name[options] or a weighted mix) has a differentiable path, else one line
    naming the first that does not and the ones that do. Nothing loads."""
    for member in parse_judges(spec):
        if member.name not in DIFFERENTIABLE_JUDGES:
            raise NotDifferentiableError(
                f"{flag} {member.name!r} has no differentiable scoring path (VLM, API, oracle and rule judges score "
                f"images, not pixels with gradients); reward backpropagation takes {', '.join(DIFFERENTIABLE_JUDGES)}"
            )


def check_image_tensor(images, where: str) -> torch.Tensor:
    """A float tensor [N, 3, H, W] whose values (where finite) lie in [0, 1] up to rounding; the gradient is kept."""
    if not isinstance(images, torch.Tensor) or not images.is_floating_point():
        raise TypeError(f"{where}: the differentiable path takes a float image tensor [N, 3, H, W] in [0, 1], got "
                        f"{type(images).__name__}{'' if not isinstance(images, torch.Tensor) else f' of {images.dtype}'}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"{where}: the differentiable path takes an image tensor [N, 3, H, W], got shape "
                         f"{tuple(images.shape)}")
    values = images.detach()
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise ValueError(f"{where}: the image tensor holds NaN or infinite values")
    if values.numel() and (float(values.min()) < -1e-3 or float(values.max()) > 1 + 1e-3):
        raise ValueError(f"{where}: image values must be in [0, 1], got [{float(values.min()):.4g}, "
                         f"{float(values.max()):.4g}]")
    return images


def resize_bicubic(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Antialiased bicubic resize of a float batch (PIL's BICUBIC filter, a = -0.5, in floating point); unchanged when
    the size already matches."""
    if tuple(images.shape[-2:]) == (height, width):
        return images
    return F.interpolate(images, size=(height, width), mode="bicubic", align_corners=False, antialias=True)


def shortest_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) after resizing the shortest side to ``size``, the other ``int``-truncated (torchvision's Resize,
    transformers' ``shortest_edge``)."""
    if width <= height:
        return int(size * height / width), size
    return size, int(size * width / height)


def centre_crop(images: torch.Tensor, height: int, width: int, rounded: bool) -> torch.Tensor:
    """The centre ``height`` x ``width``; the offset rounded half to even as torchvision's CenterCrop (``rounded``) or
    floored as transformers' processors."""
    full_h, full_w = images.shape[-2:]
    if full_h < height or full_w < width:
        raise ValueError(f"an image of {full_w}x{full_h} is smaller than the {width}x{height} crop")

    def offset(excess: int) -> int:
        return int(round(excess / 2.0)) if rounded else excess // 2

    top, left = offset(full_h - height), offset(full_w - width)
    return images[..., top:top + height, left:left + width]


def normalise(images: torch.Tensor, mean, std) -> torch.Tensor:
    mean = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean) / std


def resize_and_crop(images: torch.Tensor, size: int, crop: tuple[int, int], mean, std, rounded: bool) -> torch.Tensor:
    """Shortest side to ``size`` (bicubic), centre crop ``crop`` = (height, width), normalise: the CLIP processors' and
    OpenAI CLIP's / ImageReward's preprocessing on a tensor."""
    height, width = shortest_side_size(*images.shape[-2:], size)
    images = resize_bicubic(images.float(), height, width)
    return normalise(centre_crop(images, *crop, rounded=rounded), mean, std)


def letterbox(images: torch.Tensor, size: int, mean, std) -> torch.Tensor:
    """HPS v2's preprocess_val on a tensor (rewards.preprocess.hps_pixels without the 8-bit image): longest side to
    ``size`` (bicubic, rounded), centred on a black square, normalised."""
    height, width = images.shape[-2:]
    scale = size / float(max(height, width))
    images = images.float()
    if scale != 1.0:
        images = resize_bicubic(images, round(height * scale), round(width * scale))
    pad_h, pad_w = size - images.shape[-2], size - images.shape[-1]
    images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
    return normalise(images, mean, std)


def processor_pixels(image_processor):
    """The tensor preprocessing of a transformers CLIP image processor (resize of the shortest edge, floored centre crop,
    rescaled values already in [0, 1], normalisation), as a function of a float batch."""
    size = image_processor.size
    crop = image_processor.crop_size
    shortest = size["shortest_edge"] if "shortest_edge" in size else None
    mean, std = image_processor.image_mean, image_processor.image_std

    def pixels(images: torch.Tensor) -> torch.Tensor:
        images = images.float()
        if image_processor.do_resize:
            if int(image_processor.resample) != BICUBIC:
                raise ValueError(f"the differentiable path resizes with bicubic, this processor with resample "
                                 f"{image_processor.resample}: it has no differentiable path")
            if shortest is not None:
                images = resize_bicubic(images, *shortest_side_size(*images.shape[-2:], shortest))
            else:
                images = resize_bicubic(images, size["height"], size["width"])
        if image_processor.do_center_crop:
            images = centre_crop(images, crop["height"], crop["width"], rounded=False)
        return normalise(images, mean, std) if image_processor.do_normalize else images

    return pixels

"""``geneval``: GenEval (Ghosh et al. 2023) as a judge, on models that transformers loads.

    detector   Mask2Former (COCO instance segmentation), Mask2FormerForUniversalSegmentation; default
               facebook/mask2former-swin-small-coco-instance, the same architecture (Swin-S) as the
               authors' mmdetection checkpoint mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco, but not the
               same weights (Meta's release converted to transformers, not mmdetection's own training run)
    colour     CLIP ViT-L/14 (openai/clip-vit-large-patch14, the weights of open_clip's "ViT-L-14" /
               "openai" that the authors load) as a zero-shot classifier over GenEval's ten colours, on
               each object's crop with everything outside its mask painted grey (#999)
    rules      rewards.geneval_rules, checked against the authors' code

Detections follow mmdetection 2.x's Mask2Former instance post-processing, which the authors' code ran:
mask logits upsampled (bilinear) to the padded input, cropped to the resized image, upsampled to the
original size; the 100 best (query, class) pairs by softmax probability (no-object column dropped);
confidence = class probability x mean sigmoid inside the mask (mask = logit > 0); box = the mask's
tight box (x1, y1 exclusive).

The score of an image, by ``rule``:

    geneval           1 if GenEval's verdict holds, else 0 (the metric; evaluate's per-task table)
    flow-grpo         Flow-GRPO's partial-credit reward (the reward they train with)
    flow-grpo-strict  1 if every include holds with exact counts, else 0

A prompt is judged by its GenEval metadata, looked up by its text in the bundled set (GenEval's 553
evaluation prompts, rewards/data/geneval/), or in ``metadata=<jsonl>`` of the same schema (e.g. Flow-GRPO's
GenEval-style training prompts). docs/judges_rules.md lists what is verified and where this differs from the authors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rewards.base import Judge
from rewards.clip import ClipEmbedder
from rewards.geneval_rules import (
    COLORS,
    COUNTING_THRESHOLD,
    MAX_OBJECTS,
    NMS_THRESHOLD,
    POSITION_THRESHOLD,
    THRESHOLD,
    Detection,
    evaluate,
    evaluate_reward,
    select_detections,
    task_table,
)
from rewards.images import Images, to_pil
from rewards.preprocess import open_clip_clean, openai_clip_pixels
from rewards.weights import MissingWeightsError, offline_hint, resolve_device, resolve_dtype

DATA = Path(__file__).resolve().parent / "data" / "geneval"
METADATA_FILE = "evaluation_metadata.jsonl"
DETECTOR = "facebook/mask2former-swin-small-coco-instance"
CLIP_L14 = "openai/clip-vit-large-patch14"
RULES = ("geneval", "flow-grpo", "flow-grpo-strict")
MAX_PER_IMAGE = 100  # mmdetection's Mask2Former test_cfg.max_per_image
COLOUR_TEMPLATES = ("a photo of a {c} {classname}", "a photo of a {c}-colored {classname}", "a photo of a {c} object")
CROP_BACKGROUND = "#999"


def _missing(source: str, err, option: str):
    """The weights error, naming this judge's option for the model that is missing."""
    return MissingWeightsError(f"judge 'geneval': cannot load weights from {source!r}: {err}{offline_hint()}. "
                               f"Pass {option}=<hub id or local folder> to use other weights.")


# ---------------------------------------------------------------- metadata


def read_metadata(path: str | Path) -> dict[str, dict]:
    """{prompt: metadata} from a GenEval metadata .jsonl (one object per line with 'prompt', 'tag', 'include')."""
    table = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not {"prompt", "tag", "include"} <= set(row):
            raise ValueError(f"{path} line {number}: GenEval metadata needs 'prompt', 'tag' and 'include'")
        table[row["prompt"]] = row
    return table


def bundled_metadata() -> dict[str, dict]:
    """GenEval's 553 evaluation prompts (Flow-GRPO's GenEval test set is the same 553, each four times)."""
    return read_metadata(DATA / METADATA_FILE)


def object_names() -> list[str]:
    """GenEval's 80 COCO class names in the detector's label order (evaluation/object_names.txt)."""
    return [line.strip() for line in (DATA / "object_names.txt").read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- detector


def upsample_masks(mask_logits: torch.Tensor, padded: tuple[int, int], valid: tuple[int, int], original: tuple[int, int]) -> torch.Tensor:
    """[Q, h, w] logits at the decoder's resolution -> [Q, H, W] at the original image size (mmdet 2.x)."""
    masks = torch.nn.functional.interpolate(mask_logits[None].float(), size=padded, mode="bilinear", align_corners=False)[0]
    masks = masks[:, : valid[0], : valid[1]]
    return torch.nn.functional.interpolate(masks[None], size=original, mode="bilinear", align_corners=False)[0]


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """[N, H, W] bool -> [N, 4] tight boxes (x0, y0, x1 + 1, y1 + 1); an empty mask gets zeros (mmdet's mask2bbox)."""
    boxes = torch.zeros((masks.shape[0], 4), dtype=torch.float32)
    cols, rows = masks.any(dim=1), masks.any(dim=2)
    for i in range(masks.shape[0]):
        xs, ys = torch.where(cols[i])[0], torch.where(rows[i])[0]
        if len(xs) and len(ys):
            boxes[i] = torch.tensor([xs[0], ys[0], xs[-1] + 1, ys[-1] + 1], dtype=torch.float32)
    return boxes


def instance_detections(class_logits: torch.Tensor, mask_logits: torch.Tensor, classnames: Sequence[str],
                        max_per_image: int = MAX_PER_IMAGE) -> dict[str, list[Detection]]:
    """One image's raw detections per class: ``class_logits`` [Q, C + 1] (last = no object), ``mask_logits``
    [Q, H, W] at the image's size. Unthresholded (the rules threshold), confidences in float32."""
    num_classes = class_logits.shape[-1] - 1
    if num_classes != len(classnames):
        raise ValueError(f"detector has {num_classes} classes but {len(classnames)} class names were given")
    probs = torch.softmax(class_logits.float(), dim=-1)[:, :-1].flatten()
    top, index = probs.topk(min(max_per_image, probs.numel()), sorted=False)
    labels, queries = index % num_classes, index // num_classes
    masks = mask_logits[queries].float()
    binary = masks > 0
    mask_scores = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    scores = (top * mask_scores).numpy().astype(np.float32)
    boxes = mask_boxes(binary).numpy()
    out: dict[str, list[Detection]] = {}
    for k in range(len(labels)):
        name = classnames[int(labels[k])]
        out.setdefault(name, []).append(Detection(tuple(float(v) for v in boxes[k]), float(scores[k]), binary[k].numpy()))
    return out


class Mask2FormerDetector:
    """A transformers Mask2Former (instance segmentation on COCO's 80 classes) and its image processor."""

    def __init__(self, model, processor, classnames: list[str], device: torch.device, dtype: torch.dtype):
        self.model = model.to(device=device, dtype=dtype).eval()
        self.processor, self.classnames, self.device, self.dtype = processor, classnames, device, dtype

    @classmethod
    def load(cls, source: str | Path, device=None, dtype=None) -> Mask2FormerDetector:
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

        device = resolve_device(device)
        dtype = resolve_dtype(dtype, device)
        try:
            processor = AutoImageProcessor.from_pretrained(str(source))
            model = Mask2FormerForUniversalSegmentation.from_pretrained(str(source), dtype=dtype)
        except OSError as err:
            raise _missing(str(source), err, "detector") from err
        names = object_names()
        if model.config.num_labels != len(names):
            raise ValueError(f"geneval: detector {source} has {model.config.num_labels} classes; GenEval needs COCO's {len(names)}")
        return cls(model, processor, names, device, dtype)

    @torch.no_grad()
    def detect(self, image: Image.Image) -> dict[str, list[Detection]]:
        inputs = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        pixel_mask = inputs["pixel_mask"][0]
        valid = (int(pixel_mask.any(dim=1).sum()), int(pixel_mask.any(dim=0).sum()))
        out = self.model(pixel_values=inputs["pixel_values"].to(self.device, self.dtype),
                         pixel_mask=pixel_mask[None].to(self.device))
        masks = upsample_masks(out.masks_queries_logits[0].cpu(), tuple(inputs["pixel_values"].shape[-2:]), valid,
                               (image.height, image.width))
        return instance_detections(out.class_queries_logits[0].cpu(), masks, self.classnames)


# ---------------------------------------------------------------- colour


def colour_crop(image: Image.Image, detection: Detection, background: str = CROP_BACKGROUND) -> Image.Image:
    """The object as the authors show it to CLIP: outside its mask painted ``background``, cropped to its box."""
    image = image.convert("RGB")
    if detection.mask is not None:
        mask = Image.fromarray(np.asarray(detection.mask, dtype=bool))
        image = Image.composite(image, Image.new("RGB", image.size, color=background), mask)
    return image.crop(tuple(detection.box[:4]))


class ClipColours:
    """CLIP as GenEval's zero-shot colour classifier: per class, each colour's three template embeddings
    normalised, averaged and renormalised; the crop's colour is the arg-max of their cosines."""

    def __init__(self, embedder, colours: Sequence[str] = COLORS):
        self.embedder, self.colours = embedder, list(colours)
        self._classifiers: dict[str, torch.Tensor] = {}

    def classifier(self, classname: str) -> torch.Tensor:
        if classname not in self._classifiers:
            texts = [t.format(c=c, classname=classname) for c in self.colours for t in COLOUR_TEMPLATES]
            emb = self.embedder.text_embeddings(texts).view(len(self.colours), len(COLOUR_TEMPLATES), -1).mean(dim=1)
            self._classifiers[classname] = torch.nn.functional.normalize(emb, dim=-1)
        return self._classifiers[classname]

    def __call__(self, image: Image.Image, classname: str, detections: Sequence[Detection]) -> list[str]:
        if not detections:
            return []
        crops = [colour_crop(image, d) for d in detections]
        logits = 100.0 * self.embedder.image_embeddings(crops) @ self.classifier(classname).T
        return [self.colours[int(i)] for i in logits.argmax(dim=1)]


def load_clip_colours(source: str | Path, device=None, dtype=None) -> ClipColours:

    try:
        embedder = ClipEmbedder.load(source, None, device=device, dtype=dtype, judge="geneval")
    except MissingWeightsError as err:
        raise _missing(str(source), err.__cause__ or err, "clip_model") from err
    # open_clip's transform for the OpenAI weights: PIL bicubic resize, rounding centre crop
    size = embedder.model.config.vision_config.image_size
    mean, std = embedder.processor.image_processor.image_mean, embedder.processor.image_processor.image_std
    embedder.pixel_fn = lambda imgs: openai_clip_pixels(imgs, size, mean, std)
    embedder.clean_text = open_clip_clean
    return ClipColours(embedder)


# ---------------------------------------------------------------- the judge


@dataclass
class GenEvalJudge(Judge):
    """GenEval's rules over a detector and a colour classifier (see the module docstring).

    detect(image) -> {class: [Detection]} (raw, unthresholded); colours(image, class, detections) -> [colour].
    """

    name: str = "geneval"
    rule: str = "geneval"
    detect: object = None
    colours: object = None
    metadata: dict = field(default_factory=dict)
    metadata_for: object = None  # optional prompt -> metadata function (the testbed stand-in derives it)
    threshold: float = THRESHOLD
    counting_threshold: float = COUNTING_THRESHOLD
    max_objects: int = MAX_OBJECTS
    nms_threshold: float = NMS_THRESHOLD
    position_threshold: float = POSITION_THRESHOLD
    colour_vocabulary: tuple = COLORS

    def __post_init__(self):
        if self.rule not in RULES:
            raise ValueError(f"geneval: unknown rule {self.rule!r}; valid: {', '.join(RULES)}")
        if self.rule != "geneval" and self.name == "geneval":
            self.name = f"geneval[rule={self.rule}]"

    def lookup(self, prompt: str) -> dict:
        if self.metadata_for is not None:
            return self.metadata_for(prompt)
        try:
            return self.metadata[prompt]
        except KeyError:
            raise ValueError(
                f"{self.name}: no GenEval metadata for prompt {prompt!r}; use the bundled 'geneval' prompt set, "
                "or pass geneval[metadata=<jsonl with prompt, tag, include>]"
            ) from None

    def check_prompts_supported(self, prompts: list[str]) -> None:
        """Raise ValueError for a prompt without GenEval metadata (commands call this before generating)."""
        for prompt in dict.fromkeys(prompts):
            self.lookup(prompt)

    def score_with_details(self, prompts: list[str], images: Images) -> tuple[torch.Tensor, list[dict]]:
        metas = [self.lookup(p) for p in prompts]  # every prompt known before any model runs
        scores, details = [], []
        for meta, image in zip(metas, to_pil(images)):
            kept = select_detections(self.detect(image), meta["tag"], self.threshold, self.counting_threshold,
                                     self.max_objects, self.nms_threshold)

            def colours_of(classname, found, image=image):
                return self.colours(image, classname, found)

            correct, reason = evaluate(kept, meta, colours_of, self.position_threshold, self.colour_vocabulary)
            strict, reward, reward_reason = evaluate_reward(kept, meta, colours_of, self.position_threshold,
                                                            self.colour_vocabulary)
            value = {"geneval": float(correct), "flow-grpo": reward, "flow-grpo-strict": float(strict)}[self.rule]
            scores.append(value)
            details.append({"tag": meta["tag"], "correct": correct, "reason": reason, "strict_correct": strict,
                            "reward": reward, "detections": {k: [d.row() for d in v] for k, v in kept.items()}})
        return torch.tensor(scores, dtype=torch.float32), details

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        return self.score_with_details(prompts, images)[0]

    def breakdown(self, prompts: list[str], scores: Sequence[float]) -> dict | None:
        """GenEval's per-task table of one model's images (for the 0/1 rules; the partial reward has none)."""
        if self.rule == "flow-grpo":
            return None
        tags = [self.lookup(p)["tag"] for p in prompts]
        keep = [i for i, s in enumerate(scores) if not np.isnan(s)]
        return task_table([tags[i] for i in keep], [scores[i] >= 0.5 for i in keep])


def geneval(
    rule: str = "geneval",
    detector: str = DETECTOR,
    clip_model: str = CLIP_L14,
    metadata: str | None = None,
    device=None,
    dtype=None,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    position_threshold: float = POSITION_THRESHOLD,
    tie_margin: float = 0.0,
) -> GenEvalJudge:
    """GenEval on Mask2Former + CLIP ViT-L/14 (``rule``: geneval | flow-grpo | flow-grpo-strict)."""
    if rule not in RULES:
        raise ValueError(f"geneval: unknown rule {rule!r}; valid: {', '.join(RULES)}")
    table = read_metadata(metadata) if metadata else bundled_metadata()
    found = Mask2FormerDetector.load(detector, device=device, dtype=dtype)
    colours = load_clip_colours(clip_model, device=device, dtype=dtype)
    return GenEvalJudge(rule=rule, detect=found.detect, colours=colours, metadata=table, threshold=threshold,
                        counting_threshold=counting_threshold, position_threshold=position_threshold,
                        tie_margin=tie_margin)



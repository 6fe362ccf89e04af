"""Reward models trained by ``align.train.reward_model``, loaded by path: ``rewards.load("<folder>")``.

A trained folder holds ``reward_model.json`` (the marker, written last) plus the weights:

- kind ``clip-mlp`` / ``blip-mlp`` (VP-Score / ImageReward style): ``backbone/`` (a transformers
  CLIPModel or BlipForImageTextRetrieval and its processor, LoRA merged in) and ``head.safetensors``
  (the feature standardisation and the MLP).
- kind ``mllm-skipca`` (LLaVA-Reward style): the authors' layout (``lora/``, the head file,
  ``reward_config.yaml``), loaded by ``rewards.llava_reward``.

The marker is sealed: it records every other file's size and sha256 and a digest of its own fields, checked when
the folder is loaded (a file changed or missing, a marker edited or without a digest: one line, never loaded).

Calibration: the trainer fits a temperature T on held-out pairs and stores it in the marker.
At load, scores are s = r / (tau * T), so P(a > b) = sigmoid(s_a - s_b) is calibrated.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from rewards import TRAINED_MARKER
from rewards.blip import BLIP_ITM_MAX_TOKENS, blip_text_cls
from rewards.llava_reward import load_reward_checkpoint
from rewards.reward_heads import MLPHead
from rewards.reward_model_judge import TrainedRewardError, TrainedRewardJudge
from rewards.secrets import scrub
from rewards.weights import resolve_device

MARKER = TRAINED_MARKER  # the file the registry looks for in a folder
FORMAT_VERSION = 1
KINDS = ("clip-mlp", "blip-mlp", "mllm-skipca")


# ---------------------------------------------------------------------------------------- model


class EmbeddingRewardModel(nn.Module):
    """A vision-language backbone's (prompt, image) features -> standardise -> MLP -> reward.

    Subclasses give ``feature_size`` and ``features(prompts, images)``, and name the transformers
    class that saves/loads the backbone. ``self.backbone`` may be wrapped in a peft LoRA model.
    """

    kind = ""
    backbone_class = ""

    @classmethod
    def load_backbone(cls, folder: str, dtype: torch.dtype = torch.float32):
        """The transformers backbone (``backbone_class``) and its processor from a folder or hub id."""
        backbone = getattr(transformers, cls.backbone_class).from_pretrained(str(folder), dtype=dtype)
        return backbone, transformers.AutoProcessor.from_pretrained(str(folder))

    def __init__(self, backbone, processor, hidden: tuple[int, ...] = (256, 64), dropout: float = 0.1):
        super().__init__()
        self.backbone, self.processor = backbone, processor
        size = self.feature_size()
        self.head = MLPHead(size, tuple(hidden), dropout)
        # Per-feature standardisation, fitted on training images before training: embeddings of
        # small or synthetic images can differ by ~1% of their norm, too little for the MLP to see.
        self.register_buffer("feature_mean", torch.zeros(size))
        self.register_buffer("feature_std", torch.ones(size))
        self.hidden, self.dropout = tuple(hidden), dropout

    def feature_size(self) -> int:
        raise NotImplementedError

    def features(self, prompts: list[str], images: list) -> torch.Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.head.layers[0].weight.device

    def pixel_values(self, images: list) -> torch.Tensor:
        return self.processor.image_processor(images=images, return_tensors="pt")["pixel_values"].to(self.device)

    def tokens(self, prompts: list[str], max_tokens: int) -> dict:
        out = self.processor.tokenizer(prompts, padding=True, truncation=True, max_length=max_tokens, return_tensors="pt")
        return {k: out[k].to(self.device) for k in ("input_ids", "attention_mask")}

    def rewards(self, prompts: list[str], images: list) -> torch.Tensor:
        """[N] rewards, differentiable (used for training and scoring)."""
        return self.head((self.features(prompts, images) - self.feature_mean) / self.feature_std)

    def forward(self, prompts: list[str], images: list) -> torch.Tensor:
        return self.rewards(prompts, images)

    @torch.no_grad()
    def fit_feature_norm(self, prompts: list[str], images: list, batch_size: int = 64) -> None:
        was_training = self.training
        self.eval()
        feats = torch.cat([
            self.features(prompts[i : i + batch_size], images[i : i + batch_size]) for i in range(0, len(prompts), batch_size)
        ])
        self.train(was_training)
        self.feature_mean.copy_(feats.mean(0))
        self.feature_std.copy_(feats.std(0).clamp_min(1e-6) if len(feats) > 1 else torch.ones_like(self.feature_std))

    def save(self, folder: str | Path) -> dict:
        """Write backbone/ (LoRA merged) and head.safetensors; returns the marker fields describing them."""
        folder = Path(folder)
        backbone = self.backbone
        if hasattr(backbone, "merge_and_unload"):  # a peft LoRA wrapper: save plain backbone weights
            backbone = copy.deepcopy(backbone).merge_and_unload()
        backbone.save_pretrained(folder / "backbone")
        self.processor.save_pretrained(folder / "backbone")
        state = {f"head.{k}": v for k, v in self.head.state_dict().items()}
        state.update(feature_mean=self.feature_mean, feature_std=self.feature_std)
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(folder / "head.safetensors"))
        return {"kind": self.kind, "backbone": "backbone", "head": {"hidden": list(self.hidden), "dropout": self.dropout}}

    @classmethod
    def from_folder(cls, folder: str | Path, meta: dict, dtype: torch.dtype = torch.float32) -> EmbeddingRewardModel:
        folder = Path(folder)
        backbone_dir = folder / meta.get("backbone", "backbone")
        head_file = folder / "head.safetensors"
        for needed in (backbone_dir / "config.json", head_file):
            if not needed.is_file():
                raise TrainedRewardError(f"trained reward model {str(folder)!r} lacks {needed.relative_to(folder)}")
        backbone, processor = cls.load_backbone(str(backbone_dir), dtype=dtype)
        head = meta.get("head", {})
        model = cls(backbone, processor, hidden=tuple(head.get("hidden", (256, 64))), dropout=float(head.get("dropout", 0.0)))
        state = load_file(str(head_file))
        try:
            model.feature_mean.copy_(state.pop("feature_mean"))
            model.feature_std.copy_(state.pop("feature_std"))
            model.head.load_state_dict({k.removeprefix("head."): v for k, v in state.items()})
        except (KeyError, RuntimeError) as err:
            raise TrainedRewardError(f"{head_file} does not match the head described in {MARKER}: {err}") from err
        return model.eval()


class ClipRewardModel(EmbeddingRewardModel):
    """CLIP (VP-Score-like): the MLP sees [img, txt, img * txt, cos(img, txt)] of the unit-norm
    projected embeddings, so it starts from CLIP's own alignment signal and can learn more."""

    kind = "clip-mlp"
    backbone_class = "CLIPModel"
    lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")

    def feature_size(self) -> int:
        return 3 * self.backbone.config.projection_dim + 1

    def features(self, prompts: list[str], images: list) -> torch.Tensor:
        config = self.backbone.config.text_config
        limit = getattr(self.processor.tokenizer, "model_max_length", None) or 77
        tokens = self.tokens(prompts, int(min(limit, config.max_position_embeddings)))
        # transformers 5 returns output objects; the projected embedding is pooler_output
        image = self.backbone.get_image_features(pixel_values=self.pixel_values(images)).pooler_output
        text = self.backbone.get_text_features(**tokens).pooler_output
        image = nn.functional.normalize(image.float(), dim=-1)
        text = nn.functional.normalize(text.float(), dim=-1)
        return torch.cat([image, text, image * text, (image * text).sum(-1, keepdim=True)], dim=-1)


class BlipRewardModel(EmbeddingRewardModel):
    """BLIP (ImageReward-like): the text encoder cross-attends to the image tokens; the MLP reads
    its [CLS] state. The backbone is a transformers BlipForImageTextRetrieval (e.g. an ITM checkpoint)."""

    kind = "blip-mlp"
    backbone_class = "BlipForImageTextRetrieval"
    lora_targets = ("query", "key", "value", "qkv")
    max_tokens = BLIP_ITM_MAX_TOKENS  # ImageReward's prompt length, as BLIP's ITM

    def feature_size(self) -> int:
        return self.backbone.config.text_config.hidden_size

    def features(self, prompts: list[str], images: list) -> torch.Tensor:
        tokens = self.tokens(prompts, self.max_tokens)
        return blip_text_cls(self.backbone, self.pixel_values(images), tokens["input_ids"], tokens["attention_mask"]).float()


EMBEDDING_MODELS = {cls.kind: cls for cls in (ClipRewardModel, BlipRewardModel)}


# ----------------------------------------------------------------------------------- load by path


# ------------------------------------------------------------------------------------------ the seal
# (rewards never imports align: this is the same record digest as align.run_folder's, written out once here)

DIGEST = "digest"
FILES = "files"


def _digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_files(folder: Path) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every file of a trained folder but its marker."""
    return {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.relative_to(folder) != Path(MARKER)}


def check_files(folder: Path, meta: dict) -> None:
    """Every file the marker records is there, of its size and hash (weights are read whole to load anyway)."""
    for name, expected in meta[FILES].items():
        path = folder / name
        where = f"trained reward model {str(folder)!r}: {name}"
        if not path.is_file():
            raise TrainedRewardError(f"{where} is missing; copy the whole folder again (or retrain it)")
        if path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
            raise TrainedRewardError(f"{where} has changed since it was written (size or hash mismatch); copy the "
                                     "whole folder again (or retrain it)")


def read_marker(path: str | Path) -> dict:
    folder = Path(path).expanduser()
    marker = folder / MARKER
    if not marker.is_file():
        raise TrainedRewardError(
            f"{str(folder)!r} is not a trained reward model: it has no {MARKER} (train one with "
            "python -m align.train_reward)"
        )
    try:
        meta = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TrainedRewardError(f"{marker} is not valid JSON: {err}") from err
    if not isinstance(meta, dict):
        raise TrainedRewardError(f"{marker} is not a JSON object")
    if DIGEST not in meta or not isinstance(meta.get(FILES), dict):
        raise TrainedRewardError(f"{marker} carries no digest or file list (edited by hand, or written by a version "
                                 "before trained folders were sealed); retrain it with python -m align.train_reward")
    if meta[DIGEST] != _digest(meta):
        raise TrainedRewardError(f"{marker} was changed after it was written (its digest does not match); copy the "
                                 "folder again or retrain it")
    if meta.get("kind") not in KINDS:
        raise TrainedRewardError(f"{marker}: unknown kind {meta.get('kind')!r}; known kinds: {', '.join(KINDS)}")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise TrainedRewardError(f"{marker} has format_version {meta.get('format_version')}; this code reads <= {FORMAT_VERSION}")
    return meta


def load_trained(path: str, device=None, dtype: torch.dtype | str = torch.float32, batch_size: int = 32,
                 calibrated: bool = True, tie_margin: float = 0.0, name: str | None = None, **options) -> TrainedRewardJudge:
    """Load a folder written by ``align.train.reward_model`` as a judge (the registry calls this for a path)."""
    meta = read_marker(path)
    folder = Path(path).expanduser()
    check_files(folder, meta)
    device = resolve_device(device or "cpu")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    if meta["kind"] in EMBEDDING_MODELS:
        if options:
            raise TrainedRewardError(f"unknown option(s) {', '.join(sorted(options))} for a {meta['kind']} reward model; "
                                     "valid: device, dtype, batch_size, calibrated, tie_margin, name")
        model = EMBEDDING_MODELS[meta["kind"]].from_folder(folder, meta, dtype=dtype).to(device)
    else:
        model = load_reward_checkpoint(folder, device=device, dtype=dtype, **options)
    calibration = meta.get("calibration") or {}
    return TrainedRewardJudge(
        model,
        name=name or meta.get("name") or folder.name,
        tau=float(meta.get("tau", 1.0)),
        temperature=float(calibration.get("temperature", 1.0)),
        calibrated=calibrated,
        batch_size=batch_size,
        tie_margin=tie_margin,
    )


def write_marker(folder: str | Path, meta: dict) -> None:
    """Write reward_model.json atomically (last, so a folder with it is complete), sealed: it records every other
    file's size and hash and carries a digest of its own fields."""
    folder = Path(folder)
    body = scrub({"format_version": FORMAT_VERSION, **{k: v for k, v in meta.items() if k not in (DIGEST, FILES)}})
    body[FILES] = folder_files(folder)  # no secrets (scrubbed above); the files as they are now, all written
    text = json.dumps({**body, DIGEST: _digest(body)}, indent=2, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{MARKER}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, folder / MARKER)

"""Key mappings from the authors' checkpoint layouts onto transformers model classes.

Pure functions on state dicts, no I/O. Each mapping must consume every tensor of the
checkpoint: a key that no rule matches (and that is not in the short, explained list of
keys known to be unused) raises ``CheckpointLayoutError`` instead of being dropped, so a
checkpoint of another architecture is refused rather than half-loaded.

- ``open_clip_to_transformers_clip``: an open_clip ViT CLIP state_dict (HPS v2 / v2.1 are
  fine-tuned open_clip ViT-H-14 models) -> ``transformers.CLIPModel`` keys.
- ``image_reward_to_blip``: ImageReward's checkpoint (BLIP ViT + BERT text encoder with
  cross-attention from Salesforce's BLIP code, plus a 5-layer MLP) -> the keys of
  ``rewards.imagereward.ImageRewardModel`` (transformers' ``BlipVisionModel`` under ``vision.``,
  ``BlipTextModel`` under ``text.``, the MLP under ``mlp.``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

Tensors = dict[str, torch.Tensor]
# A rule turns one matched checkpoint tensor into one or more target tensors.
Convert = Callable[[re.Match, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]


class CheckpointLayoutError(ValueError):
    """The checkpoint's keys do not follow the layout the mapping was written for."""


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern
    convert: Convert


def _rule(pattern: str, convert: Convert) -> Rule:
    return Rule(re.compile(pattern + r"\Z"), convert)


def copy(target: str) -> Convert:
    """Rename only; ``target`` may use the pattern's groups (\\1, \\2, ...)."""
    def convert(match: re.Match, tensor: torch.Tensor):
        yield match.expand(target), tensor

    return convert


def transpose(target: str) -> Convert:
    """open_clip keeps projections as x @ P (P: [in, out]); nn.Linear stores W = P^T ([out, in])."""
    def convert(match: re.Match, tensor: torch.Tensor):
        yield match.expand(target), tensor.t().contiguous()

    return convert


def split_qkv(target: str) -> Convert:
    """nn.MultiheadAttention's packed in_proj ([3*d, ...], order q, k, v) -> three tensors.

    ``target`` holds ``{qkv}``, replaced by q, k and v.
    """
    def convert(match: re.Match, tensor: torch.Tensor):
        if tensor.shape[0] % 3:
            raise CheckpointLayoutError(f"{match.string}: packed q/k/v size {tuple(tensor.shape)} is not divisible by 3")
        for name, part in zip("qkv", tensor.chunk(3, dim=0)):
            yield match.expand(target).replace("{qkv}", name), part.contiguous()

    return convert


def apply_rules(
    state_dict: Tensors,
    rules: Iterable[Rule],
    unused: dict[str, str] | None = None,
    what: str = "checkpoint",
) -> Tensors:
    """Map every tensor through the first matching rule.

    ``unused`` maps regexes of keys the model does not need to the reason they are dropped.
    Any other unmatched key raises, listing up to ten of them.
    """
    rules = list(rules)
    dropped = [(re.compile(p + r"\Z"), why) for p, why in (unused or {}).items()]
    mapped: Tensors = {}
    unknown: list[str] = []
    for key, tensor in state_dict.items():
        for rule in rules:
            match = rule.pattern.match(key)
            if match:
                for new_key, new_tensor in rule.convert(match, tensor):
                    if new_key in mapped:
                        raise CheckpointLayoutError(f"{what}: two checkpoint keys map onto {new_key!r}")
                    mapped[new_key] = new_tensor
                break
        else:
            if not any(p.match(key) for p, _ in dropped):
                unknown.append(key)
    if unknown:
        shown = ", ".join(unknown[:10]) + (f" ... and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise CheckpointLayoutError(
            f"{what}: {len(unknown)} tensor(s) do not belong to the expected layout: {shown}"
        )
    return mapped


def strip_prefix(state_dict: Tensors, prefix: str) -> Tensors:
    """Drop a prefix (such as DistributedDataParallel's 'module.') when every key has it."""
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix) :]: v for k, v in state_dict.items()}
    return state_dict


def check_exact(mapped: dict[str, torch.Tensor], expected: dict[str, tuple], what: str) -> None:
    """Same keys, same shapes: what a strict load needs, reported in one message."""
    missing_keys = sorted(set(expected) - set(mapped))
    extra = sorted(set(mapped) - set(expected))
    wrong = sorted(k for k in set(expected) & set(mapped) if tuple(mapped[k].shape) != expected[k])
    if missing_keys or extra or wrong:
        parts = []
        if missing_keys:
            parts.append(f"missing {missing_keys[:5]}{' ...' if len(missing_keys) > 5 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        if wrong:
            k = wrong[0]
            parts.append(f"{len(wrong)} shape mismatches, e.g. {k}: checkpoint {tuple(mapped[k].shape)} vs model {expected[k]}")
        raise CheckpointLayoutError(f"{what} does not fit the model architecture: " + "; ".join(parts))


# --- open_clip ViT CLIP -> transformers CLIPModel --------------------------------------------

def _open_clip_block_rules(src: str, dst: str) -> list[Rule]:
    """Residual attention blocks under ``src``: ln_1, attn (packed in_proj), ln_2, mlp c_fc / c_proj.

    Patterns are matched from the start of the key, so the text tower's "transformer..." never
    matches the vision tower's "visual.transformer...".
    """
    block = src + r"resblocks\.(\d+)\."
    out = dst + r".encoder.layers.\1."
    return [
        _rule(block + r"ln_1\.(weight|bias)", copy(out + r"layer_norm1.\2")),
        _rule(block + r"ln_2\.(weight|bias)", copy(out + r"layer_norm2.\2")),
        _rule(block + r"attn\.in_proj_weight", split_qkv(out + "self_attn.{qkv}_proj.weight")),
        _rule(block + r"attn\.in_proj_bias", split_qkv(out + "self_attn.{qkv}_proj.bias")),
        _rule(block + r"attn\.out_proj\.(weight|bias)", copy(out + r"self_attn.out_proj.\2")),
        _rule(block + r"mlp\.c_fc\.(weight|bias)", copy(out + r"mlp.fc1.\2")),
        _rule(block + r"mlp\.c_proj\.(weight|bias)", copy(out + r"mlp.fc2.\2")),
    ]


def _class_embedding(match: re.Match, tensor: torch.Tensor):
    yield "vision_model.embeddings.class_embedding", tensor.reshape(-1)


OPEN_CLIP_RULES: list[Rule] = [
    # text tower (top level in open_clip's CLIP class)
    _rule(r"token_embedding\.weight", copy("text_model.embeddings.token_embedding.weight")),
    _rule(r"positional_embedding", copy("text_model.embeddings.position_embedding.weight")),
    *_open_clip_block_rules(r"transformer\.", "text_model"),
    _rule(r"ln_final\.(weight|bias)", copy(r"text_model.final_layer_norm.\1")),
    _rule(r"text_projection", transpose("text_projection.weight")),
    _rule(r"logit_scale", copy("logit_scale")),
    # vision tower
    _rule(r"visual\.class_embedding", _class_embedding),
    _rule(r"visual\.positional_embedding", copy("vision_model.embeddings.position_embedding.weight")),
    _rule(r"visual\.conv1\.weight", copy("vision_model.embeddings.patch_embedding.weight")),
    _rule(r"visual\.ln_pre\.(weight|bias)", copy(r"vision_model.pre_layrnorm.\1")),  # sic, transformers' name
    *_open_clip_block_rules(r"visual\.transformer\.", "vision_model"),
    _rule(r"visual\.ln_post\.(weight|bias)", copy(r"vision_model.post_layernorm.\1")),
    _rule(r"visual\.proj", transpose("visual_projection.weight")),
]

OPEN_CLIP_UNUSED = {
    # the causal mask is rebuilt by transformers; open_clip registers it non-persistent, but
    # older exports may still carry it
    r"attn_mask": "causal text mask (a constant, rebuilt by transformers)",
}


def open_clip_to_transformers_clip(state_dict: Tensors) -> Tensors:
    """An open_clip ViT CLIP state_dict -> ``transformers.CLIPModel`` state_dict keys."""
    state_dict = strip_prefix(state_dict, "module.")
    return apply_rules(state_dict, OPEN_CLIP_RULES, OPEN_CLIP_UNUSED, what="open_clip checkpoint")


# --- ImageReward (BLIP + MLP) -> ImageRewardModel ---------------------------------------------

_VIT = r"blip\.visual_encoder\."
_VIT_BLOCK = _VIT + r"blocks\.(\d+)\."
_LAYER = r"vision.encoder.layers.\1."

IMAGE_REWARD_RULES: list[Rule] = [
    _rule(_VIT + r"cls_token", copy("vision.embeddings.class_embedding")),
    _rule(_VIT + r"pos_embed", copy("vision.embeddings.position_embedding")),
    _rule(_VIT + r"patch_embed\.proj\.(weight|bias)", copy(r"vision.embeddings.patch_embedding.\1")),
    _rule(_VIT + r"norm\.(weight|bias)", copy(r"vision.post_layernorm.\1")),
    _rule(_VIT_BLOCK + r"norm1\.(weight|bias)", copy(_LAYER + r"layer_norm1.\2")),
    _rule(_VIT_BLOCK + r"norm2\.(weight|bias)", copy(_LAYER + r"layer_norm2.\2")),
    _rule(_VIT_BLOCK + r"attn\.qkv\.(weight|bias)", copy(_LAYER + r"self_attn.qkv.\2")),
    _rule(_VIT_BLOCK + r"attn\.proj\.(weight|bias)", copy(_LAYER + r"self_attn.projection.\2")),
    _rule(_VIT_BLOCK + r"mlp\.(fc1|fc2)\.(weight|bias)", copy(_LAYER + r"mlp.\2.\3")),
    # BLIP's med.py BERT and transformers' BlipTextModel share their parameter names
    _rule(r"blip\.text_encoder\.(?!embeddings\.position_ids)(.+)", copy(r"text.\1")),
    _rule(r"mlp\.layers\.(\d+)\.(weight|bias)", copy(r"mlp.layers.\1.\2")),
]

IMAGE_REWARD_UNUSED = {
    r"blip\.text_encoder\.embeddings\.position_ids": "a constant arange buffer, rebuilt by transformers",
    r"blip\.(vision_proj|text_proj)\.(weight|bias)": "BLIP's contrastive projections; the reward reads the [CLS] state",
}


def image_reward_to_blip(state_dict: Tensors) -> Tensors:
    """ImageReward's state_dict -> ``ImageRewardModel`` keys (vision., text., mlp.)."""
    state_dict = strip_prefix(state_dict, "module.")
    return apply_rules(state_dict, IMAGE_REWARD_RULES, IMAGE_REWARD_UNUSED, what="ImageReward checkpoint")


# --- LAION aesthetic predictor ----------------------------------------------------------------

AESTHETIC_MLP_RULES: list[Rule] = [_rule(r"layers\.(\d+)\.(weight|bias)", copy(r"layers.\1.\2"))]


def aesthetic_mlp_keys(state_dict: Tensors) -> Tensors:
    """The improved-aesthetic-predictor .pth holds only the MLP ('layers.N.weight/bias')."""
    state_dict = strip_prefix(state_dict, "module.")
    return apply_rules(state_dict, AESTHETIC_MLP_RULES, what="aesthetic predictor checkpoint")



class ScoreMLP(torch.nn.Module):
    """The 5-linear-layer head of the LAION aesthetic predictor, reused by ImageReward.

    No activations between the layers (both projects ship it that way); the Dropout layers
    keep the authors' module indices (layers.0, .2, .4, .6, .7) so their keys load unchanged.
    """

    def __init__(self, input_size: int):
        super().__init__()
        nn = torch.nn
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)

"""ImageReward (and VP-Score, trained in ImageReward's framework) on transformers' BLIP classes.

ImageReward (THUDM/ImageReward, file ``ImageReward.pt`` + ``med_config.json``) is BLIP's
ViT-L/16 at 224 px, a BERT-base text encoder with cross-attention to the image tokens, and a
5-layer MLP on the text [CLS] state. Its checkpoint uses Salesforce BLIP's own key names; they
are mapped onto ``BlipVisionModel`` + ``BlipTextModel`` (``rewards.checkpoint_keys``) and loaded
strictly, so the unmaintained ``image-reward`` package is not needed.

Score, as the authors compute it: (MLP([CLS]) - 0.16717362830052426) / 1.0333394966054072.
Preprocessing, as theirs: shortest side -> 224 (bicubic), centre crop, CLIP mean/std; the
prompt padded/cut to 35 BERT tokens (bert-base-uncased vocabulary).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from transformers import AutoTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel
from transformers.initialization import no_init_weights

from rewards.base import Judge
from rewards.checkpoint_keys import CheckpointLayoutError, ScoreMLP, check_exact, image_reward_to_blip
from rewards.differentiable import check_image_tensor, resize_and_crop
from rewards.images import Images, num_images, to_pil
from rewards.weights import (
    MissingWeightsError,
    batched,
    check_batch_size,
    check_prompts,
    load_state_dict,
    missing,
    resolve_device,
    resolve_dtype,
    resolve_file,
)

IMAGE_REWARD_REPO = "THUDM/ImageReward"
IMAGE_REWARD_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
BERT_TOKENIZER = "google-bert/bert-base-uncased"  # what BLIP's init_tokenizer() loads
IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
MAX_TOKENS = 35
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
VIT_HEAD_DIM = 64  # BLIP's ViTs (timm layout) use 64-d heads: ViT-B 12 heads, ViT-L 16


class ImageRewardModel(nn.Module):
    """BLIP image encoder + text encoder with cross-attention + MLP head on the text [CLS]."""

    def __init__(self, vision_config, text_config):
        super().__init__()
        self.vision = BlipVisionModel(vision_config)
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.mlp = ScoreMLP(text_config.hidden_size)

    def forward(self, pixel_values, input_ids, attention_mask) -> torch.Tensor:
        """The raw MLP output, [N] float32 (the head runs in float32, as the authors' .float())."""
        image_embeds = self.vision(pixel_values=pixel_values).last_hidden_state
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=image_embeds.device)
        text = self.text(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_mask,
        ).last_hidden_state  # bidirectional self-attention (is_decoder=False), cross-attention on
        return self.mlp(text[:, 0, :].float()).squeeze(-1)


def vision_config_from_checkpoint(state: dict[str, torch.Tensor]):
    """BLIP ViT sizes read off the checkpoint's tensors (width, depth, patch, image size, MLP)."""
    try:
        width = state["blip.visual_encoder.cls_token"].shape[-1]
        patch = state["blip.visual_encoder.patch_embed.proj.weight"].shape[-1]
        positions = state["blip.visual_encoder.pos_embed"].shape[1]
        mlp = state["blip.visual_encoder.blocks.0.mlp.fc1.weight"].shape[0]
    except KeyError as err:
        raise CheckpointLayoutError(f"not an ImageReward/BLIP checkpoint: no tensor {err}") from err
    layers = len({k.split(".")[3] for k in state if k.startswith("blip.visual_encoder.blocks.")})
    grid = math.isqrt(positions - 1)
    if grid * grid != positions - 1:
        raise CheckpointLayoutError(f"ViT position table of {positions} entries is not 1 + a square grid")
    return BlipVisionConfig(
        hidden_size=width,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // VIT_HEAD_DIM),
        image_size=grid * patch,
        patch_size=patch,
        hidden_act="gelu",
        layer_norm_eps=1e-6,  # BLIP's ViT: partial(nn.LayerNorm, eps=1e-6)
    )


def text_config_from_med_config(med: dict, encoder_width: int):
    """BLIP's med_config.json (a BertConfig) -> BlipTextConfig with cross-attention to the ViT."""
    return BlipTextConfig(
        vocab_size=med["vocab_size"],
        hidden_size=med["hidden_size"],
        encoder_hidden_size=encoder_width,  # ImageReward sets encoder_width = vision width
        intermediate_size=med["intermediate_size"],
        num_hidden_layers=med["num_hidden_layers"],
        num_attention_heads=med["num_attention_heads"],
        max_position_embeddings=med["max_position_embeddings"],
        hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=med.get("pad_token_id", 0),
        # in transformers' BLIP text model, is_decoder=True is what builds the cross-attention
        # layers; the forward pass still runs bidirectionally (is_decoder=False by default)
        is_decoder=True,
    )


def load_image_reward_model(checkpoint: Path, med_config: dict, judge: str) -> ImageRewardModel:
    state = load_state_dict(checkpoint, judge)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    state = {k.removeprefix("module."): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    vision_config = vision_config_from_checkpoint(state)
    text_config = text_config_from_med_config(med_config, vision_config.hidden_size)
    mapped = image_reward_to_blip(state)
    with no_init_weights():  # every parameter is overwritten by the checkpoint below
        model = ImageRewardModel(vision_config, text_config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_exact(mapped, expected, f"{judge} checkpoint {checkpoint.name}")
    model.load_state_dict(mapped, strict=True)
    return model.eval()


def center_crop_pixels(images: list[Image.Image], size: int, mean=CLIP_MEAN, std=CLIP_STD) -> torch.Tensor:
    """torchvision's Resize(size, bicubic) + CenterCrop(size) + ToTensor + Normalize, on PIL images."""
    out = []
    for img in images:
        img = img.convert("RGB")
        w, h = img.size
        if w <= h:  # shortest side -> size, the other truncated like torchvision
            new_w, new_h = size, int(size * h / w)
        else:
            new_w, new_h = int(size * w / h), size
        if (new_w, new_h) != (w, h):
            img = img.resize((new_w, new_h), Image.BICUBIC)
        left, top = int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))
        img = img.crop((left, top, left + size, top + size))
        out.append(np.asarray(img, dtype=np.float32) / 255.0)
    pixels = torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return ((pixels - mean_t) / std_t).contiguous()


class BlipRewardJudge(Judge):
    """A BLIP+MLP reward model: (MLP([CLS]) - mean) / std."""

    def __init__(self, model: ImageRewardModel, tokenizer, name: str, mean: float, std: float,
                 device, dtype, batch_size: int, tie_margin: float, max_tokens: int = MAX_TOKENS):
        super().__init__(name=name, tie_margin=tie_margin)
        # a judge: its weights never train (the differentiable path needs gradients for the pixels only)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.model.mlp.float()
        self.tokenizer = tokenizer
        self.mean, self.std = mean, std
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self.max_tokens = max_tokens
        self.image_size = model.vision.config.image_size

    @torch.no_grad()
    def raw(self, prompts: list[str], images: Images) -> torch.Tensor:
        """The MLP output before normalisation, [N] float32."""
        prompts = check_prompts(prompts, num_images(images), self.name)
        pil = to_pil(images)
        out = []
        for start, chunk in zip(range(0, len(pil), self.batch_size), batched(pil, self.batch_size)):
            tokens = self.tokenizer(
                prompts[start : start + len(chunk)], padding="max_length", truncation=True,
                max_length=self.max_tokens, return_tensors="pt",
            )
            pixels = center_crop_pixels(chunk, self.image_size).to(self.device, self.dtype)
            out.append(
                self.model(pixels, tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)).cpu()
            )
        return torch.cat(out) if out else torch.empty(0)

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        return (self.raw(prompts, images) - self.mean) / self.std

    def score_differentiable(self, prompts: list[str], images: torch.Tensor) -> torch.Tensor:
        """The score of ``score`` with gradients flowing back to the pixels (rewards/differentiable.py): the tensor
        resized (shortest side, bicubic) and centre-cropped as ``center_crop_pixels``, without 8-bit rounding; one
        forward pass, [N] float32 on the images' device."""
        images = check_image_tensor(images, f"{self.name}.score_differentiable: images")
        prompts = check_prompts(prompts, images.shape[0], self.name)
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=self.max_tokens,
                                return_tensors="pt")
        size = self.image_size
        pixels = resize_and_crop(images, size, (size, size), CLIP_MEAN, CLIP_STD, rounded=True)
        raw = self.model(pixels.to(self.device, self.dtype), tokens["input_ids"].to(self.device),
                         tokens["attention_mask"].to(self.device))
        return ((raw - self.mean) / self.std).to(images.device)

    def __repr__(self) -> str:
        return f"BlipRewardJudge(name={self.name!r}, mean={self.mean}, std={self.std}, tie_margin={self.tie_margin})"


def _load(
    judge: str, model, filename, med_config, tokenizer, mean, std, device, dtype, batch_size, tie_margin
) -> BlipRewardJudge:
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    check_batch_size(batch_size)
    checkpoint = resolve_file(model, filename, judge)
    # med_config.json and a tokenizer live beside the checkpoint (same folder or hub repo)
    home = checkpoint.parent if Path(model).expanduser().exists() else model
    med_path = Path(med_config) if med_config else resolve_file(home, MED_CONFIG_FILE, judge)
    try:
        med = json.loads(Path(med_path).read_text())
    except (OSError, ValueError) as err:
        raise MissingWeightsError(f"judge {judge!r}: cannot read the text-encoder config {str(med_path)!r}: {err}") from err
    net = load_image_reward_model(checkpoint, med, judge)
    if tokenizer is None:
        tokenizer = str(home) if _has_tokenizer(home) else BERT_TOKENIZER
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer))
    except (OSError, ValueError) as err:
        raise missing(judge, str(tokenizer), err, what="tokenizer (bert-base-uncased)") from err
    return BlipRewardJudge(net, tok, judge, mean, std, device, dtype, batch_size, tie_margin)


def _has_tokenizer(home) -> bool:
    folder = Path(home)
    return folder.is_dir() and any((folder / f).is_file() for f in ("vocab.txt", "tokenizer.json"))


# --- factories registered in rewards/__init__.py ----------------------------------------------

def image_reward(
    model: str | Path = IMAGE_REWARD_REPO,
    filename: str = IMAGE_REWARD_FILE,
    med_config: str | Path | None = None,
    tokenizer: str | None = None,
    device=None,
    dtype=None,
    batch_size: int = 32,
    tie_margin: float = 0.0,
) -> BlipRewardJudge:
    """ImageReward v1.0: hub repo, folder (ImageReward.pt + med_config.json) or the .pt file."""
    return _load("imagereward", model, filename, med_config, tokenizer, IMAGE_REWARD_MEAN, IMAGE_REWARD_STD,
                 device, dtype, batch_size, tie_margin)


def vp_score(
    model: str | Path | None = None,
    filename: str = "VP-Score.pt",
    med_config: str | Path | None = None,
    tokenizer: str | None = None,
    mean: float = 0.0,
    std: float = 1.0,
    device=None,
    dtype=None,
    batch_size: int = 32,
    tie_margin: float = 0.0,
) -> BlipRewardJudge:
    """VP-Score (VisionPrefer), read as a checkpoint in ImageReward's layout.

    Not verified here: where VP-Score's weights are published and that they use ImageReward's
    layout (the paper says it was trained in ImageReward's framework). So there is no default
    download: pass ``model=`` (file or folder). A checkpoint of any other layout is refused with
    the list of keys that do not fit. The score is the raw MLP output unless you pass the
    normalisation ``mean``/``std`` its authors publish.
    """
    if model is None:
        raise MissingWeightsError(
            "judge 'vpscore': no verified public location of VP-Score's weights is built in; pass "
            "model=<VP-Score checkpoint file or folder> (ImageReward layout: BLIP ViT + BERT + MLP keys, "
            "with med_config.json beside it or med_config=<path>)"
        )
    return _load("vpscore", model, filename, med_config, tokenizer, mean, std, device, dtype, batch_size, tie_margin)

"""ImageReward / VP-Score: BLIP-layout checkpoints mapped onto transformers' BLIP classes.

The tiny checkpoint is written in ImageReward's own key layout (Salesforce BLIP names) by a
conversion written here, and a forward pass written here from those raw tensors (timm ViT +
BLIP's med.py BERT with cross-attention + MLP) checks the adapter's scores.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import BlipTextConfig, BlipVisionConfig

import rewards
from align.testing.tiny_judges import WORDS, bert_tokenizer, images_as_tensor, random_images
from rewards.checkpoint_keys import CheckpointLayoutError, check_exact, image_reward_to_blip
from rewards.imagereward import (
    IMAGE_REWARD_MEAN,
    IMAGE_REWARD_STD,
    ImageRewardModel,
    center_crop_pixels,
    text_config_from_med_config,
    vision_config_from_checkpoint,
)
from rewards.weights import MissingWeightsError

PROMPTS = ["a red circle", "a blue square on the left of the green triangle", "a photo of a cat"]
TINY_MED = dict(vocab_size=len(WORDS) + 6, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=40, hidden_act="gelu", layer_norm_eps=1e-12,
                pad_token_id=0, encoder_width=128, add_cross_attention=True, model_type="bert")


def to_image_reward_layout(sd: dict[str, torch.Tensor], max_positions: int) -> dict[str, torch.Tensor]:
    """ImageRewardModel keys -> the names in ImageReward.pt (Salesforce BLIP + ImageReward's MLP)."""
    out = {}
    for key, value in sd.items():
        if key.startswith("text."):
            out["blip.text_encoder." + key[5:]] = value
        elif key.startswith("mlp."):
            out[key] = value
        else:
            k = key[len("vision."):]
            k = (k.replace("embeddings.class_embedding", "cls_token")
                  .replace("embeddings.position_embedding", "pos_embed")
                  .replace("embeddings.patch_embedding", "patch_embed.proj")
                  .replace("post_layernorm", "norm")
                  .replace("encoder.layers", "blocks")
                  .replace("layer_norm1", "norm1").replace("layer_norm2", "norm2")
                  .replace("self_attn.qkv", "attn.qkv").replace("self_attn.projection", "attn.proj"))
            out["blip.visual_encoder." + k] = value
    # tensors the real file also carries that scoring does not use
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(max_positions).unsqueeze(0)
    width = sd["vision.embeddings.class_embedding"].shape[-1]
    hidden = sd["mlp.layers.0.weight"].shape[1]
    out.update({"blip.vision_proj.weight": torch.randn(8, width), "blip.vision_proj.bias": torch.zeros(8),
                "blip.text_proj.weight": torch.randn(8, hidden), "blip.text_proj.bias": torch.zeros(8)})
    return {k: v.clone() for k, v in out.items()}


def tiny_image_reward_model(seed: int = 0) -> ImageRewardModel:
    vision = BlipVisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, hidden_act="gelu", layer_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = ImageRewardModel(vision, text_config_from_med_config(TINY_MED, 128)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for p in model.mlp.parameters():  # the authors' init is tiny; make the head's output vary
            p.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def ir_release(tmp_path_factory):
    """A folder laid out like the THUDM/ImageReward hub repo: ImageReward.pt + med_config.json."""
    folder = tmp_path_factory.mktemp("ImageReward")
    tokenizer = bert_tokenizer(folder)
    assert len(tokenizer) == TINY_MED["vocab_size"]
    model = tiny_image_reward_model()
    state = to_image_reward_layout(model.state_dict(), TINY_MED["max_position_embeddings"])
    torch.save(state, folder / "ImageReward.pt")
    (folder / "med_config.json").write_text(json.dumps(TINY_MED))
    return folder, state, tokenizer


def _ln(x, sd, name, eps):
    return F.layer_norm(x, (x.shape[-1],), sd[name + ".weight"], sd[name + ".bias"], eps)


def _lin(x, sd, name):
    return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])


def _heads(x, n):
    b, t, c = x.shape
    return x.view(b, t, n, c // n).transpose(1, 2)


def _attention(q, k, v, heads, mask=None):
    q, k, v = _heads(q, heads), _heads(k, heads), _heads(v, heads)
    scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
    if mask is not None:
        scores = scores + mask
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(q.shape[0], -1, q.shape[1] * q.shape[-1])


@torch.no_grad()
def reference_image_reward(sd, pixels, input_ids, attention_mask, vit_heads, bert_heads):
    """ImageReward.score() re-done from the raw checkpoint tensors (BLIP's vit.py + med.py)."""
    v = "blip.visual_encoder."
    patch = sd[v + "patch_embed.proj.weight"].shape[-1]
    x = F.conv2d(pixels, sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"], stride=patch)
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([sd[v + "cls_token"].expand(x.shape[0], -1, -1), x], 1) + sd[v + "pos_embed"]
    blocks = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith(v + "blocks."))
    for i in range(blocks):
        b = f"{v}blocks.{i}."
        h = _ln(x, sd, b + "norm1", 1e-6)
        q, k, val = _lin(h, sd, b + "attn.qkv").chunk(3, dim=-1)
        x = x + _lin(_attention(q, k, val, vit_heads), sd, b + "attn.proj")
        x = x + _lin(F.gelu(_lin(_ln(x, sd, b + "norm2", 1e-6), sd, b + "mlp.fc1")), sd, b + "mlp.fc2")
    image = _ln(x, sd, v + "norm", 1e-6)

    t = "blip.text_encoder."
    n = input_ids.shape[1]
    h = sd[t + "embeddings.word_embeddings.weight"][input_ids] + sd[t + "embeddings.position_embeddings.weight"][:n]
    h = _ln(h, sd, t + "embeddings.LayerNorm", 1e-12)
    pad_mask = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0  # med.py's extended mask
    layers = 1 + max(int(k.split(".")[4]) for k in sd if k.startswith(t + "encoder.layer."))
    for i in range(layers):
        a = f"{t}encoder.layer.{i}."
        ctx = _attention(_lin(h, sd, a + "attention.self.query"), _lin(h, sd, a + "attention.self.key"),
                         _lin(h, sd, a + "attention.self.value"), bert_heads, pad_mask)
        h = _ln(_lin(ctx, sd, a + "attention.output.dense") + h, sd, a + "attention.output.LayerNorm", 1e-12)
        ctx = _attention(_lin(h, sd, a + "crossattention.self.query"), _lin(image, sd, a + "crossattention.self.key"),
                         _lin(image, sd, a + "crossattention.self.value"), bert_heads)
        h = _ln(_lin(ctx, sd, a + "crossattention.output.dense") + h, sd, a + "crossattention.output.LayerNorm", 1e-12)
        ff = _lin(F.gelu(_lin(h, sd, a + "intermediate.dense")), sd, a + "output.dense")
        h = _ln(ff + h, sd, a + "output.LayerNorm", 1e-12)
    r = h[:, 0]
    for i in (0, 2, 4, 6, 7):
        r = _lin(r, sd, f"mlp.layers.{i}")
    return (r.squeeze(-1) - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD


def test_image_reward_matches_a_forward_pass_from_the_raw_checkpoint(ir_release):
    folder, state, tokenizer = ir_release
    judge = rewards.load("imagereward", model=str(folder), device="cpu", batch_size=2)
    images = random_images(3, size=(48, 40), seed=1)
    scores = judge.score(PROMPTS, images)
    tokens = tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    pixels = center_crop_pixels(images, 32)
    expected = reference_image_reward(state, pixels, tokens["input_ids"], tokens["attention_mask"], 2, 2)
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=1e-4)
    assert scores.std() > 1e-3
    # the raw head output, normalised with the authors' constants
    torch.testing.assert_close(scores, (judge.raw(PROMPTS, images) - 0.16717362830052426) / 1.0333394966054072)


def test_image_reward_from_the_pt_file_tensor_input_and_35_token_cut(ir_release):
    folder, _, _ = ir_release
    judge = rewards.load("imagereward", model=str(folder / "ImageReward.pt"), device="cpu")
    images = random_images(2, size=(32, 32), seed=2)
    long_prompt = " ".join(WORDS[i % len(WORDS)] for i in range(50))
    cut = " ".join(long_prompt.split()[:33])  # [CLS] + 33 words + [SEP] = 35 tokens
    a = judge.score([long_prompt, "a cat"], images_as_tensor(images))
    b = judge.score([cut, "a cat"], images)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_center_crop_pixels_follow_torchvision_resize_and_crop():
    img = Image.new("RGB", (64, 32))
    img.paste((255, 255, 255), (0, 0, 24, 32))  # white left strip, cropped away by the centre crop
    pixels = center_crop_pixels([img], 16)  # -> 32x16 bicubic, then columns 8..23
    resized = img.resize((32, 16), Image.BICUBIC).crop((8, 0, 24, 16))
    arr = torch.tensor(list(resized.getdata()), dtype=torch.float32).view(16, 16, 3).permute(2, 0, 1) / 255
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
    torch.testing.assert_close(pixels[0], (arr - mean) / std)


# The real ImageReward.pt layout (Salesforce BLIP names), written out by hand: BLIP ViT-L/16 at
# 224 px (1024 wide, 24 blocks, 14x14+1 positions, MLP 4096), BERT-base with cross-attention to
# 1024-d image tokens (768 wide, 12 layers, vocab 30524 = bert-base-uncased + [DEC] + [ENC],
# 512 positions), BLIP's unused contrastive projections to 256-d, and the 768->...->1 MLP.
REAL_MED_CONFIG = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, max_position_embeddings=512, hidden_act="gelu",
                       layer_norm_eps=1e-12, pad_token_id=0, encoder_width=768, add_cross_attention=True)


def real_image_reward_layout() -> dict[str, tuple[int, ...]]:
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    shapes: dict[str, tuple[int, ...]] = {
        v + "cls_token": (1, 1, 1024), v + "pos_embed": (1, 197, 1024),
        v + "patch_embed.proj.weight": (1024, 3, 16, 16), v + "patch_embed.proj.bias": (1024,),
        v + "norm.weight": (1024,), v + "norm.bias": (1024,),
        t + "embeddings.word_embeddings.weight": (30524, 768), t + "embeddings.position_embeddings.weight": (512, 768),
        t + "embeddings.LayerNorm.weight": (768,), t + "embeddings.LayerNorm.bias": (768,),
        t + "embeddings.position_ids": (1, 512),
        "blip.vision_proj.weight": (256, 1024), "blip.vision_proj.bias": (256,),
        "blip.text_proj.weight": (256, 768), "blip.text_proj.bias": (256,),
    }
    for i in range(24):
        b = f"{v}blocks.{i}."
        shapes.update({b + "norm1.weight": (1024,), b + "norm1.bias": (1024,),
                       b + "attn.qkv.weight": (3072, 1024), b + "attn.qkv.bias": (3072,),
                       b + "attn.proj.weight": (1024, 1024), b + "attn.proj.bias": (1024,),
                       b + "norm2.weight": (1024,), b + "norm2.bias": (1024,),
                       b + "mlp.fc1.weight": (4096, 1024), b + "mlp.fc1.bias": (4096,),
                       b + "mlp.fc2.weight": (1024, 4096), b + "mlp.fc2.bias": (1024,)})
    for i in range(12):
        a = f"{t}encoder.layer.{i}."
        for block, kv_width in (("attention", 768), ("crossattention", 1024)):
            shapes.update({a + f"{block}.self.query.weight": (768, 768), a + f"{block}.self.query.bias": (768,),
                           a + f"{block}.self.key.weight": (768, kv_width), a + f"{block}.self.key.bias": (768,),
                           a + f"{block}.self.value.weight": (768, kv_width), a + f"{block}.self.value.bias": (768,),
                           a + f"{block}.output.dense.weight": (768, 768), a + f"{block}.output.dense.bias": (768,),
                           a + f"{block}.output.LayerNorm.weight": (768,), a + f"{block}.output.LayerNorm.bias": (768,)})
        shapes.update({a + "intermediate.dense.weight": (3072, 768), a + "intermediate.dense.bias": (3072,),
                       a + "output.dense.weight": (768, 3072), a + "output.dense.bias": (768,),
                       a + "output.LayerNorm.weight": (768,), a + "output.LayerNorm.bias": (768,)})
    for i, (out_f, in_f) in zip((0, 2, 4, 6, 7), ((1024, 768), (128, 1024), (64, 128), (16, 64), (1, 16))):
        shapes.update({f"mlp.layers.{i}.weight": (out_f, in_f), f"mlp.layers.{i}.bias": (out_f,)})
    return shapes


def test_real_image_reward_layout_is_consumed_and_fits_strictly():
    state = {k: torch.empty(s, device="meta") for k, s in real_image_reward_layout().items()}
    vision = vision_config_from_checkpoint(state)
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads, vision.image_size,
            vision.patch_size, vision.intermediate_size) == (1024, 24, 16, 224, 16, 4096)
    text = text_config_from_med_config(REAL_MED_CONFIG, vision.hidden_size)
    mapped = image_reward_to_blip(state)
    with torch.device("meta"):
        model = ImageRewardModel(vision, text)
    check_exact(mapped, {k: tuple(v.shape) for k, v in model.state_dict().items()}, "ImageReward.pt")
    assert isinstance(text, BlipTextConfig) and text.encoder_hidden_size == 1024
    with pytest.raises(CheckpointLayoutError, match="blip.itm_head.weight"):
        image_reward_to_blip({**state, "blip.itm_head.weight": torch.empty(2, 768, device="meta")})


def test_vp_score_needs_weights_and_reads_the_image_reward_layout(ir_release, tmp_path):
    with pytest.raises(MissingWeightsError, match="model=<VP-Score checkpoint"):
        rewards.load("vpscore")
    folder, _, _ = ir_release
    vp = tmp_path / "vp"
    vp.mkdir()
    for name in ("med_config.json", "vocab.txt", "tokenizer_config.json"):
        shutil.copy(folder / name, vp / name)
    shutil.copy(folder / "ImageReward.pt", vp / "VP-Score.pt")
    judge = rewards.load("vpscore", model=str(vp), device="cpu")
    images = random_images(2, seed=9)
    torch.testing.assert_close(judge.score(PROMPTS[:2], images), judge.raw(PROMPTS[:2], images))
    # a checkpoint of another architecture is refused, naming keys that do not fit
    torch.save({"visual.proj": torch.zeros(4, 4)}, vp / "other.pt")
    with pytest.raises(CheckpointLayoutError, match="cls_token"):
        rewards.load("vpscore", model=str(vp / "other.pt"), device="cpu")


def test_missing_med_config_is_named(ir_release, tmp_path):
    folder, _, _ = ir_release
    shutil.copy(folder / "ImageReward.pt", tmp_path / "ImageReward.pt")
    with pytest.raises(MissingWeightsError, match="med_config.json"):
        rewards.load("imagereward", model=str(tmp_path), device="cpu")

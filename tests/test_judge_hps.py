"""HPS v2.1: an open_clip-layout checkpoint mapped onto transformers' CLIPModel.

The tiny checkpoint is written in open_clip's layout by a conversion written here (the reverse
of the adapter's), and an open_clip-style forward pass written here from the raw tensors
checks that the mapped model computes the same score.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import CLIPConfig, CLIPModel

import rewards
from align.testing.tiny_judges import clip_tokenizer, random_images, save_tiny_clip
from rewards.checkpoint_keys import CheckpointLayoutError, open_clip_to_transformers_clip
from rewards.hps import letterbox_pixels
from rewards.weights import MissingWeightsError

PROMPTS = ["a red circle", "a blue square on the left", "a green triangle"]
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def to_open_clip_layout(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers CLIPModel keys -> open_clip's (packed q/k/v, x @ P projections)."""
    out = {}
    for src, dst in (("text_model.encoder.layers", "transformer.resblocks"),
                     ("vision_model.encoder.layers", "visual.transformer.resblocks")):
        n = 1 + max(int(k.split(".")[3]) for k in hf if k.startswith(src + "."))
        for i in range(n):
            a, b = f"{src}.{i}.", f"{dst}.{i}."
            for p in ("weight", "bias"):
                out[b + f"ln_1.{p}"] = hf[a + f"layer_norm1.{p}"]
                out[b + f"ln_2.{p}"] = hf[a + f"layer_norm2.{p}"]
                out[b + f"attn.in_proj_{p}"] = torch.cat([hf[a + f"self_attn.{x}_proj.{p}"] for x in "qkv"])
                out[b + f"attn.out_proj.{p}"] = hf[a + f"self_attn.out_proj.{p}"]
                out[b + f"mlp.c_fc.{p}"] = hf[a + f"mlp.fc1.{p}"]
                out[b + f"mlp.c_proj.{p}"] = hf[a + f"mlp.fc2.{p}"]
    out["token_embedding.weight"] = hf["text_model.embeddings.token_embedding.weight"]
    out["positional_embedding"] = hf["text_model.embeddings.position_embedding.weight"]
    out["ln_final.weight"] = hf["text_model.final_layer_norm.weight"]
    out["ln_final.bias"] = hf["text_model.final_layer_norm.bias"]
    out["text_projection"] = hf["text_projection.weight"].t().contiguous()
    out["logit_scale"] = hf["logit_scale"]
    out["visual.class_embedding"] = hf["vision_model.embeddings.class_embedding"]
    out["visual.positional_embedding"] = hf["vision_model.embeddings.position_embedding.weight"]
    out["visual.conv1.weight"] = hf["vision_model.embeddings.patch_embedding.weight"]
    for p in ("weight", "bias"):
        out[f"visual.ln_pre.{p}"] = hf[f"vision_model.pre_layrnorm.{p}"]
        out[f"visual.ln_post.{p}"] = hf[f"vision_model.post_layernorm.{p}"]
    out["visual.proj"] = hf["visual_projection.weight"].t().contiguous()
    return {k: v.clone() for k, v in out.items()}


def _blocks(x, sd, prefix, heads, mask):
    layers = 1 + max(int(k[len(prefix) + 1 :].split(".")[0]) for k in sd if k.startswith(prefix + "."))
    width = x.shape[-1]
    for i in range(layers):
        p = f"{prefix}.{i}."
        h = F.layer_norm(x, (width,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"]).transpose(0, 1)
        attn, _ = F.multi_head_attention_forward(
            h, h, h, width, heads, sd[p + "attn.in_proj_weight"], sd[p + "attn.in_proj_bias"], None, None, False,
            0.0, sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"], training=False,
            need_weights=False, attn_mask=mask,
        )
        x = x + attn.transpose(0, 1)
        h = F.layer_norm(x, (width,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])
        x = x + F.linear(F.gelu(F.linear(h, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"])),
                         sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
    return x


@torch.no_grad()
def open_clip_reference_score(sd, pixels, token_lists, heads):
    """What open_clip's CLIP.forward + HPS's diagonal cosine compute, from the raw tensors."""
    patch = sd["visual.conv1.weight"].shape[-1]
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=patch).flatten(2).transpose(1, 2)
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], dim=1) + sd["visual.positional_embedding"]
    w = x.shape[-1]
    x = F.layer_norm(x, (w,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = _blocks(x, sd, "visual.transformer.resblocks", heads, None)
    img = F.layer_norm(x[:, 0], (w,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"]) @ sd["visual.proj"]
    texts = []
    for tokens in token_lists:
        t = torch.tensor([tokens])
        n = t.shape[1]
        h = sd["token_embedding.weight"][t] + sd["positional_embedding"][:n]
        mask = torch.full((n, n), float("-inf")).triu(1)
        h = _blocks(h, sd, "transformer.resblocks", heads, mask)
        h = F.layer_norm(h, (h.shape[-1],), sd["ln_final.weight"], sd["ln_final.bias"])
        texts.append(h[0, t[0].argmax()] @ sd["text_projection"])
    txt = torch.stack(texts)
    return (F.normalize(img, dim=-1) * F.normalize(txt, dim=-1)).sum(-1)


@pytest.fixture(scope="module")
def hps_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hps")
    base = root / "clip-h-base"  # stands in for laion/CLIP-ViT-H-14-laion2B-s32B-b79K
    model = save_tiny_clip(base, seed=4, hidden_act="gelu")  # ViT-H-14 uses exact GELU
    release = root / "xswu-HPSv2"
    release.mkdir()
    open_clip_state = to_open_clip_layout(model.state_dict())
    torch.save({"state_dict": open_clip_state}, release / "HPS_v2.1_compressed.pt")
    return base, release, open_clip_state, model


def test_hps_scores_match_an_open_clip_style_forward(hps_setup):
    base, release, open_clip_state, _ = hps_setup
    judge = rewards.load("hps", model=str(release), base=str(base), device="cpu", batch_size=2)
    images = random_images(3, size=(40, 28), seed=2)
    scores = judge.score(PROMPTS, images)
    pixels = letterbox_pixels(images, 32, MEAN, STD)
    tok = clip_tokenizer()
    tokens = [tok(p)["input_ids"] for p in PROMPTS]
    expected = open_clip_reference_score(open_clip_state, pixels, tokens, heads=2)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert scores.std() > 1e-4


def test_hps_loads_from_the_file_itself_and_equals_the_transformers_model(hps_setup):
    base, release, _, model = hps_setup
    judge = rewards.load("hps", model=str(release / "HPS_v2.1_compressed.pt"), base=str(base), device="cpu")
    loaded = judge.embedder.model.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded[key], value, msg=key)


def test_letterbox_resizes_longest_side_and_pads_black():
    wide = __import__("PIL.Image", fromlist=["Image"]).new("RGB", (64, 32), (255, 0, 0))
    pixels = letterbox_pixels([wide], 32, MEAN, STD)[0]
    black = torch.tensor([(0 - m) / s for m, s in zip(MEAN, STD)])
    red = torch.tensor([(c - m) / s for c, m, s in zip((1.0, 0.0, 0.0), MEAN, STD)])
    assert pixels.shape == (3, 32, 32)
    torch.testing.assert_close(pixels[:, :8, :].mean(dim=(1, 2)), black)  # 8 rows of padding on top
    torch.testing.assert_close(pixels[:, -8:, :].mean(dim=(1, 2)), black)  # and below
    torch.testing.assert_close(pixels[:, 10:22, :].mean(dim=(1, 2)), red, atol=1e-3, rtol=0)


def vit_h_14_open_clip_layout() -> dict[str, tuple[int, ...]]:
    """Every tensor of HPS_v2.1_compressed.pt's state_dict: open_clip ViT-H-14 (written out, not downloaded).

    open_clip ViT-H-14: embed 1024; vision width 1280, 32 layers, patch 14, 224 px (16x16+1
    positions), MLP 5120; text width 1024, 24 layers, 77 tokens, vocab 49408, MLP 4096.
    """
    shapes: dict[str, tuple[int, ...]] = {
        "positional_embedding": (77, 1024), "text_projection": (1024, 1024), "logit_scale": (),
        "token_embedding.weight": (49408, 1024), "ln_final.weight": (1024,), "ln_final.bias": (1024,),
        "visual.class_embedding": (1280,), "visual.positional_embedding": (257, 1280),
        "visual.proj": (1280, 1024), "visual.conv1.weight": (1280, 3, 14, 14),
        "visual.ln_pre.weight": (1280,), "visual.ln_pre.bias": (1280,),
        "visual.ln_post.weight": (1280,), "visual.ln_post.bias": (1280,),
    }
    for prefix, layers, width in (("transformer", 24, 1024), ("visual.transformer", 32, 1280)):
        for i in range(layers):
            b = f"{prefix}.resblocks.{i}."
            shapes.update({
                b + "ln_1.weight": (width,), b + "ln_1.bias": (width,),
                b + "attn.in_proj_weight": (3 * width, width), b + "attn.in_proj_bias": (3 * width,),
                b + "attn.out_proj.weight": (width, width), b + "attn.out_proj.bias": (width,),
                b + "ln_2.weight": (width,), b + "ln_2.bias": (width,),
                b + "mlp.c_fc.weight": (4 * width, width), b + "mlp.c_fc.bias": (4 * width,),
                b + "mlp.c_proj.weight": (width, 4 * width), b + "mlp.c_proj.bias": (width,),
            })
    return shapes


# laion/CLIP-ViT-H-14-laion2B-s32B-b79K's config.json (the architecture HPS v2.1 fine-tunes)
VIT_H_14 = dict(
    text_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
                     hidden_act="gelu", max_position_embeddings=77, vocab_size=49408),
    vision_config=dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=16, num_hidden_layers=32,
                       hidden_act="gelu", image_size=224, patch_size=14),
    projection_dim=1024,
)


def test_real_hps_layout_is_fully_consumed_and_fits_vit_h_14_strictly():
    layout = vit_h_14_open_clip_layout()
    assert len(layout) == 14 + 12 * (24 + 32)
    state = {k: torch.empty(shape, device="meta") for k, shape in layout.items()}
    mapped = open_clip_to_transformers_clip(state)
    with torch.device("meta"):
        target = {k: tuple(v.shape) for k, v in CLIPModel(CLIPConfig(**VIT_H_14)).state_dict().items()}
    assert {k: tuple(v.shape) for k, v in mapped.items()} == target
    # the causal mask some exports carry is accepted; anything else unknown is refused
    open_clip_to_transformers_clip({**state, "attn_mask": torch.empty(77, 77, device="meta")})
    with pytest.raises(CheckpointLayoutError, match="visual.head.weight"):
        open_clip_to_transformers_clip({**state, "visual.head.weight": torch.empty(2, device="meta")})


def test_hps_checkpoint_of_another_size_is_refused(hps_setup, tmp_path):
    base, _, open_clip_state, _ = hps_setup
    bad = dict(open_clip_state)
    bad["visual.proj"] = torch.zeros(48, 8)  # projection to 8-d instead of 16-d
    torch.save({"state_dict": bad}, tmp_path / "HPS_v2.1_compressed.pt")
    with pytest.raises(CheckpointLayoutError, match="shape mismatch"):
        rewards.load("hps", model=str(tmp_path), base=str(base), device="cpu")


def test_hps_missing_file_is_named(hps_setup, tmp_path):
    base = hps_setup[0]
    with pytest.raises(MissingWeightsError, match="HPS_v2.1_compressed.pt"):
        rewards.load("hps", model=str(tmp_path), base=str(base), device="cpu")


def test_hps_cleans_captions_as_open_clip_before_tokenizing(hps_setup):
    base, release, _, _ = hps_setup
    judge = rewards.load("hps", model=str(release), base=str(base), device="cpu")
    tokenizer = judge.embedder.processor.tokenizer
    seen = []

    def recording(texts, **kwargs):
        seen.extend(texts)
        return tokenizer(texts, **kwargs)

    judge.embedder.processor.tokenizer = recording
    judge.score(["a “red”   circle &amp;amp; the\tsquare"], random_images(1, seed=3))
    assert seen == ['a "red" circle & the square']

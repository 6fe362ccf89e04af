"""Phi-3.5-vision without the model repository's remote code.

The released Phi-3(.5)-vision checkpoints (and LLaVA-Reward, which is built on them) ship their
modelling code as ``modeling_phi3_v.py`` in the model repository; it needs
``trust_remote_code=True`` and does not run on transformers 5. This module rebuilds the model from
transformers' own classes: ``Phi3Model`` / ``Phi3ForCausalLM`` for the language model and
``CLIPVisionModel`` for the vision tower, plus the image-embedding glue of the remote
``Phi3ImageEmbedding``, under the checkpoint's own parameter names::

    lm_head.weight, model.embed_tokens.weight, model.norm.weight, model.layers.<i>.*
    model.vision_embed_tokens.glb_GN                      [1, 1, 4 * C]     (C = 1024 for ViT-L)
    model.vision_embed_tokens.sub_GN                      [1, 1, 1, 4 * C]
    model.vision_embed_tokens.img_processor.vision_model.*                (CLIP ViT-L/14-336)
    model.vision_embed_tokens.img_projection.{0,2}.*      Linear(4C, H), GELU, Linear(H, H)

Image tokens (``Phi3ImageEmbedding.hd_feature_transform``, order ``sub_glb``): per image, the CLIP
patch features of layer ``layer_idx`` (CLS dropped) of every 336 px view, each 24 x 24 grid merged
2 x 2 into 12 x 12 tokens of 4C; the sub-images tiled into a (rows*12) x (cols*12) grid, ``sub_GN``
appended at the end of every grid row; then ``glb_GN``; then the global view's 12 x 12 grid with
``sub_GN`` after every row. The projector maps all of them to the LLM width, and they replace the
text embeddings at the negative placeholder ids that rewards/phi3v_processor.py writes.

Verified against the remote code (transformers 4.44) at random weights:
experiments/phi3v_reference.py, tests/test_phi3v_model.py.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, Phi3Config, Phi3ForCausalLM, Phi3Model

MAX_INPUT_ID = int(1e9)  # placeholder ids are in (-MAX_INPUT_ID, 0)
# The remote code hard-codes this vision tower (config.img_processor names only the model).
CLIP_VIT_LARGE_336 = dict(
    hidden_act="quick_gelu", hidden_size=1024, image_size=336, intermediate_size=4096, layer_norm_eps=1e-5,
    num_attention_heads=16, num_channels=3, num_hidden_layers=24, patch_size=14, projection_dim=768,
)


class Phi3VConfig(Phi3Config):
    """Phi3Config + the vision fields of the hub's config.json (``embd_layer``, ``img_processor``).

    ``img_processor`` may carry a ``clip_config`` dict (a project extension, used by the tests for a
    small tower); without it the tower is CLIP ViT-L/14-336 as in the remote code."""

    model_type = "phi3_v"

    def __init__(self, embd_layer: dict | None = None, img_processor: dict | None = None, **kwargs):
        self.embd_layer = embd_layer or {
            "embedding_cls": "image", "hd_transform_order": "sub_glb", "projection_cls": "mlp",
            "use_hd_transform": True, "with_learnable_separator": True,
        }
        self.img_processor = img_processor or {
            "image_dim_out": 1024, "model_name": "openai/clip-vit-large-patch14-336", "name": "clip_vision_model",
            "num_img_tokens": 144,
        }
        super().__init__(**kwargs)

    def clip_vision_config(self) -> CLIPVisionConfig:
        return CLIPVisionConfig(**{**CLIP_VIT_LARGE_336, **self.img_processor.get("clip_config", {})})


def check_vision_config(config: Phi3VConfig) -> None:
    """One clear error for the vision settings the remote code does not implement either."""
    layer, processor = config.embd_layer, config.img_processor
    if not isinstance(processor, dict) or processor.get("name") != "clip_vision_model":
        raise ValueError(f"Phi-3-vision img_processor {processor!r}: only 'clip_vision_model' is implemented")
    if not (layer.get("use_hd_transform") and layer.get("with_learnable_separator")):
        raise ValueError(f"Phi-3-vision embd_layer {layer!r}: only the HD transform with learnable separators is implemented")
    if layer.get("hd_transform_order", "glb_sub") != "sub_glb":
        raise ValueError(f"hd_transform_order {layer.get('hd_transform_order')!r}: only 'sub_glb' is implemented")
    if layer.get("projection_cls", "linear") != "mlp":
        raise ValueError(f"projection_cls {layer.get('projection_cls')!r}: only 'mlp' is implemented")
    if processor.get("type_feature", "patch") != "patch":
        raise ValueError(f"type_feature {processor.get('type_feature')!r}: only 'patch' is implemented")


class CLIPTower(nn.Module):
    """Holds the CLIP vision model under ``vision_model`` so the parameter names are the
    checkpoint's ``img_processor.vision_model.*`` (the remote code's CLIPVisionModel wrapper)."""

    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        self.vision_model = CLIPVisionModel(config)

    def hidden_state(self, pixel_values: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """CLIP's ``hidden_states[layer_idx]`` (0: the pre-layernormed embeddings, k: after k layers),
        running only the layers needed. Layer by layer rather than ``output_hidden_states=True``:
        transformers 5 records hidden states with hooks, and a surrounding Phi3Model that recorded
        its own adds entries to the tower's tuple afterwards (measured: 3 entries became 5)."""
        layers = self.vision_model.encoder.layers
        index = layer_idx if layer_idx >= 0 else len(layers) + 1 + layer_idx
        if not 0 <= index <= len(layers):
            raise ValueError(f"layer_idx {layer_idx} for a vision tower of {len(layers)} layers")
        hidden = self.vision_model.pre_layrnorm(self.vision_model.embeddings(pixel_values))
        for layer in layers[:index]:
            hidden = layer(hidden, None)
        return hidden


def merge_2x2(features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[n * rows * cols, g * g, C] patch features -> [n, rows * g/2, cols * g/2, 4C]: each 2 x 2 block of
    patches concatenated (row-major within the block), the crops tiled row-major."""
    count, length, channels = features.shape
    grid = int(round(length**0.5))
    if grid * grid != length or grid % 2 or count % (rows * cols):
        raise ValueError(f"cannot merge {tuple(features.shape)} patch features into {rows} x {cols} crops")
    half = grid // 2
    merged = features.reshape(count, half, 2, half, 2, channels).permute(0, 1, 3, 2, 4, 5).reshape(count, half, half, 4 * channels)
    images = count // (rows * cols)
    tiled = merged.reshape(images, rows, cols, half, half, 4 * channels).permute(0, 1, 3, 2, 4, 5)
    return tiled.reshape(images, rows * half, cols * half, 4 * channels)


def append_row_separator(grid: torch.Tensor, separator: torch.Tensor) -> torch.Tensor:
    """[n, h, w, D] -> [n, h * (w + 1), D]: ``separator`` ([1, 1, 1, D]) after every row."""
    n, h, _, dim = grid.shape
    return torch.cat([grid, separator.expand(n, h, 1, dim)], dim=2).reshape(n, -1, dim)


class Phi3VImageEmbedding(nn.Module):
    """Text embeddings with the projected HD image tokens written over the placeholder positions."""

    def __init__(self, config: Phi3VConfig):
        super().__init__()
        check_vision_config(config)
        clip = config.clip_vision_config()
        self.img_processor = CLIPTower(clip)
        self.image_dim_out = clip.hidden_size
        self.crop_size = clip.image_size
        self.layer_idx = config.img_processor.get("layer_idx", -2)
        merged = 4 * self.image_dim_out
        self.glb_GN = nn.Parameter(torch.zeros(1, 1, merged))
        self.sub_GN = nn.Parameter(torch.zeros(1, 1, 1, merged))
        self.img_projection = nn.Sequential(nn.Linear(merged, config.hidden_size), nn.GELU(),
                                            nn.Linear(config.hidden_size, config.hidden_size))
        self.drop = nn.Dropout(config.embd_pdrop)
        self.vocab_size = config.vocab_size

    def patch_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, V, 3, S, S] views -> [N, V, patches, C] from hidden state ``layer_idx``, CLS dropped."""
        images, views = pixel_values.shape[:2]
        dtype = self.img_processor.vision_model.embeddings.patch_embedding.weight.dtype
        hidden = self.img_processor.hidden_state(pixel_values.flatten(0, 1).to(dtype), self.layer_idx)
        return hidden[:, 1:].reshape(images, views, -1, self.image_dim_out)

    def image_tokens(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """All images' projected tokens, concatenated in image order: [sum of tokens, H]."""
        features = self.patch_features(pixel_values)
        global_rows = append_row_separator(merge_2x2(features[:, 0], 1, 1), self.sub_GN)
        parts = []
        for i, (height, width) in enumerate(image_sizes.tolist()):
            rows, cols = int(height) // self.crop_size, int(width) // self.crop_size
            sub = merge_2x2(features[i, 1 : 1 + rows * cols], rows, cols)
            parts += [append_row_separator(sub, self.sub_GN)[0], self.glb_GN[0], global_rows[i]]
        first = self.img_projection[0]
        return self.img_projection(torch.cat(parts).to(device=first.weight.device, dtype=first.weight.dtype))

    def forward(self, input_ids: torch.Tensor, embed_tokens: nn.Embedding, pixel_values: torch.Tensor | None = None,
                image_sizes: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.nonzero((input_ids < 0) & (input_ids > -MAX_INPUT_ID), as_tuple=True)
        embeds = embed_tokens(input_ids.clamp(0, self.vocab_size))
        if len(positions[0]):
            if pixel_values is None or image_sizes is None:
                raise ValueError("input_ids hold image placeholders but no pixel_values / image_sizes were given")
            tokens = self.image_tokens(pixel_values, image_sizes)
            if tokens.shape[0] != len(positions[0]):
                raise ValueError(f"{len(positions[0])} image placeholders in input_ids for {tokens.shape[0]} image tokens")
            embeds = embeds.index_put(positions, tokens.to(embeds.dtype), accumulate=False)
        return self.drop(embeds)


class Phi3VModel(Phi3Model):
    """transformers' Phi3Model with ``vision_embed_tokens``; image inputs become ``inputs_embeds``."""

    config_class = Phi3VConfig

    def __init__(self, config: Phi3VConfig):
        super().__init__(config)
        self.vision_embed_tokens = Phi3VImageEmbedding(config)
        self.post_init()

    def embed_inputs(self, input_ids: torch.Tensor, pixel_values=None, image_sizes=None) -> torch.Tensor:
        """[B, L, H] input embeddings: text tokens, and image tokens at the negative placeholder ids."""
        return self.vision_embed_tokens(input_ids, self.embed_tokens, pixel_values, image_sizes)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, pixel_values=None,
                image_sizes=None, **kwargs):
        if input_ids is not None and inputs_embeds is None:
            inputs_embeds, input_ids = self.embed_inputs(input_ids, pixel_values, image_sizes), None
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, **kwargs)


class Phi3VForCausalLM(Phi3ForCausalLM):
    """Phi-3(.5)-vision: loads the hub checkpoint (``from_pretrained``) without remote code."""

    config_class = Phi3VConfig

    def __init__(self, config: Phi3VConfig):
        super().__init__(config)
        self.model = Phi3VModel(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, pixel_values=None,
                image_sizes=None, **kwargs):
        if input_ids is not None and inputs_embeds is None:
            inputs_embeds, input_ids = self.model.embed_inputs(input_ids, pixel_values, image_sizes), None
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, **kwargs)


def load_phi3v(model: str, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> Phi3VForCausalLM:
    """A Phi-3(.5)-vision folder or hub id, loaded natively; every checkpoint tensor must be used
    (CLIP's ``position_ids`` buffer, stored by older checkpoints, excepted)."""
    loaded, info = Phi3VForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=attn_implementation,
                                                    output_loading_info=True)
    unexpected = [k for k in info["unexpected_keys"] if not k.endswith("position_ids")]
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight" or not loaded.config.tie_word_embeddings]
    if unexpected or missing or info.get("mismatched_keys"):
        raise ValueError(f"Phi-3-vision checkpoint {model!r} does not fit the native model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}, mismatched {list(info.get('mismatched_keys') or [])[:5]}")
    return loaded.eval()


__all__ = ["Phi3VConfig", "Phi3VForCausalLM", "Phi3VImageEmbedding", "Phi3VModel", "load_phi3v"]

"""A tiny Qwen-Image 2.1 pipeline (QwenImage21Pipeline) built from scaled-down configs, for tests.

The classes are the real ones (QwenImage21Transformer2DModel, AutoencoderKLQwenImage21, Qwen3VLForConditionalGeneration,
FlowMatchEulerDiscreteScheduler, and the Qwen3VLProcessor's tokenizer and image processor) at random weights, saved with
``save_pretrained`` and loaded back through ``align.pipeline.load_pipeline`` like real weights. The tokenizer is
tiny_qwen's byte-level one (each byte a token, Qwen's special tokens) with a ChatML template of its own, so nothing is
downloaded.

Sizes: the pipeline fixes the VAE's spatial factor at 16 (``vae_scale_factor = 16``), so the tiny VAE keeps four
spatial downsamples (``dim_mult`` of five entries) at small widths: 64 px images <-> 8 x 4 x 4 latents, 16 image tokens
(each of the transformer's image slots stands for 2 x 2 of them: 4 slots).

The processor is written in the hub layout (tokenizer with its chat template, ``preprocessor_config.json`` of
Qwen2VLImageProcessor with Qwen3-VL's 16 px patches, ``processor_config.json``) without instantiating Qwen3VLProcessor,
whose video processor transformers builds only with torchvision; the family loads it without one where torchvision is
missing (text-to-image never calls it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage21,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
)
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from align.testbed.flow_models import FLOW_SETTINGS_FILE
from align.testing.tiny_qwen import QWEN_IMAGE_SCHEDULER, qwen_tokenizer

TEXT_HIDDEN = 16
Z_DIM = 8
RESOLUTION = 64
# ChatML: each message "<|im_start|>role\n" + its text parts + "<|im_end|>\n" (the pipeline counts the system
# message's tokens with it to drop them from the hidden states)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen3_vl(tokenizer) -> Qwen3VLForConditionalGeneration:
    """Qwen3-VL at a test size, its vision tokens those of ``tokenizer``."""
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config={"hidden_size": TEXT_HIDDEN, "intermediate_size": 16, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": len(tokenizer),
                     "pad_token_id": tokenizer.pad_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": TEXT_HIDDEN, "patch_size": 16, "num_position_embeddings": 16,
                       "deepstack_visual_indexes": [1]},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def tiny_qwen21_vae() -> AutoencoderKLQwenImage21:
    """The 2.1 VAE with its four spatial downsamples (factor 16) at small widths, and non-trivial latent statistics."""
    return AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.0, 0.3, -0.1, 0.2, -0.3],
        latents_std=[1.5, 0.8, 1.2, 2.0, 0.9, 1.1, 1.3, 0.7])


def tiny_qwen21_transformer(num_layers: int = 2, causal_condition: bool = True) -> QwenImage21Transformer2DModel:
    return QwenImage21Transformer2DModel(patch_size=1, in_channels=Z_DIM, out_channels=Z_DIM, num_layers=num_layers,
                                         attention_head_dim=16, num_attention_heads=2, context_in_dim=TEXT_HIDDEN,
                                         mlp_ratio=2, axes_dims_rope=(4, 6, 6), causal_condition=causal_condition)


def build_tiny_qwen21(folder: str | Path, seed: int = 0, causal_condition: bool = True) -> Path:
    """Save a tiny random QwenImage21Pipeline under ``folder`` and return its folder (``folder/pipeline``)."""
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer(CHAT_TEMPLATE)
    text_encoder = tiny_qwen3_vl(tokenizer)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16,
                                               temporal_patch_size=2, merge_size=2)
    pipe = QwenImage21Pipeline(transformer=tiny_qwen21_transformer(causal_condition=causal_condition),
                               vae=tiny_qwen21_vae(), scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
                               text_encoder=text_encoder, processor=_TokenizerOnly(tokenizer))
    pipe.register_modules(processor=None)
    out = Path(folder) / "pipeline"
    pipe.save_pretrained(out, safe_serialization=True)
    (out / FLOW_SETTINGS_FILE).write_text(json.dumps({"resolution": RESOLUTION}))
    # the processor in the hub layout
    tokenizer.save_pretrained(out / "processor")
    image_processor.save_pretrained(out / "processor")
    (out / "processor" / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    (out / "processor" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen3VLProcessor"]},
                                                     indent=2))
    return out


class _TokenizerOnly:
    """What QwenImage21Pipeline.__init__ reads of its processor (the chat template, the tokenizer), to build the
    pipeline before its processor is written in the hub layout."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, **kwargs):
        return [self.tokenizer.apply_chat_template(messages, **kwargs)]

"""Tiny random multi-image VLMs of the real transformers classes (Qwen2.5-VL, LLaVA-NeXT, InternVL),
and the tokenizer and generate recorder shared by the VLM judge tests.

Each builder writes a folder in the hub checkpoint layout (config + weights, tokenizer with its
named special tokens, the image processor's ``preprocessor_config.json``, ``processor_config.json``
naming the processor class, and a chat template) without instantiating the processor class itself:
Qwen2.5-VL's and InternVL's processors also hold a video processor, which transformers builds only
with torchvision. The judge then loads the folder the way it loads a downloaded checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    CLIPVisionConfig,
    InternVLConfig,
    InternVLForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# Index 0 is what a model with an all-zero final norm emits greedily (all logits equal -> argmax 0).
WORDS = ["7", "<unk>", "<s>", "</s>", "<pad>", "USER", "ASSISTANT", ":", "Rating", "Good", "User", "Assistant", "user",
         "assistant"]


def tiny_tokenizer(specials: list[str], named: dict[str, str] | None = None,
                   words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A word-level tokenizer; ``named`` tokens also become attributes (``tok.start_image_token``...);
    ``words`` are more ordinary words (e.g. "Yes", "No" for probability judges)."""
    vocab = {w: i for i, w in enumerate([*WORDS, *words])}
    for token in [*specials, *(named or {}).values()]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", extra_special_tokens=named or None)
    tok.add_special_tokens({"additional_special_tokens": [*specials, *(named or {}).values()]},
                           replace_extra_special_tokens=False)
    return tok


def chat_template(image: str) -> str:
    """A chat template in the models' style: role headers, images where the message puts them."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}" + image + "\n{% else %}{{ c['text'] }}\n{% endif %}{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def text_config(tok, model_type: str, **extra) -> dict:
    return {"model_type": model_type, "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
            "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            **extra}


def save_checkpoint(folder, model, tok, image_processor, processor_class: str, template: str, constant_answer: bool,
                    **processor_options) -> None:
    """Save in the hub layout; ``constant_answer`` zeroes the final norm so greedy decoding says "7"."""
    if constant_answer:
        with torch.no_grad():
            model.model.language_model.norm.weight.zero_()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    folder = Path(folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor_class,
                                                              **processor_options}))
    (folder / "chat_template.jinja").write_text(template)


QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_qwen25_vl(folder, constant_answer: bool = False, words: tuple[str, ...] = (), logit_scale: float = 1.0) -> None:
    """Qwen2.5-VL: 14 px patches merged 2x2; every image is resized to 56x56 -> 16 patches, 4 tokens.
    ``logit_scale`` multiplies the output head, so that random answers' probabilities spread more."""
    tok = tiny_tokenizer(QWEN_SPECIALS, words=words)
    ids = tok.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "out_hidden_size": 32,
                       "fullatt_block_indexes": [0]},
        text_config=text_config(tok, "qwen2_5_vl_text", rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),  # sums to head_dim / 2
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                               temporal_patch_size=2)
    template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    save_checkpoint(folder, model, tok, image_processor, "Qwen2_5_VLProcessor", template, constant_answer)


def build_llava_next(folder, constant_answer: bool = False, words: tuple[str, ...] = ()) -> None:
    """LLaVA-NeXT (anyres): a 28 px base view plus the tiles of the best grid pinpoint, 2x2 patches each."""
    tok = tiny_tokenizer(["<image>", "<|im_start|>", "<|im_end|>"], words=words)
    pinpoints = [[28, 28], [28, 56], [56, 28]]
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=28, patch_size=14, projection_dim=16),
        text_config=text_config(tok, "mistral"),
        image_token_index=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints,
        vision_feature_layer=-1, vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                 image_grid_pinpoints=pinpoints)
    save_checkpoint(folder, model, tok, image_processor, "LlavaNextProcessor", chat_template("<image>"),
                    constant_answer, patch_size=14, vision_feature_select_strategy="default",
                    num_additional_image_tokens=1)


INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}


def build_internvl(folder, constant_answer: bool = False, words: tuple[str, ...] = ()) -> None:
    """InternVL (transformers-native, ``-hf`` layout): 28 px tiles of 2x2 patches, pixel-shuffled to 1 token."""
    tok = tiny_tokenizer(["<|im_start|>", "<|im_end|>"], named=INTERNVL_TOKENS, words=words)
    config = InternVLConfig(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": [28, 28], "patch_size": [14, 14]},
        text_config=text_config(tok, "qwen2"),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=1, downsample_ratio=0.5,
    )
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config).eval()
    image_processor = GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True,
                                               min_patches=1, max_patches=2)
    save_checkpoint(folder, model, tok, image_processor, "InternVLProcessor", chat_template("<IMG_CONTEXT>"),
                    constant_answer, image_seq_length=1)


def record_generate(judge) -> list[dict]:
    """Wrap the loaded model's generate to see exactly what the judge fed it."""
    seen = []
    original = judge._model.generate

    def generate(**inputs):
        seen.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return original(**inputs)

    judge._model.generate = generate
    return seen


def build_vqascore_qwen(folder) -> None:
    """The tiny Qwen2.5-VL that VQAScore's pinned reference (tests/data/vqascore_reference.json) was made on."""
    build_qwen25_vl(folder, words=("Yes", "No", "Does", "this", "figure", "show", "Please", "answer", "or"),
                    logit_scale=12.0)


def vqascore_images(n: int = 4):
    """Deterministic 56x56 RGB test images (a multiple of 28: qwen-vl-utils and the processor leave them as they are)."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, size=(56, 56, 3), dtype=np.uint8)) for _ in range(n)]

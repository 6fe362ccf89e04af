"""Tiny Qwen-Image pipelines (text-to-image and instruction editing) built from scaled-down configs, for tests.

The classes are the real ones (QwenImageTransformer2DModel, AutoencoderKLQwenImage, Qwen2_5_VLForConditionalGeneration,
Qwen2Tokenizer, Qwen2VLProcessor, FlowMatchEulerDiscreteScheduler) at random weights, saved with ``save_pretrained`` and
loaded back through ``align.pipeline.load_pipeline`` like real weights. The configs are diffusers' own test configs
(tests/pipelines/qwenimage) with Qwen-Image's real scheduler config; the tokenizer is byte-level BPE without merges
(each byte one token) plus Qwen's special tokens, written here, so nothing is downloaded.

Sizes: 32 px images <-> 4 x 8 x 8 latents (the VAE downsamples by 4), 16 packed image tokens.

The editing pipeline (QwenImageEditPipeline) adds the processor that hands the source image to the text encoder: a
Qwen2VLProcessor written in the hub layout (tokenizer, ``preprocessor_config.json`` of Qwen2VLImageProcessor resizing
to at most 112 x 112 px, ``processor_config.json``) without instantiating the class, whose video processor transformers
builds only with torchvision; the family loads it without one where torchvision is missing. The pipeline resizes every
source to about 1024 x 1024 px, 16,384 source tokens here: ``small_sources`` scales that area down to 64 x 64 px (64
source tokens) for the family and the pipeline alike. QwenImageEditPlusPipeline (Qwen-Image-Edit-2509/2511) has the
same components; its text encoder's ~384 x 384 px sources are scaled to 32 x 32 px the same way.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from tokenizers import pre_tokenizers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from align.testbed.flow_models import FLOW_SETTINGS_FILE

QWEN_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                       "<|video_pad|>", "<think>", "</think>")
TEXT_HIDDEN = 16
Z_DIM = 4
RESOLUTION = 32
SOURCE_AREA_DIVISOR = 256  # small_sources: the editing pipeline's 1024 x 1024 px sources at 64 x 64 px
# Qwen-Image's scheduler_config.json (Qwen/Qwen-Image): exponential time shift with a terminal σ
QWEN_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                            max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
                            time_shift_type="exponential", invert_sigmas=False, stochastic_sampling=False,
                            use_beta_sigmas=False, use_exponential_sigmas=False, use_karras_sigmas=False)


def qwen_tokenizer(chat_template: str | None = None) -> Qwen2Tokenizer:
    """A Qwen2 byte-level tokenizer: the 256 byte symbols (no merges) and Qwen's special tokens."""
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tiny_qwen25_vl(tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL at diffusers' test size, its vision tokens those of ``tokenizer``."""
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": TEXT_HIDDEN, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": len(tokenizer), "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": TEXT_HIDDEN},
        hidden_size=TEXT_HIDDEN, vocab_size=len(tokenizer), bos_token_id=tokenizer.pad_token_id,
        eos_token_id=ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), vision_token_id=ids("<|vision_start|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwen_vae() -> AutoencoderKLQwenImage:
    """The causal video VAE at diffusers' test size (spatial downsampling 4), with non-trivial latent statistics so
    that code forgetting them is caught."""
    return AutoencoderKLQwenImage(base_dim=Z_DIM * 6, z_dim=Z_DIM, dim_mult=[1, 2, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
                                  latents_std=[1.5, 0.8, 1.2, 2.0])


def tiny_qwen_transformer(num_layers: int = 2) -> QwenImageTransformer2DModel:
    return QwenImageTransformer2DModel(patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=num_layers,
                                       attention_head_dim=16, num_attention_heads=3, joint_attention_dim=TEXT_HIDDEN,
                                       guidance_embeds=False, axes_dims_rope=(8, 4, 4))


def build_tiny_qwenimage(folder: str | Path, seed: int = 0) -> Path:
    """Save a tiny random QwenImagePipeline under ``folder`` and return its folder (``folder/pipeline``)."""
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    pipe = QwenImagePipeline(transformer=tiny_qwen_transformer(), vae=tiny_qwen_vae(),
                             scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
                             text_encoder=tiny_qwen25_vl(tokenizer), tokenizer=tokenizer)
    return save_tiny(pipe, folder)


def save_tiny(pipe, folder: str | Path, max_sequence_length: int | None = None) -> Path:
    """``folder/pipeline`` saved, with ``flow_testbed.json`` saying to sample at 32 px (the pipelines' own default
    size, 128 latent pixels, would be 512 px here) and, where given, the prompt length to encode with."""
    out = Path(folder) / "pipeline"
    pipe.save_pretrained(out, safe_serialization=True)
    settings = {"resolution": RESOLUTION}
    if max_sequence_length is not None:
        settings["max_sequence_length"] = max_sequence_length
    (out / FLOW_SETTINGS_FILE).write_text(json.dumps(settings))
    return out


def build_tiny_qwen_edit(folder: str | Path, seed: int = 0, pipeline_class=QwenImageEditPipeline) -> Path:
    """Save a tiny random QwenImageEditPipeline (or ``pipeline_class``, which takes the same components) under
    ``folder`` and return its folder (``folder/pipeline``)."""
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer()
    pipe = pipeline_class(transformer=tiny_qwen_transformer(), vae=tiny_qwen_vae(),
                          scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
                          text_encoder=tiny_qwen25_vl(tokenizer), tokenizer=tokenizer, processor=None)
    out = save_tiny(pipe, folder)
    # the processor in the hub layout: Qwen2.5-VL's 14 px patches merged 2x2, images resized to 56-112 px a side
    tokenizer.save_pretrained(out / "processor")
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2,
                             merge_size=2).save_pretrained(out / "processor")
    (out / "processor" / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen2VLProcessor"]},
                                                     indent=2))
    return out


def build_tiny_qwen_edit_plus(folder: str | Path, seed: int = 0) -> Path:
    """Save a tiny random QwenImageEditPlusPipeline (Qwen-Image-Edit-2509/2511's class: the same components as
    QwenImageEditPipeline) under ``folder`` and return its folder (``folder/pipeline``)."""
    return build_tiny_qwen_edit(folder, seed, pipeline_class=QwenImageEditPlusPipeline)


@contextlib.contextmanager
def small_sources():
    """The editing pipelines' source sizes (``calculate_dimensions`` of 1024 * 1024 px, and QwenImageEditPlusPipeline's
    384 * 384 px for its text encoder) scaled down 256 times in area (64 x 64 px, 32 x 32 px), for the pipelines and the
    families (which size sources with the same functions); yields the list of the areas the callers asked for (the
    pipelines' own)."""
    asked, modules = [], (pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus)
    originals = [module.calculate_dimensions for module in modules]

    def scaled(original):
        def calculate_dimensions(target_area, ratio):
            asked.append(target_area)
            return original(target_area // SOURCE_AREA_DIVISOR, ratio)
        return calculate_dimensions

    for module, original in zip(modules, originals):
        module.calculate_dimensions = scaled(original)
    try:
        yield asked
    finally:
        for module, original in zip(modules, originals):
            module.calculate_dimensions = original

"""A tiny Qwen2-VL base folder and an HPSv3 checkpoint in the authors' layout, buildable under transformers 4.45
(the authors' pinned version, for experiments/hpsv3_reference.py) and 5 (the tests) alike.

The base folder is written by hand (config.json in Qwen2-VL's original flat format, which both versions read; a
word-level tokenizer; the image processor's JSON; a chat template in Qwen2-VL's shape with its default system
message). Checkpoint values do not come from either version's random init: every tensor is filled from its own
key (``fill``), so the side environment and the test write the same numbers for the same names.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, PreTrainedTokenizerFast, Qwen2VLForConditionalGeneration

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
WORDS = ["user", "assistant", "system", "You", "are", "a", "helpful", "Please", "provide", "the", "overall", "ratings",
         "of", "this", "image", ":", "END", "red", "cube", "blue", "circle", "two", "cat", "-", "Textual", "prompt"]
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_base(folder) -> None:
    """Qwen2-VL base: config, tokenizer, image processor and chat template (the files HPSv3 takes from its base)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<unk>", *WORDS, *SPECIALS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.save_pretrained(folder)
    ids = {t: vocab[t] for t in SPECIALS}
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "vocab_size": len(vocab),
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim/2
        "tie_word_embeddings": False, "attention_dropout": 0.0, "use_sliding_window": False, "torch_dtype": "float32",
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_config": {"depth": 1, "embed_dim": 16, "hidden_size": 32, "mlp_ratio": 2, "num_heads": 2,
                          "in_channels": 3, "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "hidden_act": "quick_gelu"},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "resample": 3}, indent=1))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))


def fill(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` determined by ``key`` alone: norms near 1, biases and weights small and random."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    noise = torch.randn(shape, generator=gen, dtype=torch.float64)
    if len(shape) == 1 and ("norm" in key or ".ln_q." in key):
        return (1.0 + 0.1 * noise).float()
    fan_in = shape[-1] if len(shape) > 1 else 16
    if len(shape) > 2:  # the patch embedding's Conv3d
        fan_in = int(torch.tensor(shape[1:]).prod())
    return (noise / fan_in ** 0.5).float()


def authors_checkpoint_shapes(base) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the authors' state dict for ``base`` (transformers 5 classes, renamed to 4.45's
    layout), with the vocabulary grown by <|Reward|> and the ranknet reward head."""
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = _vocab_with_reward(base)
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config)
    shapes = {}
    for key, tensor in model.state_dict().items():
        if key.startswith("model.visual."):
            key = key.removeprefix("model.")
        elif key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        shapes[key] = tuple(tensor.shape)
    hidden = config.text_config.hidden_size
    shapes.update({"rm_head.0.weight": (1024, hidden), "rm_head.0.bias": (1024,), "rm_head.3.weight": (16, 1024),
                   "rm_head.3.bias": (16,), "rm_head.5.weight": (2, 16), "rm_head.5.bias": (2,)})
    return shapes


def _vocab_with_reward(base) -> int:
    vocab = json.loads((Path(base) / "tokenizer.json").read_text())["model"]["vocab"]
    return len(vocab) + 1


def write_checkpoint(path, shapes: dict[str, tuple[int, ...]]) -> None:

    save_file({key: fill(key, shape) for key, shape in sorted(shapes.items())}, str(path))


def build_hpsv3(folder) -> tuple[Path, Path]:
    """(base folder, HPSv3.safetensors) for the tests."""
    base = Path(folder) / "base"
    write_base(base)
    checkpoint = Path(folder) / "HPSv3.safetensors"
    write_checkpoint(checkpoint, authors_checkpoint_shapes(base))
    return base, checkpoint


def hpsv3_images():
    """A square image at the authors' size, one smaller and one wider (both resized by smart_resize)."""
    rng = np.random.default_rng(0)
    sizes = [(448, 448), (300, 260), (520, 380)]
    return [Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for w, h in sizes]

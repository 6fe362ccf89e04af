"""HPSv3 (Ma et al., ICCV 2025) on transformers' Qwen2-VL classes, without the authors' package.

The release is one file, ``HPSv3.safetensors`` in the hub repo ``MizzenAI/HPSv3``: the state dict of the
authors' ``Qwen2VLRewardModelBT`` (a ``Qwen2VLForConditionalGeneration`` of transformers 4.45 plus ``rm_head``)
in that version's key layout (``visual.*``, ``model.*``, ``lm_head.*``, ``rm_head.*``), its vocabulary one
token longer than the base tokenizer (``<|Reward|>``). The architecture and the processor come from the base
model, ``Qwen/Qwen2-VL-7B-Instruct``. Keys are mapped onto transformers' ``Qwen2VLModel`` and loaded strictly;
``lm_head`` is not needed for the reward and is left out.

As the authors' code (``hpsv3`` 1.0.0: inference.py, model/qwen2vl_trainer.py, dataset/data_collator_qwen.py):

- each image resized (PIL bicubic) to Qwen's ``smart_resize`` size with min = max = 256*28*28 pixels;
- the user message is the image, then their instruction with the caption and "...ratings of this image:
  <|Reward|>", through the base model's chat template with the generation prompt, right-padded;
- the text model runs on plain 1-D positions (the authors' forward calls it without Qwen2-VL's 3-D rope
  index), and the reward head (Linear 1024, ReLU, Dropout, Linear 16, ReLU, Linear 2, in float32) reads the
  hidden state at ``<|Reward|>``: output (mu, sigma); the score is mu, as the authors use it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch import nn

from rewards.base import Judge
from rewards.checkpoint_keys import check_exact
from rewards.images import Images, num_images, to_pil
from rewards.llava_reward import qwen_fetch_size
from rewards.vlm import load_processor
from rewards.weights import (
    MissingWeightsError,
    batched,
    check_batch_size,
    check_prompts,
    load_state_dict,
    offline_hint,
    resolve_device,
    resolve_dtype,
    resolve_file,
)

HPSV3_REPO = "MizzenAI/HPSv3"
HPSV3_FILE = "HPSv3.safetensors"
HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28  # the authors' min_pixels = max_pixels
FACTOR = 28  # Qwen2-VL: 14 px patches merged 2x2
# The authors' instruction (hpsv3/dataset/data_collator_qwen.py: INSTRUCTION + prompt_with_special_token), kept
# word for word: it is the question the reward head was trained on.
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""  # noqa: W291 - the authors' trailing spaces are part of the text the model saw
REWARD_SUFFIX = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


def hpsv3_text(prompt: str) -> str:
    return INSTRUCTION.format(text_prompt=prompt) + REWARD_SUFFIX


def smart_resize(height: int, width: int, factor: int = FACTOR, min_pixels: int = PIXELS,
                 max_pixels: int = PIXELS) -> tuple[int, int]:
    """Qwen2-VL's target (height, width): sides multiples of ``factor``, area within [min_pixels, max_pixels],
    aspect kept (the same smart_resize as LLaVA-Reward's Qwen2.5-VL)."""
    width, height = qwen_fetch_size(width, height, factor, min_pixels, max_pixels)
    return height, width


def resize_image(image: Image.Image, pixels: int = PIXELS) -> Image.Image:
    height, width = smart_resize(image.height, image.width, FACTOR, pixels, pixels)
    return image.convert("RGB").resize((width, height), Image.BICUBIC)


def reward_head(hidden_size: int) -> nn.Sequential:
    """The authors' "ranknet" head; its indices (0, 3, 5) are the checkpoint's ``rm_head.*`` names."""
    return nn.Sequential(nn.Linear(hidden_size, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))


def split_authors_state(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The authors' (transformers 4.45) keys -> (Qwen2VLModel keys, reward head keys); ``lm_head`` is dropped."""
    backbone, head = {}, {}
    for key, tensor in state.items():
        if key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = tensor
        elif key.startswith("visual."):
            backbone[key] = tensor
        elif key.startswith("model."):
            backbone["language_model." + key.removeprefix("model.")] = tensor
        elif not key.startswith("lm_head."):
            backbone[key] = tensor  # unknown: check_exact names it
    return backbone, head


class HpsV3(Judge):
    """HPSv3's mu (higher is better); ``score_with_uncertainty`` also returns sigma."""

    def __init__(self, model: str | Path = HPSV3_REPO, filename: str = HPSV3_FILE, base: str | Path = HPSV3_BASE,
                 device=None, dtype=None, batch_size: int = 8, pixels: int = PIXELS, tie_margin: float = 0.0):
        from transformers import AutoConfig, Qwen2VLModel

        super().__init__(name="hpsv3", tie_margin=tie_margin)
        self.device = resolve_device(device)
        # bfloat16 on a GPU, as the authors run it (float16 risks Qwen2-VL overflow); float32 on a CPU
        self.dtype = resolve_dtype(dtype if dtype is not None or self.device.type != "cuda" else "bfloat16", self.device)
        self.batch_size = check_batch_size(batch_size)
        self.pixels = int(pixels)
        try:
            config = AutoConfig.from_pretrained(str(base))
            self.processor = load_processor(str(base))
        except (OSError, ValueError) as err:
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise MissingWeightsError(
                f"judge 'hpsv3': cannot load the Qwen2-VL base config and processor from {str(base)!r}: {first_line}"
                f"{offline_hint()}. Pass base=<hub id or local folder of {HPSV3_BASE}>."
            ) from err
        if config.model_type != "qwen2_vl":
            raise ValueError(f"judge 'hpsv3': base {str(base)!r} is a {config.model_type!r} model; HPSv3 needs its "
                             f"Qwen2-VL base ({HPSV3_BASE})")
        tokenizer = self.processor.tokenizer
        tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})  # as the authors do at load
        tokenizer.padding_side = "right"
        self.reward_id = tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        backbone_state, head_state = split_authors_state(load_state_dict(resolve_file(model, filename, "hpsv3"), "hpsv3"))
        rows = backbone_state.get("language_model.embed_tokens.weight", torch.empty(0)).shape[0]
        if rows != len(tokenizer):
            raise ValueError(f"judge 'hpsv3': the checkpoint's vocabulary has {rows} rows but the base tokenizer plus "
                             f"{REWARD_TOKEN} has {len(tokenizer)}; is base={str(base)!r} the model HPSv3 was trained from?")
        config.text_config.vocab_size = rows
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in Qwen2VLModel(config).state_dict().items()}
        check_exact(backbone_state, expected, f"HPSv3 checkpoint {filename}")
        self.backbone = Qwen2VLModel.from_pretrained(None, config=config, state_dict=backbone_state, dtype=self.dtype)
        self.backbone.to(self.device).eval()
        self.head = reward_head(config.text_config.hidden_size)
        check_exact(head_state, {k: tuple(v.shape) for k, v in self.head.state_dict().items()},
                    f"HPSv3 checkpoint {filename}'s rm_head")
        self.head.load_state_dict(head_state, strict=True)
        self.head.to(self.device).eval()  # float32, as the authors keep it
        self.last_sigma: torch.Tensor | None = None

    def _texts(self, prompts: list[str]) -> list[str]:
        messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": hpsv3_text(p)}]}]
                    for p in prompts]
        return [self.processor.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]

    @torch.no_grad()
    def _forward(self, prompts: list[str], images: list[Image.Image]) -> torch.Tensor:
        inputs = self.processor(text=self._texts(prompts), images=[resize_image(img, self.pixels) for img in images],
                                padding=True, return_tensors="pt").to(self.device)
        ids = inputs["input_ids"]
        found = (ids == self.reward_id).sum(dim=1)
        if not bool((found == 1).all()):
            raise RuntimeError(f"judge 'hpsv3': expected one {REWARD_TOKEN} per question, found {found.tolist()}")
        batch, length = ids.shape
        # 1-D positions for the three rope sections: the authors' forward skips Qwen2-VL's 3-D rope index
        positions = torch.arange(length, device=self.device).view(1, 1, length).expand(3, batch, length)
        hidden = self.backbone(input_ids=ids, attention_mask=inputs["attention_mask"],
                               pixel_values=inputs["pixel_values"].to(self.dtype),
                               image_grid_thw=inputs["image_grid_thw"], position_ids=positions).last_hidden_state
        return self.head(hidden[ids == self.reward_id].float()).cpu()

    def score_with_uncertainty(self, prompts: list[str], images: Images) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, sigma) per image: the authors' reward and its uncertainty."""
        prompts = check_prompts(prompts, num_images(images), self.name)
        pil = to_pil(images)
        outputs = [self._forward(list(p), list(i)) for p, i in
                   zip(batched(prompts, self.batch_size), batched(pil, self.batch_size))]
        out = torch.cat(outputs) if outputs else torch.empty(0, 2)
        return out[:, 0], out[:, 1]

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        mu, sigma = self.score_with_uncertainty(prompts, images)
        self.last_sigma = sigma
        return mu

    def __repr__(self) -> str:
        return f"HpsV3(name={self.name!r}, pixels={self.pixels}, tie_margin={self.tie_margin})"

"""Local VLM judges through transformers (MJ-Bench's open models), same protocol as the API judges.

    llava-1.5-7b    llava-hf/llava-1.5-7b-hf               one image per question
    llava-1.6-7b    llava-hf/llava-v1.6-mistral-7b-hf      multi-image
    idefics2-8b     HuggingFaceM4/idefics2-8b              multi-image
    instructblip    Salesforce/instructblip-vicuna-7b      one image, no chat template
    qwen2.5-vl-7b   Qwen/Qwen2.5-VL-7B-Instruct            multi-image
    internvl        OpenGVLab/InternVL3-8B-hf              multi-image (transformers-native InternVL)
    hf-vlm:<id>     any AutoModelForImageTextToText checkpoint (hub id or local folder)

Prompts go through the processor's own chat template (images as ``{"type": "image"}`` entries);
generation is greedy at temperature 0. Default mode: ``likert`` (MJ-Bench found open VLMs more
accurate with Likert scales). ``mode="pair"`` needs a model that takes several images. A local VLM
can also run behind vLLM's OpenAI-compatible server and be loaded as ``openai:<model>``.
Without torchvision the processors use their PIL image processors and leave out video processors
(see ``load_processor``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
from transformers.utils import is_torchvision_available

from rewards.cache import CachedAnswer
from rewards.mllm import JudgeNotReadyError, JudgeRequest, MllmJudge

DEFAULT_IDS = {
    "llava-1.5-7b": "llava-hf/llava-1.5-7b-hf",
    "llava-1.6-7b": "llava-hf/llava-v1.6-mistral-7b-hf",
    "idefics2-8b": "HuggingFaceM4/idefics2-8b",
    "instructblip": "Salesforce/instructblip-vicuna-7b",
    "qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
    "internvl": "OpenGVLab/InternVL3-8B-hf",
}
# config.model_type of models trained to look at several images in one conversation.
MULTI_IMAGE_TYPES = {"llava_next", "idefics2", "idefics3", "qwen2_vl", "qwen2_5_vl", "internvl", "llava_onevision"}
DTYPES = {"auto": "auto", "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _pick_device(device: str) -> str:
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_processor(model: str, trust_remote_code: bool = False):
    """The checkpoint's processor; without torchvision, the same processor class minus its video processor.

    transformers builds video processors (Qwen2-VL / 2.5-VL, InternVL, LLaVA-OneVision...) only with
    torchvision, so ``AutoProcessor`` fails for those models even when only images are needed. Image
    processors fall back to their PIL implementation by themselves (``backend="pil"``).
    """
    try:
        return AutoProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (ImportError, ValueError) as err:  # ImportError (Qwen2-VL) or ValueError (InternVL) naming torchvision
        if is_torchvision_available() or "torchvision" not in str(err).lower():
            raise
        processor_class = _processor_with_video(model, trust_remote_code)
        if processor_class is None:
            raise
    return _without_video(processor_class).from_pretrained(model)


def _processor_with_video(model: str, trust_remote_code: bool) -> type | None:
    """The processor class transformers maps the checkpoint's config to, if that class holds a video processor."""
    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    processor_class = PROCESSOR_MAPPING.get(type(config), None)
    if processor_class is None or "video_processor" not in processor_class.get_attributes():
        return None
    return processor_class


def _without_video(processor_class: type) -> type:
    """A subclass whose sub-processors leave out the video processor: not loaded, not type-checked, not called.

    ``ProcessorMixin`` takes its sub-processors from ``get_attributes()`` and pairs them with the positional
    arguments in order, so the ``video_processor=None`` that the class hands on after the image processor and
    the tokenizer is dropped; the other options (``image_seq_length``...) still come from the checkpoint.
    """
    attributes = [name for name in processor_class.get_attributes() if name != "video_processor"]
    return type(processor_class.__name__, (processor_class,),
                {"get_attributes": classmethod(lambda cls: list(attributes)), "__module__": __name__})


@dataclass
class HfVlmJudge(MllmJudge):
    """A transformers image-text-to-text model as a judge (model: hub id or local folder)."""

    mode: str = "likert"
    device: str = "auto"
    dtype: str = "auto"
    batch_size: int = 4
    trust_remote_code: bool = False
    max_tokens: int = 256
    _model: object = field(default=None, init=False, repr=False)
    _processor: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not self.model:
            raise ValueError(f"judge {self.name!r} needs a model (hub id or local folder)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; valid: {', '.join(DTYPES)}")
        if int(self.batch_size) < 1:
            raise ValueError(f"batch_size={self.batch_size!r}: must be at least 1")
        super().__post_init__()
        self._load()
        if self.mode == "pair" and not self.multi_image:
            raise ValueError(
                f"judge {self.name!r} ({self.model_type}) takes one image per question, so mode='pair' is not "
                f"available; use mode='single' or mode='likert' (multi-image types: {', '.join(sorted(MULTI_IMAGE_TYPES))})"
            )

    def _load(self) -> None:

        try:
            self._processor = load_processor(self.model, self.trust_remote_code)
            self._model = AutoModelForImageTextToText.from_pretrained(
                self.model, dtype=DTYPES[self.dtype], trust_remote_code=self.trust_remote_code
            )
        except OSError as err:  # one line: the hub's messages run over several
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise JudgeNotReadyError(f"cannot load VLM judge {self.model!r}: {first_line}") from err
        self._model.to(_pick_device(self.device)).eval()
        tokenizer = getattr(self._processor, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.padding_side = "left"  # batched generation continues every row from its end
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token

    @property
    def model_type(self) -> str:
        return self._model.config.model_type

    @property
    def multi_image(self) -> bool:
        return self.model_type in MULTI_IMAGE_TYPES

    @property
    def judge_id(self) -> str:
        return f"hf:{self.model}"

    def check_ready(self) -> None:
        """The weights are loaded in the constructor; nothing more to check."""

    def _chat_text(self, req: JudgeRequest) -> str:
        if getattr(self._processor, "chat_template", None) is None:
            return req.prompt  # e.g. InstructBLIP: the Q-Former takes the instruction as it is
        content: list[dict] = []
        for i in range(len(req.images)):
            if len(req.images) > 1:
                content.append({"type": "text", "text": f"IMAGE-{i + 1}:"})
            content.append({"type": "image"})
        content.append({"type": "text", "text": req.prompt})
        messages = [{"role": "user", "content": content}]
        return self._processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    @torch.no_grad()
    def _generate_batch(self, batch: list[JudgeRequest]) -> list[str]:
        texts = [self._chat_text(req) for req in batch]
        images = [list(req.images) for req in batch] if self.multi_image else [req.images[0] for req in batch]
        inputs = self._processor(images=images, text=texts, return_tensors="pt", padding=True)
        inputs = inputs.to(self._model.device)
        for key, value in inputs.items():  # pixel values follow the model's dtype
            if torch.is_floating_point(value):
                inputs[key] = value.to(self._model.dtype)
        greedy = not self.temperature
        sampling = {} if greedy else {"temperature": float(self.temperature)}
        output = self._model.generate(**inputs, max_new_tokens=int(self.max_tokens), do_sample=not greedy, **sampling)
        prompt_len = inputs["input_ids"].shape[1]
        # decoder-only models return prompt + answer; encoder-style ones (InstructBLIP) may return the answer only
        if output.shape[1] > prompt_len and torch.equal(output[:, :prompt_len].cpu(), inputs["input_ids"].cpu()):
            output = output[:, prompt_len:]
        return self._processor.batch_decode(output, skip_special_tokens=True)

    def _generate(self, requests, on_answer):
        size = int(self.batch_size)
        for start in range(0, len(requests), size):
            batch = requests[start:start + size]
            for offset, text in enumerate(self._generate_batch(batch)):
                self.stats.add(requests=1)
                on_answer(start + offset, CachedAnswer(text.strip()))

    def close(self) -> None:
        super().close()
        self._model = None


def hf_vlm(model: str, **options) -> HfVlmJudge:
    options.setdefault("name", f"hf-vlm:{model}")
    return HfVlmJudge(model=model, **options)


def _preset(name: str, options: dict) -> HfVlmJudge:
    options.setdefault("model", DEFAULT_IDS[name])
    options.setdefault("name", name)
    return HfVlmJudge(**options)


def llava_15_7b(**options) -> HfVlmJudge:
    return _preset("llava-1.5-7b", options)


def llava_16_7b(**options) -> HfVlmJudge:
    return _preset("llava-1.6-7b", options)


def idefics2_8b(**options) -> HfVlmJudge:
    return _preset("idefics2-8b", options)


def instructblip(**options) -> HfVlmJudge:
    return _preset("instructblip", options)


def qwen25_vl_7b(**options) -> HfVlmJudge:
    return _preset("qwen2.5-vl-7b", options)


def internvl(**options) -> HfVlmJudge:
    return _preset("internvl", options)

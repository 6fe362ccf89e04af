"""VQAScore judges (Lin et al. 2024): the score is P("Yes") to 'Does this figure show "{caption}"? ...'.

    vqascore-qwen2.5-vl-7b      Qwen/Qwen2.5-VL-7B-Instruct under transformers (t2v_metrics's qwen2.5-vl-7b)
    vqascore-llava-1.5-7b       llava-hf/llava-1.5-7b-hf under transformers
    vqascore-internvl           OpenGVLab/InternVL3-8B-hf under transformers
    vqascore-hf:<id>            any AutoModelForImageTextToText checkpoint (hub id or local folder)
    vqascore-openai:<model>     an OpenAI-compatible server that returns token logprobs (vLLM, SGLang, OpenAI):
                                base_url=http://host:port/v1; a server without a known price is free
                                (rewards.vqascore_server: the OpenAI SDK is needed only there)

The probability rules are the authors' (rewards.vqascore_rules, checked against t2v_metrics in the tests).
Both judges run on the MLLM judge machinery: answers (the probability and the top tokens) go to the SQLite
cache, the server judge has the API judges' concurrency, retries, rate limit and cost guard.
Scores are in [0, 1]; ``compare`` is the score difference (pointwise judges).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rewards.judge_prompts import JudgeQuestion
from rewards.mllm import JudgeNotReadyError
from rewards.parsing import OK, UNPARSEABLE, Parsed
from rewards.vlm import HfVlmJudge
from rewards.vqascore_rules import (
    ANSWER,
    QUESTION_TEMPLATE,
    InvalidLogprobError,
    probability_from_raw,
    raw_from_probability,
    softmax_answer_probability,
)

PRESETS = {
    "vqascore-qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
    "vqascore-llava-1.5-7b": "llava-hf/llava-1.5-7b-hf",
    "vqascore-internvl": "OpenGVLab/InternVL3-8B-hf",
}
AUDIT_TOP = 5  # top tokens kept beside a local model's probability (what else it would have said)


def _template_question(template: str, prompt_template: str | None = None) -> JudgeQuestion:
    """The judge's question; a benchmark's --protocol does not change it, a prompt_template file is refused."""
    if prompt_template:
        raise ValueError("VQAScore asks its authors' question: pass question_template=... (with {caption}), "
                         "not prompt_template=")
    if "{caption}" not in template:
        raise ValueError(f"question_template {template!r} has no {{caption}} field")
    return JudgeQuestion("single", template=template)


def _parse_probability(raw: str | None, answer: str) -> Parsed:
    try:
        p = probability_from_raw(raw or "", answer)
    except InvalidLogprobError as err:  # numbers where the answer goes, but not log-probabilities
        return Parsed(UNPARSEABLE, reason=str(err), invalid=True)
    except (ValueError, TypeError, KeyError):
        return Parsed(UNPARSEABLE, reason="not a VQAScore answer (probability or top logprobs)")
    if not (0.0 <= p <= 1.0) or math.isnan(p):
        return Parsed(UNPARSEABLE, reason=f"probability {p!r} outside [0, 1]", invalid=True)
    return Parsed(OK, p)


class VqaScoreQuestion:
    """What the local and the server VQAScore judge share: the authors' question (a benchmark's --protocol does
    not change it) and the probability parsed from the recorded answer."""

    judges_edits = False  # the authors' question is about a generated image, not an edit of a source

    def use_protocol(self, protocol: str = "project", prompt_template: str | None = None) -> None:
        self.question = _template_question(self.question_template, prompt_template)
        self.protocol, self.prompt_template = "project", None

    def parse(self, raw: str | None) -> Parsed:
        return _parse_probability(raw, self.answer)


@dataclass
class HfVqaScore(VqaScoreQuestion, HfVlmJudge):
    """P(answer) from a local transformers VLM: full-vocab softmax at the first answer position."""

    question_template: str = QUESTION_TEMPLATE
    answer: str = ANSWER
    mode: str = "single"
    batch_size: int = 1  # the authors score one image at a time; larger batches pad (float noise ~1e-7)

    def __post_init__(self):
        if self.protocol != "project":
            raise ValueError(f"judge {self.name!r} asks VQAScore's question; protocol={self.protocol!r} does not apply")
        if self.mode != "single":
            raise ValueError(f"judge {self.name!r} scores one image at a time (mode='single'), not {self.mode!r}")
        super().__post_init__()
        self._answer_ids = self._processor.tokenizer.encode(self.answer, add_special_tokens=False)
        if not self._answer_ids:
            raise ValueError(f"answer {self.answer!r} encodes to no token with this tokenizer")

    @property
    def judge_id(self) -> str:
        return f"vqascore-hf:{self.model}"

    def decoding(self) -> dict:
        return {"rule": "softmax-first-tokens", "answer": self.answer}


    @torch.no_grad()
    def _generate_batch(self, batch) -> list[str]:
        texts = [self._chat_text(req) for req in batch]
        images = [req.images[0] for req in batch]
        inputs = self._processor(images=images, text=texts, return_tensors="pt", padding=True).to(self._model.device)
        for key, value in inputs.items():
            if torch.is_floating_point(value):
                inputs[key] = value.to(self._model.dtype)
        n = len(self._answer_ids)
        # generate (not a bare forward) so that the checkpoint's logits processors apply, as in t2v_metrics
        out = self._model.generate(**inputs, max_new_tokens=n, do_sample=False, temperature=1.0,
                                   output_scores=True, return_dict_in_generate=True)
        raws = []
        for row in range(len(batch)):
            scores = [step[row].float().cpu() for step in out.scores[:n]]
            p = softmax_answer_probability(scores, self._answer_ids)
            log_p = torch.log_softmax(scores[0].double(), dim=-1)
            top = torch.topk(log_p, min(AUDIT_TOP, log_p.numel()))
            tokens = self._processor.tokenizer.convert_ids_to_tokens(top.indices.tolist())
            raws.append(raw_from_probability(p, list(zip(tokens, top.values.tolist()))))
        return raws


def vqascore_hf(model: str, **options) -> HfVqaScore:
    options.setdefault("name", f"vqascore-hf:{model}")
    return HfVqaScore(model=model, **options)


def _preset(name: str, options: dict) -> HfVqaScore:
    options.setdefault("model", PRESETS[name])
    options.setdefault("name", name)
    return HfVqaScore(**options)


def qwen25_vl_7b(**options) -> HfVqaScore:
    return _preset("vqascore-qwen2.5-vl-7b", options)


def llava_15_7b(**options) -> HfVqaScore:
    return _preset("vqascore-llava-1.5-7b", options)


def internvl(**options) -> HfVqaScore:
    return _preset("vqascore-internvl", options)


__all__ = ["HfVqaScore", "JudgeNotReadyError"]

"""UnifiedReward judges (Wang et al. 2025): Qwen2.5-VL fine-tunes that rate one image or compare two.

    unifiedreward                   CodeGoat24/UnifiedReward-qwen-7b under transformers
    unifiedreward-hf:<id>           another UnifiedReward checkpoint (hub id or local folder)
    unifiedreward-openai:<model>    the model behind an OpenAI-compatible server (vLLM, SGLang; base_url=...)

``mode="single"`` (default): the authors' pointwise question, score = the number after 'Final Score:' (1-5).
``mode="pair"``: the authors' pairwise question, asked in both orders and reconciled like every pairwise MLLM
judge (``swap_orders``, ``inconsistent``, ``one_order``); "Both images are equally good" is a tie, an answer with
no verdict an abstention. Questions and parsing: rewards.unifiedreward_rules. Answers go to the judge cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from rewards.judge_prompts import JudgeQuestion
from rewards.parsing import OK, UNPARSEABLE, Parsed
from rewards.unifiedreward_rules import PAIR_TEMPLATE, POINT_TEMPLATE, pair_verdict, point_score
from rewards.vlm import HfVlmJudge

DEFAULT_ID = "CodeGoat24/UnifiedReward-qwen-7b"
MODES = ("single", "pair")


def _question(mode: str, prompt_template: str | None = None) -> JudgeQuestion:
    """The authors' question for ``mode``; a benchmark's --protocol does not change it, a template file is refused."""
    if prompt_template:
        raise ValueError("UnifiedReward asks its authors' questions (the model was trained on them); "
                         "prompt_template= does not apply")
    if mode not in MODES:
        raise ValueError(f"UnifiedReward mode={mode!r}; valid: {', '.join(MODES)} (the authors' pointwise or pairwise question)")
    return JudgeQuestion(mode, template=POINT_TEMPLATE if mode == "single" else PAIR_TEMPLATE)


def _refuse_protocol(judge) -> None:
    if judge.protocol != "project":
        raise ValueError(f"judge {judge.name!r} asks UnifiedReward's own questions; protocol={judge.protocol!r} does not apply")


def parse_unifiedreward(raw: str | None, mode: str) -> Parsed:
    """Parsed(ok, score) or Parsed(ok, {"better": 1|2|0}), or an abstention saying what was missing."""
    text = raw or ""
    if mode == "single":
        score = point_score(text)
        if score is None:
            return Parsed(UNPARSEABLE, reason="no number after 'Final Score:'")
        return Parsed(OK, float(score))
    better = pair_verdict(text)
    if better is None:
        return Parsed(UNPARSEABLE, reason="no single verdict ('Image 1 is better', 'Image 2 is better', "
                                          "'Both images are equally good')")
    return Parsed(OK, {"better": better})


class UnifiedRewardQuestion:
    """What the local and the server UnifiedReward judge share: the authors' question for the mode (a benchmark's
    --protocol does not change it) and their answer parsing."""

    judges_edits = False  # the authors' question is about a generated image, not an edit of a source

    def use_protocol(self, protocol: str = "project", prompt_template: str | None = None) -> None:
        self.question = _question(self.mode, prompt_template)
        self.protocol, self.prompt_template = "project", None

    def parse(self, raw: str | None) -> Parsed:
        return parse_unifiedreward(raw, self.mode)


@dataclass
class HfUnifiedReward(UnifiedRewardQuestion, HfVlmJudge):
    """UnifiedReward under transformers: images first, then the authors' question; greedy decoding."""

    mode: str = "single"
    max_tokens: int = 512  # the authors' max_new_tokens
    batch_size: int = 1

    def __post_init__(self):
        _refuse_protocol(self)
        super().__post_init__()

    @property
    def judge_id(self) -> str:
        return f"unifiedreward-hf:{self.model}"


    def _chat_text(self, req) -> str:
        content = [{"type": "image"} for _ in req.images] + [{"type": "text", "text": req.prompt}]
        return self._processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                   tokenize=False)


def unifiedreward(**options) -> HfUnifiedReward:
    options.setdefault("model", DEFAULT_ID)
    options.setdefault("name", "unifiedreward")
    return HfUnifiedReward(**options)


def unifiedreward_hf(model: str, **options) -> HfUnifiedReward:
    options.setdefault("name", f"unifiedreward-hf:{model}")
    return HfUnifiedReward(model=model, **options)

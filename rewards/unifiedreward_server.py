"""UnifiedReward behind an OpenAI-compatible server (vLLM, SGLang), with the authors' message layout (images
first) and answer parsing (rewards.unifiedreward_rules); kept apart from rewards.unifiedreward so that the local
judge needs no OpenAI SDK."""

from __future__ import annotations

from dataclasses import dataclass

from rewards.api import ApiJudge
from rewards.api_openai import OpenAIBackend
from rewards.unifiedreward import UnifiedRewardQuestion, _refuse_protocol


class ImagesFirstBackend(OpenAIBackend):
    """UnifiedReward's server message: the images, then the question (the authors' vllm_request.py)."""

    def message_content(self, prompt: str, images_b64: list[str]) -> list[dict]:
        images = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}} for data in images_b64]
        return images + [{"type": "text", "text": prompt}]


@dataclass
class ApiUnifiedReward(UnifiedRewardQuestion, ApiJudge):
    """UnifiedReward behind an OpenAI-compatible server; free text answers (no JSON schema)."""

    mode: str = "single"
    structured: str | None = "none"
    max_tokens: int = 4096  # the authors' server requests

    def __post_init__(self):
        _refuse_protocol(self)
        if self.provider != "openai":
            raise ValueError(f"judge {self.name!r} needs an OpenAI-compatible server, not provider {self.provider!r}")
        super().__post_init__()
        self._backend = ImagesFirstBackend(model=self.model, base_url=self.base_url, timeout=float(self.timeout),
                                           key_envs=self.key_envs)

    @property
    def judge_id(self) -> str:
        return f"unifiedreward-openai:{self.model}"



def unifiedreward_openai(model: str, **options) -> ApiUnifiedReward:
    options.setdefault("name", f"unifiedreward-openai:{model}")
    return ApiUnifiedReward(provider="openai", model=model, **options)

"""VQAScore from an OpenAI-compatible server's first-token top logprobs (vLLM, SGLang, OpenAI): the authors'
API rule (rewards.vqascore_rules), on the API judges' cache, concurrency, retries and cost guard. Kept apart from
rewards.vqascore so that the local judges need no OpenAI SDK."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import openai
from openai.types.chat import ChatCompletion
from PIL import Image

from rewards.api import ApiJudge
from rewards.api_openai import OpenAIBackend, map_error
from rewards.cache import CachedAnswer
from rewards.concurrency import FatalCallError, RetryableError, run_sync
from rewards.images import encode_png
from rewards.mllm import JudgeNotReadyError
from rewards.vqascore import VqaScoreQuestion
from rewards.vqascore_rules import (
    ANSWER,
    QUESTION_TEMPLATE,
    InvalidLogprobError,
    check_logprobs,
    raw_from_top_logprobs,
)


class OpenAILogprobsBackend(OpenAIBackend):
    """Chat completions with ``logprobs``: the first answer token's top logprobs are the answer."""

    def __init__(self, *args, top_logprobs: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.top_logprobs = top_logprobs

    async def complete(self, client, prompt, images_b64, question, *, temperature, max_tokens, structured):
        content: list[dict] = [{"type": "text", "text": prompt}]  # text then image, as t2v_metrics sends it
        content += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}} for data in images_b64]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "logprobs": True, "top_logprobs": self.top_logprobs}
        if temperature is not None:
            body["temperature"] = temperature
        try:
            response = await client.post("/chat/completions", cast_to=ChatCompletion, body=body)
        except (openai.APIError, ValueError) as err:
            raise map_error(err) from err
        try:
            choice = response.choices[0]
        except (AttributeError, TypeError, IndexError) as err:
            raise RetryableError(f"malformed response body: {type(err).__name__}") from err
        content_lp = getattr(getattr(choice, "logprobs", None), "content", None)
        if not content_lp:
            where = self.base_url or "api.openai.com"
            raise FatalCallError(f"the server at {where} returned no token logprobs for {self.model!r}; VQAScore needs "
                                 "a server that returns them (vLLM, SGLang: logprobs=True, top_logprobs)", abort_run=True)
        top = [(t.token, float(t.logprob)) for t in (content_lp[0].top_logprobs or [])]
        usage = response.usage
        return CachedAnswer(raw_from_top_logprobs(top), input_tokens=getattr(usage, "prompt_tokens", 0) or 0,
                            output_tokens=getattr(usage, "completion_tokens", 0) or 0)


@dataclass
class ApiVqaScore(VqaScoreQuestion, ApiJudge):
    """P(answer) from an OpenAI-compatible server's first-token top logprobs (the authors' API rule)."""

    question_template: str = QUESTION_TEMPLATE
    answer: str = ANSWER
    top_logprobs: int = 2  # t2v_metrics's default; vLLM allows up to 20 unless started with more
    mode: str = "single"
    structured: str | None = "none"
    max_tokens: int = 1
    temperature: float | None = None  # not sent, as t2v_metrics's request

    def __post_init__(self):
        if self.protocol != "project":
            raise ValueError(f"judge {self.name!r} asks VQAScore's question; protocol={self.protocol!r} does not apply")
        if self.mode != "single":
            raise ValueError(f"judge {self.name!r} scores one image at a time (mode='single'), not {self.mode!r}")
        if not 1 <= int(self.top_logprobs) <= 20:
            raise ValueError(f"top_logprobs={self.top_logprobs!r}: 1 to 20 (the OpenAI API's limit)")
        if self.provider != "openai":
            raise ValueError(f"judge {self.name!r} needs an OpenAI-compatible server, not provider {self.provider!r}")
        super().__post_init__()
        self._backend = OpenAILogprobsBackend(model=self.model, base_url=self.base_url, timeout=float(self.timeout),
                                              key_envs=self.key_envs, top_logprobs=int(self.top_logprobs))

    @property
    def judge_id(self) -> str:
        return f"vqascore-openai:{self.model}"

    def decoding(self) -> dict:
        return {**super().decoding(), "rule": "top-logprobs", "top_logprobs": int(self.top_logprobs)}

    def check_ready(self) -> None:
        """Key and model id (ApiJudge's check), then one question about a small grey image: the server must answer
        with token logprobs that are log-probabilities, or VQAScore has nothing to score with. Asked before any image
        is generated (one short call: one answer token)."""
        super().check_ready()
        grey = Image.new("RGB", (16, 16), (128, 128, 128))
        prompt = self._request("a grey square", [grey]).prompt
        probe = base64.b64encode(encode_png(grey)).decode("ascii")
        decoding = self.decoding()
        backend = self._backend

        async def ask():
            client = backend.async_client()
            try:
                return await backend.complete(client, prompt, [probe],
                                              self.question, temperature=decoding["temperature"],
                                              max_tokens=decoding["max_tokens"], structured=self.structured)
            finally:
                await backend.aclose(client)

        try:
            answer = run_sync(ask)
            check_logprobs([(t, float(lp)) for t, lp in json.loads(answer.raw)["top_logprobs"]])
        except (FatalCallError, RetryableError, InvalidLogprobError) as err:
            raise JudgeNotReadyError(f"judge {self.name!r} ({self.judge_id}): {err}") from None



def vqascore_openai(model: str, **options) -> ApiVqaScore:
    options.setdefault("name", f"vqascore-openai:{model}")
    return ApiVqaScore(provider="openai", model=model, **options)

"""Anthropic Messages API backend for ApiJudge.

Structured output: "tool" (default: a forced tool call, which every Claude model supports) or
"json_schema" (``output_config.format``, newer models). The installed SDK's ``messages.create`` no
longer has a ``temperature`` argument, so it is sent in ``extra_body`` (temperature=None sends none).
"""

from __future__ import annotations

import json
import os

import anthropic

from rewards.cache import CachedAnswer
from rewards.concurrency import FatalCallError, RetryableError, status_error
from rewards.judge_prompts import JudgeQuestion, json_schema
from rewards.mllm import JudgeNotReadyError
from rewards.parsing import REFUSAL_MARKER

TOOL_NAME = "record_judgement"


def map_error(err: Exception) -> Exception:
    if isinstance(err, anthropic.APIStatusError):
        return status_error(err.status_code, str(getattr(err, "message", err))[:300], err.response.headers)
    if isinstance(err, anthropic.APITimeoutError):
        return RetryableError("request timed out")
    if isinstance(err, anthropic.APIConnectionError):
        return RetryableError(f"connection error: {err}")
    if isinstance(err, (anthropic.APIResponseValidationError, ValueError)):
        return RetryableError(f"malformed response body: {type(err).__name__}: {str(err)[:200]}")
    return FatalCallError(f"{type(err).__name__}: {err}")


class AnthropicBackend:
    default_structured = "tool"
    structured_modes = ("tool", "json_schema", "none")

    def __init__(self, model: str, base_url: str | None, timeout: float, key_envs: tuple[str, ...]):
        self.model, self.base_url, self.timeout, self.key_envs = model, base_url, timeout, key_envs

    def _client_kwargs(self) -> dict:
        key = next((os.environ[v] for v in self.key_envs if os.environ.get(v)), None)
        return dict(api_key=key, base_url=self.base_url, timeout=self.timeout, max_retries=0)

    def async_client(self):
        return anthropic.AsyncAnthropic(**self._client_kwargs())

    async def aclose(self, client) -> None:
        await client.close()

    def check_model(self) -> None:
        where = self.base_url or "api.anthropic.com"
        with anthropic.Anthropic(**self._client_kwargs()) as client:
            try:
                client.models.retrieve(self.model)
            except anthropic.AuthenticationError as err:
                raise JudgeNotReadyError(f"the server at {where} rejected the API key") from err
            except anthropic.NotFoundError as err:
                raise JudgeNotReadyError(
                    f"the server at {where} does not know model {self.model!r}; pass a valid id with model=..."
                ) from err
            except anthropic.APIStatusError as err:
                raise JudgeNotReadyError(f"model check for {self.model!r} at {where} failed: HTTP {err.status_code}") from err
            except anthropic.APIConnectionError as err:
                raise JudgeNotReadyError(f"cannot reach the Anthropic server at {where}: {err}") from err

    async def complete(self, client, prompt: str, images_b64: list[str], question: JudgeQuestion, *,
                       temperature: float | None, max_tokens: int, structured: str) -> CachedAnswer:
        content: list[dict] = [{"type": "text", "text": prompt}]
        for i, data in enumerate(images_b64):
            if len(images_b64) > 1:
                content.append({"type": "text", "text": f"IMAGE-{i + 1}:"})
            content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}})
        kwargs: dict = {} if temperature is None else {"extra_body": {"temperature": temperature}}
        if structured == "json_schema":
            kwargs["output_config"] = {"format": {"type": "json_schema", "schema": json_schema(question)}}
        if structured == "tool":
            kwargs["tools"] = [{
                "name": TOOL_NAME,
                "description": "Record the judgement of the image(s) in the requested fields.",
                "input_schema": json_schema(question),
            }]
            kwargs["tool_choice"] = {"type": "tool", "name": TOOL_NAME}
        try:
            response = await client.messages.create(
                model=self.model,
                max_tokens=max_tokens,
                messages=[{"role": "user", "content": content}],
                **kwargs,
            )
        except (anthropic.APIError, ValueError) as err:  # HTTP errors, timeouts, undecodable JSON
            raise map_error(err) from err
        try:
            blocks = list(response.content)
            usage = response.usage
            stop_reason = response.stop_reason
        except (AttributeError, TypeError) as err:
            raise RetryableError(f"malformed response body: {type(err).__name__}") from err
        tokens = dict(input_tokens=getattr(usage, "input_tokens", 0) or 0,
                      output_tokens=getattr(usage, "output_tokens", 0) or 0)
        texts = [b.text for b in blocks if getattr(b, "type", None) == "text"]
        if stop_reason == "refusal":
            return CachedAnswer(f"{REFUSAL_MARKER} {' '.join(texts)}".strip(), **tokens)
        for block in blocks:
            if getattr(block, "type", None) == "tool_use":
                return CachedAnswer(json.dumps(block.input), **tokens)
        if not texts:
            raise RetryableError("malformed response body: no text or tool_use block")
        return CachedAnswer("\n".join(texts), **tokens)

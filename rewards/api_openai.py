"""OpenAI (and OpenAI-compatible: vLLM, SGLang, ...) chat completions backend for ApiJudge."""

from __future__ import annotations

import os

import openai
from openai.types.chat import ChatCompletion

from rewards.cache import CachedAnswer
from rewards.concurrency import FatalCallError, RetryableError, status_error
from rewards.judge_prompts import JudgeQuestion, json_schema
from rewards.mllm import JudgeNotReadyError
from rewards.parsing import REFUSAL_MARKER


def _image_labels(n: int) -> list[str | None]:
    return [f"IMAGE-{i + 1}:" for i in range(n)] if n > 1 else [None]


def map_error(err: Exception) -> Exception:
    """SDK exception -> RetryableError / FatalCallError."""
    if isinstance(err, openai.APIStatusError):
        return status_error(err.status_code, _short(err), err.response.headers)
    if isinstance(err, openai.APITimeoutError):
        return RetryableError("request timed out")
    if isinstance(err, openai.APIConnectionError):
        return RetryableError(f"connection error: {err}")
    if isinstance(err, (openai.APIResponseValidationError, ValueError)):
        return RetryableError(f"malformed response body: {type(err).__name__}: {str(err)[:200]}")
    return FatalCallError(f"{type(err).__name__}: {err}")


def _short(err: Exception) -> str:
    return str(getattr(err, "message", err))[:300]


class OpenAIBackend:
    default_structured = "json_schema"
    structured_modes = ("json_schema", "json_object", "none")

    def __init__(self, model: str, base_url: str | None, timeout: float, key_envs: tuple[str, ...]):
        self.model, self.base_url, self.timeout, self.key_envs = model, base_url, timeout, key_envs

    def _client_kwargs(self) -> dict:
        key = next((os.environ[v] for v in self.key_envs if os.environ.get(v)), None)
        # A keyless local server (vLLM) still needs a non-empty string for the SDK.
        return dict(api_key=key or "not-needed", base_url=self.base_url, timeout=self.timeout, max_retries=0)

    def async_client(self):
        return openai.AsyncOpenAI(**self._client_kwargs())

    async def aclose(self, client) -> None:
        await client.close()

    def check_model(self) -> None:
        where = self.base_url or "api.openai.com"
        with openai.OpenAI(**self._client_kwargs()) as client:
            try:
                try:
                    client.models.retrieve(self.model)
                    return
                except openai.NotFoundError:
                    # Some OpenAI-compatible servers (vLLM) only list models: look the id up there.
                    served = [m.id for m in client.models.list()]
            except openai.AuthenticationError as err:
                raise JudgeNotReadyError(f"the server at {where} rejected the API key ({_short(err)})") from err
            except openai.NotFoundError:
                served = []
            except openai.APIStatusError as err:
                raise JudgeNotReadyError(f"model check for {self.model!r} at {where} failed: "
                                         f"HTTP {err.status_code} {_short(err)}") from err
            except openai.APIConnectionError as err:
                raise JudgeNotReadyError(f"cannot reach the OpenAI-compatible server at {where}: {err}") from err
        if self.model not in served:
            listing = f"; it serves: {', '.join(served[:10])}" if served else ""
            raise JudgeNotReadyError(
                f"the server at {where} does not know model {self.model!r}{listing}; pass a valid id with model=..."
            )

    def message_content(self, prompt: str, images_b64: list[str]) -> list[dict]:
        """The user message: the question, then each image (labelled when there are several)."""
        content: list[dict] = [{"type": "text", "text": prompt}]
        for label, data in zip(_image_labels(len(images_b64)), images_b64):
            if label:
                content.append({"type": "text", "text": label})
            content.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
        return content

    async def complete(self, client, prompt: str, images_b64: list[str], question: JudgeQuestion, *,
                       temperature: float | None, max_tokens: int, structured: str) -> CachedAnswer:
        content = self.message_content(prompt, images_b64)
        kwargs: dict = {} if temperature is None else {"temperature": temperature}
        if structured == "json_schema":
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "judgement", "schema": json_schema(question), "strict": True},
            }
        elif structured == "json_object":
            kwargs["response_format"] = {"type": "json_object"}
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_completion_tokens": max_tokens, **kwargs}
        try:
            # The SDK's documented raw request method: same client, auth, timeout and errors as
            # chat.completions.create, without its per-request type transform of the whole body,
            # which costs more CPU than everything else here when labelling at high concurrency.
            response = await client.post("/chat/completions", cast_to=ChatCompletion, body=body)
        except (openai.APIError, ValueError) as err:  # HTTP errors, timeouts, undecodable JSON
            raise map_error(err) from err
        try:
            choice = response.choices[0]
            message = choice.message
            usage = response.usage
        except (AttributeError, TypeError, IndexError) as err:  # a body without the expected fields
            raise RetryableError(f"malformed response body: {type(err).__name__}") from err
        tokens = dict(input_tokens=getattr(usage, "prompt_tokens", 0) or 0,
                      output_tokens=getattr(usage, "completion_tokens", 0) or 0)
        if getattr(message, "refusal", None):
            return CachedAnswer(f"{REFUSAL_MARKER} {message.refusal}", **tokens)
        if choice.finish_reason == "content_filter":
            return CachedAnswer(f"{REFUSAL_MARKER} blocked by the content filter", **tokens)
        if message.content is None:
            raise RetryableError("malformed response body: no message content")
        return CachedAnswer(message.content, **tokens)

"""Google Gemini API backend (google-genai SDK) for ApiJudge. Structured output via a JSON schema."""

from __future__ import annotations

import base64
import importlib
import os

from google import genai
from google.genai import errors, types

from rewards.cache import CachedAnswer
from rewards.concurrency import FatalCallError, RetryableError, status_error
from rewards.judge_prompts import JudgeQuestion, json_schema
from rewards.mllm import JudgeNotReadyError
from rewards.parsing import REFUSAL_MARKER

# google-genai talks through httpx or its fork httpx2, whose classes are distinct: catch both.
_HTTP_MODULES = []
for _name in ("httpx", "httpx2"):
    try:
        _HTTP_MODULES.append(importlib.import_module(_name))
    except ImportError:
        pass
TIMEOUT_ERRORS = tuple(m.TimeoutException for m in _HTTP_MODULES)
TRANSPORT_ERRORS = tuple(m.TransportError for m in _HTTP_MODULES)
HTTP_ERRORS = tuple(m.HTTPError for m in _HTTP_MODULES)

# Finish reasons that mean the model (or its filter) declined to answer.
_BLOCKED = {"SAFETY", "PROHIBITED_CONTENT", "BLOCKLIST", "SPII", "RECITATION", "IMAGE_SAFETY"}


def map_error(err: Exception) -> Exception:
    if isinstance(err, errors.APIError):
        headers = getattr(getattr(err, "response", None), "headers", None)
        return status_error(int(err.code or 0), str(err.message or err)[:300], headers)
    if isinstance(err, TIMEOUT_ERRORS):
        return RetryableError("request timed out")
    if isinstance(err, TRANSPORT_ERRORS):
        return RetryableError(f"connection error: {err}")
    if isinstance(err, ValueError):
        return RetryableError(f"malformed response body: {type(err).__name__}: {str(err)[:200]}")
    return FatalCallError(f"{type(err).__name__}: {err}")


class GeminiBackend:
    default_structured = "json_schema"
    structured_modes = ("json_schema", "none")

    def __init__(self, model: str, base_url: str | None, timeout: float, key_envs: tuple[str, ...]):
        self.model, self.base_url, self.timeout, self.key_envs = model, base_url, timeout, key_envs

    def _client(self) -> genai.Client:
        key = next((os.environ[v] for v in self.key_envs if os.environ.get(v)), None)
        http_options = types.HttpOptions(
            base_url=self.base_url,
            timeout=int(self.timeout * 1000),  # milliseconds
            retry_options=types.HttpRetryOptions(attempts=1),  # our own retry loop decides
        )
        return genai.Client(api_key=key, http_options=http_options)

    def async_client(self):
        return self._client().aio

    async def aclose(self, client) -> None:
        await client.aclose()

    def check_model(self) -> None:
        where = self.base_url or "generativelanguage.googleapis.com"
        client = self._client()
        try:
            client.models.get(model=self.model)
        except errors.APIError as err:
            if err.code in (401, 403) or (err.code == 400 and "API key" in str(err.message)):
                raise JudgeNotReadyError(f"the server at {where} rejected the API key") from err
            if err.code == 404:
                raise JudgeNotReadyError(
                    f"the server at {where} does not know model {self.model!r}; pass a valid id with model=..."
                ) from err
            raise JudgeNotReadyError(f"model check for {self.model!r} at {where} failed: HTTP {err.code}") from err
        except TRANSPORT_ERRORS as err:
            raise JudgeNotReadyError(f"cannot reach the Gemini server at {where}: {err}") from err
        finally:
            client.close()

    async def complete(self, client, prompt: str, images_b64: list[str], question: JudgeQuestion, *,
                       temperature: float | None, max_tokens: int, structured: str) -> CachedAnswer:
        parts: list = [types.Part.from_text(text=prompt)]
        for i, data in enumerate(images_b64):
            if len(images_b64) > 1:
                parts.append(types.Part.from_text(text=f"IMAGE-{i + 1}:"))
            parts.append(types.Part.from_bytes(data=base64.b64decode(data), mime_type="image/png"))
        config = types.GenerateContentConfig(temperature=temperature, max_output_tokens=max_tokens)
        if structured == "json_schema":
            config.response_mime_type = "application/json"
            config.response_json_schema = json_schema(question)
        try:
            response = await client.models.generate_content(
                model=self.model, contents=[types.Content(role="user", parts=parts)], config=config
            )
            usage = response.usage_metadata
            tokens = dict(
                input_tokens=(getattr(usage, "prompt_token_count", 0) or 0) if usage else 0,
                # thinking tokens are billed as output
                output_tokens=((getattr(usage, "candidates_token_count", 0) or 0)
                               + (getattr(usage, "thoughts_token_count", 0) or 0)) if usage else 0,
            )
            feedback = response.prompt_feedback
            if feedback is not None and feedback.block_reason:
                return CachedAnswer(f"{REFUSAL_MARKER} prompt blocked: {feedback.block_reason}", **tokens)
            candidates = response.candidates or []
            if not candidates:
                raise ValueError("no candidates")
            finish = candidates[0].finish_reason
            finish_name = getattr(finish, "value", finish) or ""
            if str(finish_name) in _BLOCKED:
                return CachedAnswer(f"{REFUSAL_MARKER} finish_reason={finish_name}", **tokens)
            content = candidates[0].content
            texts = [p.text for p in (content.parts or []) if getattr(p, "text", None) and not p.thought] if content else []
        except (errors.APIError, *HTTP_ERRORS, ValueError) as err:
            raise map_error(err) from err
        except (AttributeError, TypeError, IndexError) as err:  # a body without the expected fields
            raise RetryableError(f"malformed response body: {type(err).__name__}") from err
        if not texts and str(finish_name) == "MAX_TOKENS":
            # a real answer (recorded as unparseable): raise max_tokens, which changes the cache key
            return CachedAnswer("[no answer: max_tokens reached]", **tokens)
        if not texts:
            raise RetryableError(f"malformed response body: no text (finish_reason={finish_name})")
        return CachedAnswer("".join(texts), **tokens)

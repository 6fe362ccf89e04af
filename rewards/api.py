"""API judges (MJ-Bench's closed models) through the official SDKs: openai, anthropic, google-genai.

    gpt4o                 OpenAI GPT-4o (pinned snapshot)
    gpt4v                 OpenAI GPT-4 Turbo with vision (MJ-Bench's "GPT-4-vision")
    gemini                Google Gemini
    claude                Anthropic Claude
    openai:<model>        any OpenAI-compatible server (base_url=...), e.g. a local VLM under vLLM
    anthropic:<model>     any Anthropic model id
    google:<model>        any Gemini model id

Keys come from the environment only (OPENAI_API_KEY, ANTHROPIC_API_KEY, GEMINI_API_KEY or
GOOGLE_API_KEY; ``api_key_env=`` names another variable). They are read when a client is built and
are never stored on the judge, printed, cached or written to a config.

Calls run on the SDKs' async clients with bounded concurrency (``concurrency``), a per-judge
requests-per-minute limit (``rpm``), and our own retries with exponential backoff and jitter
(``max_retries``; the SDKs' retries are off). Answers go to the SQLite cache (``cache_path``).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib
import os
import sys
from dataclasses import dataclass, field

from rewards.concurrency import (
    CallStats,
    FatalCallError,
    RetryableError,
    RpmLimiter,
    call_with_retries,
    gather_bounded,
    run_sync,
)
from rewards.images import encode_png, to_pil
from rewards.mllm import JudgeNotReadyError, JudgeRequest, MllmJudge
from rewards.secrets import check_key_env_name, install_log_scrubber

# Presets: MJ-Bench name -> (provider, default model id). Override with model=...
PRESETS: dict[str, tuple[str, str]] = {
    "gpt4o": ("openai", "gpt-4o-2024-11-20"),
    "gpt4v": ("openai", "gpt-4-turbo"),
    "gemini": ("google", "gemini-2.5-pro"),
    "claude": ("anthropic", "claude-sonnet-4-5"),
}

# USD per million (input, output) tokens: the providers' public list prices as we last knew them
# (2025; standard tier, short prompts). They go stale: pass price_per_mtok=(in, out) to override.
PRICES_PER_MTOK: dict[str, tuple[float, float]] = {
    "gpt-4o-2024-11-20": (2.50, 10.00),
    "gpt-4o": (2.50, 10.00),
    "gpt-4-turbo": (10.00, 30.00),
    "gemini-2.5-pro": (1.25, 10.00),
    "claude-sonnet-4-5": (3.00, 15.00),
}

# Rough token counts of one judge call, for the cost guard's estimate before a run (not a bill; the run's own
# count is printed when the judge closes): the instructions and the caption; each image (OpenAI counts 765 tokens
# for a 512 px image in high detail, Anthropic about 350, Gemini 258: we take the high side); the answer
# (a short JSON verdict with a reason; max_tokens caps it).
ESTIMATED_TEXT_TOKENS = 600
ESTIMATED_IMAGE_TOKENS = 800
ESTIMATED_ANSWER_TOKENS = 400

KEY_ENVS: dict[str, tuple[str, ...]] = {
    "openai": ("OPENAI_API_KEY",),
    "anthropic": ("ANTHROPIC_API_KEY",),
    "google": ("GEMINI_API_KEY", "GOOGLE_API_KEY"),
}

_BACKENDS = {
    "openai": "rewards.api_openai:OpenAIBackend",
    "anthropic": "rewards.api_anthropic:AnthropicBackend",
    "google": "rewards.api_gemini:GeminiBackend",
}


def _backend_class(provider: str):
    if provider not in _BACKENDS:
        raise ValueError(f"API provider {provider!r} is not one of {', '.join(_BACKENDS)}")
    module, _, cls = _BACKENDS[provider].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as err:
        package = {"openai": "openai", "anthropic": "anthropic", "google": "google-genai"}[provider]
        raise JudgeNotReadyError(
            f"the {provider} judge needs the {package!r} package: pip install 't2i-align[api]'"
        ) from err


def png_base64(req: JudgeRequest, memo: dict[str, str]) -> list[str]:
    """Base64 PNGs of the request's images; ``memo`` (image hash -> base64) spares re-encoding an
    image that appears in several requests (both orders of a pair)."""
    out = []
    for img, digest in zip(req.images, req.image_hashes):
        if digest not in memo:
            memo[digest] = base64.b64encode(encode_png(img)).decode("ascii")
        out.append(memo[digest])
    return out


@dataclass
class ApiJudge(MllmJudge):
    """An MJ-Bench judge behind an HTTP API. Default mode: pair, both orders, temperature 0."""

    provider: str = "openai"
    mode: str = "pair"
    base_url: str | None = None
    concurrency: int = 8
    rpm: float | None = None
    max_retries: int = 6
    timeout: float = 60.0
    structured: str | None = None  # provider default when None; "none" asks for JSON in words only
    price_per_mtok: tuple | None = None
    api_key_env: str | None = None
    backoff_base: float = 0.5
    backoff_max: float = 30.0
    max_tokens: int = 1024
    _backend: object = field(default=None, init=False, repr=False)
    _limiter: RpmLimiter = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not self.model:
            raise ValueError(f"judge {self.name!r} needs a model id (model=...)")
        check_key_env_name(self.api_key_env)  # a key pasted here is refused, not echoed
        install_log_scrubber()  # this process now holds a key: mask it in every log record (SDK debug logs too)
        if int(self.concurrency) < 1:
            raise ValueError(f"concurrency={self.concurrency!r}: must be at least 1")
        if int(self.max_retries) < 0:
            raise ValueError(f"max_retries={self.max_retries!r}: must be 0 or more")
        if float(self.timeout) <= 0:
            raise ValueError(f"timeout={self.timeout!r}: seconds, must be positive")
        backend_cls = _backend_class(self.provider)
        self.structured = self.structured or backend_cls.default_structured
        if self.structured not in backend_cls.structured_modes:
            raise ValueError(
                f"structured={self.structured!r} for {self.provider}; valid: {', '.join(backend_cls.structured_modes)}"
            )
        if self.price_per_mtok is None:
            self.price_per_mtok = PRICES_PER_MTOK.get(self.model)
        self._limiter = RpmLimiter(self.rpm)
        self._backend = backend_cls(
            model=self.model, base_url=self.base_url, timeout=float(self.timeout), key_envs=self.key_envs
        )
        self._require_key()
        super().__post_init__()

    @property
    def key_envs(self) -> tuple[str, ...]:
        return (self.api_key_env,) if self.api_key_env else KEY_ENVS[self.provider]

    @property
    def judge_id(self) -> str:
        return f"{self.provider}:{self.model}"

    def decoding(self) -> dict:
        return {**super().decoding(), "structured": self.structured}

    def estimate_price_per_mtok(self) -> tuple[tuple[float, float], str]:
        """The (input, output) USD per million tokens the cost guard counts with, and where it comes from: the
        judge's price_per_mtok; else its preset's model (a preset pointed at another model id or server); a
        server of our own (base_url, no price known) is free; else the dearest known price (the safe side)."""
        if self.price_per_mtok:
            return tuple(self.price_per_mtok), "price_per_mtok"
        if self.name in PRESETS and PRESETS[self.name][1] in PRICES_PER_MTOK:
            return PRICES_PER_MTOK[PRESETS[self.name][1]], f"the {self.name} preset's price"
        if self.base_url:
            return (0.0, 0.0), "a server at base_url with no known price: counted free"
        dearest = max(PRICES_PER_MTOK.values(), key=lambda price: price[0] + price[1])
        return dearest, "price unknown: the dearest known price"

    def calls_for(self, scores: int = 0, comparisons: int = 0) -> tuple[int, int]:
        """(calls, images per call) to score ``scores`` images and compare ``comparisons`` pairs, before caching."""
        if self.mode == "pair":
            return comparisons * (2 if self.swap_orders else 1), 2
        return scores + 2 * comparisons, 1

    def estimated_call_usd(self, images_per_call: int) -> float:
        """A rough cost of one call (ESTIMATED_* tokens at estimate_price_per_mtok())."""
        (price_in, price_out), _ = self.estimate_price_per_mtok()
        tokens_in = ESTIMATED_TEXT_TOKENS + ESTIMATED_IMAGE_TOKENS * images_per_call
        tokens_out = min(int(self.max_tokens), ESTIMATED_ANSWER_TOKENS)
        return (tokens_in * price_in + tokens_out * price_out) / 1e6

    def cached_requests(self, prompts: list[str], images_a, images_b=None) -> int:
        """How many of the calls that score(prompts, images_a) (or compare(prompts, images_a, images_b)) would make
        are answered by the cache already (free)."""
        if self._cache is None:
            return 0

        first = to_pil(images_a)
        if images_b is None:
            requests = [self._request(p, [a]) for p, a in zip(prompts, first)]
        elif self.mode != "pair":
            requests = [self._request(p, [img]) for p, img in zip(list(prompts) * 2, first + to_pil(images_b))]
        else:
            second = to_pil(images_b)
            requests = [self._request(p, [a, b]) for p, a, b in zip(prompts, first, second)]
            if self.swap_orders:
                requests += [self._request(p, [b, a]) for p, a, b in zip(prompts, first, second)]
        return sum(self._cache.get(req.key) is not None for req in requests)

    def _require_key(self) -> None:
        if any(os.environ.get(var) for var in self.key_envs):
            return
        if self.provider == "openai" and self.base_url:
            return  # a local OpenAI-compatible server (vLLM) usually needs no key
        raise JudgeNotReadyError(
            f"judge {self.name!r} ({self.judge_id}) needs an API key: set {' or '.join(self.key_envs)} "
            "in the environment (keys are read from the environment only, never from options or configs)"
        )

    def check_ready(self) -> None:
        """Key present and the server accepts the model id (one cheap metadata call, no generation)."""
        self._require_key()
        self._backend.check_model()

    def _generate(self, requests, on_answer):
        backend, question = self._backend, self.question
        decoding = self.decoding()
        settings = dict(temperature=decoding["temperature"], max_tokens=decoding["max_tokens"],
                        structured=self.structured)

        async def run_all():
            client = backend.async_client()
            encoded: dict[str, str] = {}
            try:
                async def one(j: int, req: JudgeRequest) -> None:
                    images_b64 = await asyncio.to_thread(png_base64, req, encoded)
                    try:
                        result = await call_with_retries(
                            lambda: backend.complete(client, req.prompt, images_b64, question, **settings),
                            max_retries=int(self.max_retries), limiter=self._limiter, stats=self.stats,
                            base_delay=self.backoff_base, max_delay=self.backoff_max,
                        )
                    except FatalCallError as err:
                        if err.abort_run:  # would fail every call: stop (answers so far are cached)
                            raise JudgeNotReadyError(f"judge {self.name!r} ({self.judge_id}): {err}") from err
                        on_answer(j, err)
                        return
                    except RetryableError as err:  # retries exhausted: recorded as failed (abstention)
                        on_answer(j, err)
                        return
                    on_answer(j, result)

                jobs = [functools.partial(one, j, req) for j, req in enumerate(requests)]
                await gather_bounded(jobs, int(self.concurrency))
            finally:
                await backend.aclose(client)

        run_sync(run_all)

    def close(self) -> None:
        """Print the run's request, token and cost counts (once) and close the cache."""
        if self.stats.requests or self.stats.cache_hits:
            print(self.usage_summary(), file=sys.stderr)
            self.stats = CallStats()
        super().close()


def _preset(preset: str, **options) -> ApiJudge:
    provider, model = PRESETS[preset]
    options.setdefault("model", model)
    options.setdefault("name", preset)
    if preset == "gpt4v":
        options.setdefault("structured", "json_object")  # GPT-4 Turbo predates JSON-schema outputs
    if provider == "google":
        # Gemini 2.5 models think before answering and count it in max_output_tokens.
        options.setdefault("max_tokens", 8192)
    return ApiJudge(provider=provider, **options)


def gpt4o(**options) -> ApiJudge:
    return _preset("gpt4o", **options)


def gpt4v(**options) -> ApiJudge:
    return _preset("gpt4v", **options)


def gemini(**options) -> ApiJudge:
    return _preset("gemini", **options)


def claude(**options) -> ApiJudge:
    return _preset("claude", **options)


def openai_compatible(model: str, **options) -> ApiJudge:
    """openai:<model>: OpenAI or any OpenAI-compatible server (``base_url=http://host:port/v1``)."""
    options.setdefault("name", f"openai:{model}")
    return ApiJudge(provider="openai", model=model, **options)


def anthropic_model(model: str, **options) -> ApiJudge:
    options.setdefault("name", f"anthropic:{model}")
    return ApiJudge(provider="anthropic", model=model, **options)


def gemini_model(model: str, **options) -> ApiJudge:
    options.setdefault("name", f"google:{model}")
    options.setdefault("max_tokens", 8192)
    return ApiJudge(provider="google", model=model, **options)

"""Judge calls at scale: bounded concurrency, a requests-per-minute limiter, retries with
exponential backoff and full jitter (honouring Retry-After), and token/cost accounting.

A small loop of our own instead of tenacity, so the policy is visible in one place and the
SDKs' own retries are switched off (they would multiply with ours).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


class RetryableError(Exception):
    """A failure worth retrying (rate limit, server error, timeout, malformed body)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class FatalCallError(Exception):
    """A failure that retrying cannot fix. ``abort_run``: it will fail every call (rejected key or
    model id), so the run stops instead of recording every item as an abstention."""

    def __init__(self, message: str, abort_run: bool = False):
        super().__init__(message)
        self.abort_run = abort_run


RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 529})
ABORT_STATUS = frozenset({401, 403, 404})


def parse_retry_after(headers) -> float | None:
    """Seconds from 'retry-after-ms' or 'retry-after' (numeric form only); None if absent."""
    if headers is None:
        return None
    for name, factor in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * factor
        except ValueError:
            continue
        if seconds >= 0:
            return seconds
    return None


def status_error(status: int, message: str, headers=None) -> Exception:
    """The error to raise for an HTTP status from a judge call."""
    if status in RETRYABLE_STATUS or status >= 500:
        return RetryableError(f"HTTP {status}: {message}", retry_after=parse_retry_after(headers))
    return FatalCallError(f"HTTP {status}: {message}", abort_run=status in ABORT_STATUS)


class RpmLimiter:
    """Spaces request starts at least 60/rpm seconds apart (rpm=None: no limit)."""

    def __init__(self, rpm: float | None):
        if rpm is not None and rpm <= 0:
            raise ValueError(f"rpm={rpm!r}: requests per minute must be positive (or None for no limit)")
        self.interval = 60.0 / rpm if rpm else 0.0
        self._next = 0.0
        self._lock = threading.Lock()  # shared across event loops: one judge may be called repeatedly

    async def wait(self) -> None:
        if not self.interval:
            return
        with self._lock:
            now = time.monotonic()
            slot = max(now, self._next)
            self._next = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)


def backoff_delay(attempt: int, base: float = 0.5, cap: float = 30.0, rng: random.Random | None = None) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**attempt)] (attempt counts from 0)."""
    rng = rng or random
    return rng.uniform(0.0, min(cap, base * (2.0 ** attempt)))


@dataclass
class CallStats:
    """What a run of calls cost; printed at the end of a run."""

    requests: int = 0
    retries: int = 0
    failures: int = 0
    cache_hits: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def cost_usd(self, price_per_mtok: tuple[float, float] | None) -> float | None:
        if price_per_mtok is None:
            return None
        return (self.input_tokens * price_per_mtok[0] + self.output_tokens * price_per_mtok[1]) / 1e6

    def summary(self, judge: str, price_per_mtok: tuple[float, float] | None = None) -> str:
        cost = self.cost_usd(price_per_mtok)
        cost_text = f"${cost:.4f}" if cost is not None else "unknown (no price for this model)"
        return (
            f"judge {judge}: {self.requests} requests ({self.retries} retries, {self.failures} failed), "
            f"{self.cache_hits} cache hits, tokens in {self.input_tokens} / out {self.output_tokens}, "
            f"cost {cost_text}"
        )


async def call_with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    max_retries: int,
    limiter: RpmLimiter,
    stats: CallStats,
    base_delay: float = 0.5,
    max_delay: float = 30.0,
    rng: random.Random | None = None,
) -> T:
    """Run ``call`` with up to ``max_retries`` retries on RetryableError; re-raise the last error."""
    attempt = 0
    while True:
        await limiter.wait()
        stats.add(requests=1)
        try:
            return await call()
        except RetryableError as err:
            if attempt >= max_retries:
                raise
            delay = backoff_delay(attempt, base_delay, max_delay, rng)
            if err.retry_after is not None:
                delay = max(delay, min(err.retry_after, max_delay))
            stats.add(retries=1)
            attempt += 1
            await asyncio.sleep(delay)


async def gather_bounded(jobs: list[Callable[[], Awaitable[T]]], concurrency: int) -> list[T]:
    """Run the jobs with at most ``concurrency`` in flight; results in job order."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r}: must be at least 1")
    semaphore = asyncio.Semaphore(concurrency)

    async def guarded(job):
        async with semaphore:
            return await job()

    tasks = [asyncio.ensure_future(guarded(job)) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        # one job failed the whole run: stop the others before the client is closed under them
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def run_sync(make_coro: Callable[[], Awaitable[Any]]) -> Any:
    """Run a coroutine from sync code, also when the caller already runs an event loop (notebooks)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    result: dict[str, Any] = {}

    def worker():
        try:
            result["value"] = asyncio.run(make_coro())
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]

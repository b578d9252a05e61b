"""A small streaming load generator for vLLM's OpenAI API, and the statistics it reports.

The math (``percentile``, ``summarize``) is pure and unit-tested; ``run_phase`` drives N concurrent
streaming ``/v1/completions`` requests with aiohttp and measures, per request, the time to the first
streamed chunk that carries a choice (vLLM sends one per generated token, even when its text is still
held back by the detokenizer) and the number of generated tokens (from the final usage chunk).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from controller.bench.client import parse_event

# Common English words; also the vocabulary of the tiny CPU model, so there one word is about one token.
_WORDS = (
    "the engine serves requests while the controller measures cache usage queue depth latency and "
    "throughput then moves the admission limit and batch cap so that operators sleep at night a "
    "policy decides and the loop applies each change with a reason every token costs memory and time"
).split()


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it."""

    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class PhaseStats:
    """Aggregate figures of one phase (one workload against one server)."""

    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    mean_prompt_tokens: float
    first_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default).

    Returns NaN for an empty sequence.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q={q}: must be in [0, 100]")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def tokens_per_second(output_tokens: int, duration_s: float) -> float:
    """Generated tokens per wall-clock second over a phase; 0 when the duration is not positive."""
    return output_tokens / duration_s if duration_s > 0 else 0.0


def summarize(results: Sequence[RequestResult], duration_s: float) -> PhaseStats:
    """Fold per-request results into phase statistics. Failed requests count in ``failed`` only."""
    good = [r for r in results if r.ok]
    ttfts_ms = [r.ttft_s * 1000.0 for r in good if r.ttft_s is not None]
    out_tokens = sum(r.output_tokens for r in good)
    prompt = [r.prompt_tokens for r in good]
    errors = [r.error for r in results if not r.ok and r.error]
    return PhaseStats(
        requests=len(results),
        failed=len(results) - len(good),
        duration_s=duration_s,
        output_tokens=out_tokens,
        tokens_per_s=tokens_per_second(out_tokens, duration_s),
        ttft_p50_ms=percentile(ttfts_ms, 50),
        ttft_p99_ms=percentile(ttfts_ms, 99),
        mean_prompt_tokens=sum(prompt) / len(prompt) if prompt else math.nan,
        first_error=errors[0] if errors else None,
    )


def make_prompt(index: int, words: int = 40) -> str:
    """A deterministic prompt of ``words`` words, different per ``index`` from its first word on."""
    return " ".join(_WORDS[(index * 7 + i) % len(_WORDS)] for i in range(words))


def completion_payload(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streaming completion that always generates exactly ``max_tokens`` tokens."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any]
) -> RequestResult:
    """Send one streaming completion and time it; never raises for HTTP or transport errors."""
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    chunks = 0
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.text())[:200]
                return RequestResult(ok=False, error=f"HTTP {resp.status}: {body}")
            async for line in resp.content:
                event = parse_event(line)
                if event is None:
                    continue
                if event.get("choices"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
                if event.get("usage"):
                    usage = event["usage"]
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}")
    return RequestResult(
        ok=ttft is not None,
        ttft_s=ttft,
        latency_s=time.perf_counter() - start,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        output_tokens=int(usage.get("completion_tokens", chunks)),
        error=None if ttft is not None else "stream ended without a token",
    )


async def run_phase(
    base_url: str,
    model: str,
    *,
    concurrency: int,
    requests: int,
    max_tokens: int,
    prompt_words: int = 40,
    timeout_s: float = 600.0,
) -> PhaseStats:
    """``requests`` streaming completions, at most ``concurrency`` in flight; returns their statistics."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    pending = iter(range(requests))
    results: list[RequestResult] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        for index in pending:  # the shared iterator hands each index to exactly one worker
            payload = completion_payload(model, make_prompt(index, prompt_words), max_tokens)
            results.append(await stream_completion(session, url, payload))

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, requests))))
        duration = time.perf_counter() - start
    return summarize(results, duration)

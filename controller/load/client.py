"""The load generator: open-loop, streaming ``/v1/completions`` requests over aiohttp, one record each.

Each request is sent at its scheduled arrival time whether or not earlier ones finished (open loop: a slow
server faces the same arrivals as a fast one). Output length is forced: ``max_tokens`` = ``min_tokens`` = the
spec's length with ``ignore_eos``. Times come from the monotonic clock: TTFT is the first streamed chunk that
carries a choice (vLLM sends one per engine step even while the detokenizer holds text back), ITL the gaps
between such chunks, E2E the end of the stream; token counts come from the final usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from controller.load.workload import RequestSpec
from controller.results.records import REFUSED_HTTP, RequestRecord, Status, tpot


@dataclass(frozen=True)
class Target:
    """Where to send requests."""

    base_url: str
    """Data plane, e.g. ``http://127.0.0.1:8000``."""
    model: str
    """Served model name (the ``model`` field of each request)."""


def pooled_connector(limit: int) -> aiohttp.TCPConnector:
    """A connection pool whose idle connections live at most 2 s: below the servers' 5 s keep-alive
    (vLLM's default), so a connection the server is closing is never reused (a client-side failure,
    not the server's)."""
    return aiohttp.TCPConnector(limit=limit, keepalive_timeout=2.0)


def payload(target: Target, spec: RequestSpec, prompt: str | list[int]) -> dict[str, Any]:
    """A streaming completion forced to exactly ``spec.output_tokens`` tokens (``prompt``: text or
    token ids)."""
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": spec.output_tokens,
        "min_tokens": spec.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.priority != 0:  # vLLM rejects a priority unless it schedules by priority
        body["priority"] = spec.priority
    return body


def parse_event(line: bytes) -> dict[str, Any] | None:
    """One SSE line -> its JSON object; None for blank lines, comments and ``[DONE]``."""
    text = line.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None
    data = text[len("data:") :].strip()
    if data == "[DONE]":
        return None
    parsed: dict[str, Any] = json.loads(data)
    return parsed


@dataclass
class _Stream:
    start: float
    first: float | None = None
    last: float | None = None
    chunks: int = 0
    usage: dict[str, Any] | None = None
    error: str | None = None
    http_status: int | None = None
    itl: list[float] = field(default_factory=list)

    def on_event(self, event: dict[str, Any], now: float) -> None:
        if event.get("error"):  # vLLM reports mid-stream failures as an error event
            self.error = str(event["error"])[:200]
        if event.get("choices"):
            self.chunks += 1
            if self.first is None:
                self.first = now
            else:
                self.itl.append(now - (self.last or now))
            self.last = now
        if event.get("usage"):
            self.usage = event["usage"]


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    spec: RequestSpec,
    prompt: str | list[int],
    prompt_tokens: int,
    run_start: float,
) -> RequestRecord:
    """Send one request and record it; never raises for HTTP or transport errors."""
    start = time.monotonic()
    base: dict[str, Any] = {
        "index": spec.index,
        "priority": spec.priority,
        "prompt_tokens": prompt_tokens,
        "output_tokens_requested": spec.output_tokens,
        "arrival_s": start - run_start,
    }
    s = _Stream(start)
    url = f"{target.base_url.rstrip('/')}/v1/completions"
    try:
        async with session.post(url, json=payload(target, spec, prompt)) as resp:
            s.http_status = resp.status
            if resp.status != 200:
                body = (await resp.text())[:200]
                status: Status = "refused" if resp.status in REFUSED_HTTP else "failed"
                return RequestRecord(
                    **base,
                    output_tokens=0,
                    status=status,
                    http_status=resp.status,
                    e2e_s=time.monotonic() - start,
                    error=f"HTTP {resp.status}: {body}",
                )
            async for line in resp.content:
                event = parse_event(line)
                if event is not None:
                    s.on_event(event, time.monotonic())
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"[:200]
    return _finish(base, s, time.monotonic())


def _finish(base: dict[str, Any], s: _Stream, end: float) -> RequestRecord:
    usage = s.usage or {}
    out = int(usage.get("completion_tokens", s.chunks))
    if usage.get("prompt_tokens"):
        base = {**base, "prompt_tokens": int(usage["prompt_tokens"])}
    e2e = end - s.start
    if s.error is None and s.first is None:
        s.error = "stream ended without a token"
    if s.error is None and out < base["output_tokens_requested"]:
        s.error = f"short output: {out} of {base['output_tokens_requested']} tokens"
    ttft = None if s.first is None else s.first - s.start
    ok = s.error is None and ttft is not None
    return RequestRecord(
        **base,
        output_tokens=out,
        status="ok" if ok else "failed",
        http_status=s.http_status,
        ttft_s=ttft,
        tpot_s=tpot(ttft, e2e, out) if ok and ttft is not None else None,
        e2e_s=e2e,
        itl_s=tuple(s.itl),
        error=s.error,
    )


async def run_open_loop(
    target: Target,
    specs: Sequence[RequestSpec],
    prompt_for: Callable[[RequestSpec], tuple[str | list[int], int]],
    *,
    run_start: float,
    timeout_s: float = 600.0,
    on_done: Callable[[RequestRecord], None] | None = None,
    max_connections: int = 4096,
    concurrency: int | None = None,
) -> list[RequestRecord]:
    """Send every spec at ``run_start + arrival_s`` (monotonic clock) and return the records by index.

    With ``concurrency`` N at most N requests are in flight: an arrival waits for a free slot before it is
    sent (a closed loop when every arrival is at 0), and its times start when it is sent.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = pooled_connector(max_connections)
    slots = asyncio.Semaphore(concurrency or len(specs) or 1)
    records: list[RequestRecord] = []

    async def one(session: aiohttp.ClientSession, spec: RequestSpec) -> None:
        prompt, n = prompt_for(spec)
        delay = run_start + spec.arrival_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            rec = await send(session, target, spec, prompt, n, run_start)
        records.append(rec)
        if on_done is not None:
            on_done(rec)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(session, spec) for spec in specs))
    return sorted(records, key=lambda r: r.index)


async def model_info(base_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The first model of ``GET /v1/models`` (vLLM adds ``root`` and ``max_model_len``)."""
    url = f"{base_url.rstrip('/')}/v1/models"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.get(url) as resp,
    ):
        if resp.status != 200:
            raise RuntimeError(f"GET {url} -> HTTP {resp.status}: is this an OpenAI-compatible server?")
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"GET {url} lists no model")
    first: dict[str, Any] = models[0]
    return first

"""The one client: open-loop, streaming ``/v1/completions`` requests over aiohttp, one record each.

:func:`post` is the one place that sends a request and reads its SSE stream, for every caller (the bench,
the overload mix, the chaos load, calibration, the tests): what it records, an :class:`Answer`, each turns
into its own figures. :func:`send` turns it into the bench's ``RequestRecord``.

Each request is sent at its scheduled arrival time whether or not earlier ones finished (open loop: a slow
server faces the same arrivals as a fast one). Output length is forced: ``max_tokens`` = ``min_tokens`` = the
spec's length with ``ignore_eos``. Times come from the monotonic clock: TTFT is the first streamed chunk that
carries a choice (vLLM sends one per engine step even while the detokenizer holds text back), ITL the gaps
between such chunks, E2E the end of the stream; token counts come from the final usage chunk.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
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


OnChunk = Callable[["Answer"], Awaitable[bool]]
"""Called after each streamed event that carries choices, with the answer so far; True hangs up."""
TRANSPORT_ERRORS = (TimeoutError, ConnectionError, aiohttp.ClientError, json.JSONDecodeError)
"""What :func:`post` records as ``Answer.failure`` instead of raising (a malformed event included)."""


@dataclass
class Answer:
    """What came back from one POST, as far as it went. Times are on the monotonic clock."""

    sent_mono: float
    """Just before the request was sent."""
    ended_mono: float = math.nan
    """When the answer ended: read to its end, stopped at an error event, hung up or failed."""
    status: int | None = None
    """The HTTP status; None when no response came."""
    headers: Mapping[str, str] = field(default_factory=dict)
    body: str = ""
    """The whole body of a non-200 answer, or of a 200 to a request that did not ask for a stream."""
    chunk_mono: list[float] = field(default_factory=list)
    """When each streamed event that carries choices arrived (vLLM sends one per engine step, a token
    or several)."""
    finished: set[int] = field(default_factory=set)
    """Indexes of the streamed choices that carried a ``finish_reason``."""
    usage: dict[str, Any] | None = None
    """The last streamed ``usage`` object."""
    error_event: dict[str, Any] | None = None
    """The streamed event that carried an ``error`` (vLLM's mid-stream failure); reading stops there."""
    failure: Exception | None = None
    """The transport error, timeout or malformed event that ended the exchange (one of
    :data:`TRANSPORT_ERRORS`)."""
    hung_up: bool = False
    """``on_chunk`` asked to stop: the connection was closed mid-stream."""

    @property
    def chunks(self) -> int:
        return len(self.chunk_mono)

    @property
    def ttft_s(self) -> float | None:
        """Sent to the first event with choices; None without one."""
        return self.chunk_mono[0] - self.sent_mono if self.chunk_mono else None

    def add_event(self, event: dict[str, Any], now: float) -> None:
        """One streamed event that carries no error, received at ``now``."""
        choices = event.get("choices") or []
        if choices:
            self.chunk_mono.append(now)
        self.finished.update(c.get("index", 0) for c in choices if c.get("finish_reason"))
        if event.get("usage"):
            self.usage = event["usage"]


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    headers: Mapping[str, str] | None = None,
    on_chunk: OnChunk | None = None,
) -> Answer:
    """POST ``body`` as JSON and read the answer: an SSE stream when ``body`` asks for one, else the
    whole body. Never raises for HTTP or transport errors: they are in the answer."""
    answer = Answer(time.monotonic())
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            answer.status, answer.headers = resp.status, resp.headers
            if resp.status != 200 or not body.get("stream"):
                answer.body = await resp.text(errors="replace")
            else:
                await _read_stream(resp, answer, on_chunk)
    except TRANSPORT_ERRORS as exc:
        answer.failure = exc
    answer.ended_mono = time.monotonic()
    return answer


async def _read_stream(resp: aiohttp.ClientResponse, answer: Answer, on_chunk: OnChunk | None) -> None:
    async for line in resp.content:
        event = parse_event(line)
        if event is None:
            continue
        if event.get("error"):
            answer.error_event = event
            return
        answer.add_event(event, time.monotonic())
        if on_chunk is not None and event.get("choices") and await on_chunk(answer):
            answer.hung_up = True
            resp.close()
            return


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    spec: RequestSpec,
    prompt: str | list[int],
    prompt_tokens: int,
    run_start: float,
) -> RequestRecord:
    """Send one request and record it; never raises for HTTP or transport errors. Each request has
    its own ``X-Request-Id``, as a gateway gives it: a router's retries of it carry the same id, by
    which a daemon counts them as retries, not new demand (docs/fleet.md)."""
    url = f"{target.base_url.rstrip('/')}/v1/completions"
    headers = {"X-Request-Id": f"bench-{uuid.uuid4().hex}"}
    answer = await post(session, url, payload(target, spec, prompt), headers=headers)
    base: dict[str, Any] = {
        "index": spec.index,
        "priority": spec.priority,
        "prompt_tokens": prompt_tokens,
        "output_tokens_requested": spec.output_tokens,
        "arrival_s": answer.sent_mono - run_start,
    }
    if answer.failure is None and answer.status != 200:
        status: Status = "refused" if answer.status in REFUSED_HTTP else "failed"
        return RequestRecord(
            **base,
            output_tokens=0,
            status=status,
            http_status=answer.status,
            e2e_s=answer.ended_mono - answer.sent_mono,
            error=f"HTTP {answer.status}: {answer.body[:200]}",
        )
    return _record(base, answer)


def _record(base: dict[str, Any], answer: Answer) -> RequestRecord:
    usage = answer.usage or {}
    out = int(usage.get("completion_tokens", answer.chunks))
    if usage.get("prompt_tokens"):
        base = {**base, "prompt_tokens": int(usage["prompt_tokens"])}
    e2e = answer.ended_mono - answer.sent_mono
    error = None
    if answer.failure is not None:
        error = f"{type(answer.failure).__name__}: {answer.failure}"[:200]
    elif answer.error_event is not None:
        error = str(answer.error_event["error"])[:200]
    elif answer.ttft_s is None:
        error = "stream ended without a token"
    elif out < base["output_tokens_requested"]:
        error = f"short output: {out} of {base['output_tokens_requested']} tokens"
    ttft = answer.ttft_s
    ok = error is None and ttft is not None
    return RequestRecord(
        **base,
        output_tokens=out,
        status="ok" if ok else "failed",
        http_status=answer.status,
        ttft_s=ttft,
        tpot_s=tpot(ttft, e2e, out) if ok and ttft is not None else None,
        e2e_s=e2e,
        itl_s=tuple(b - a for a, b in itertools.pairwise(answer.chunk_mono)),
        error=error,
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

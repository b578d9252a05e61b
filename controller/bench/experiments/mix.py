"""The overload mix: open-loop Poisson arrivals (seeded), each one interactive (priority 0, short, streamed)
or batch (priority 5, long), whatever the server answers; and the probes that size it.

Used by ``bench overload`` (the daemon against ``vllm serve --scheduling-policy priority``, or the daemon at
several ``engine_poll_sleep_s``) and by ``tests/integration/test_overload.py``. Unlike ``bench run`` it keeps
what an admission test asks about: each answer's HTTP status (a 200 whose stream carries an error event
counts as that event's code), its Retry-After, and a per-class TTFT SLO. Requests go through the one
client (``client.post``), connections through the one pool (``client.pooled_connector``).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from controller.load.client import pooled_connector, post
from controller.results.records import percentile

INTERACTIVE, BATCH = "interactive", "batch"
VOCAB = "the engine serves requests while the controller measures cache usage queue depth".split()


@dataclass(frozen=True)
class Mix:
    """The offered load."""

    rate_per_s: float
    """Mean arrivals per second, all classes together."""
    duration_s: float
    interactive_share: float = 0.3
    interactive_tokens: int = 32
    batch_tokens: int = 192
    batch_priority: int = 5
    batch_stream: bool = False
    """Batch requests ask for the whole answer at once (no per-token chunks to serve and parse);
    their "TTFT" is then the time to the whole answer. Interactive requests always stream."""
    prompt_words: int = 24
    timeout_s: float = 60.0
    """A request still unanswered after this long is abandoned (a miss)."""
    seed: int = 0


@dataclass(frozen=True)
class MixOutcome:
    cls: str
    status: int
    """HTTP status; a stream that ended in an error event counts as that event's code; 0: no answer
    before the client's timeout or a connection error."""
    sent_mono: float
    ended_mono: float
    ttft_s: float | None = None
    retry_after: str | None = None
    detail: str = ""

    @property
    def served(self) -> bool:
        return self.status == 200 and self.ttft_s is not None


def _prompt(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(words))


async def one_request(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    cls: str,
    tokens: int,
    priority: int,
    prompt: str,
    stream: bool = True,
) -> MixOutcome:
    """One completion; never raises for HTTP or transport errors."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
        "priority": priority,
    }
    answer = await post(session, base_url + "/v1/completions", body)
    sent, ended = answer.sent_mono, answer.ended_mono
    if answer.failure is not None:
        exc = answer.failure
        return MixOutcome(cls, 0, sent, ended, None, None, f"{type(exc).__name__}: {exc}")
    status = answer.status or 0
    if status != 200:
        retry = answer.headers.get("Retry-After")
        return MixOutcome(cls, status, sent, ended, None, retry, answer.body[:200])
    if not stream:
        return MixOutcome(cls, 200, sent, ended, ended - sent)
    if answer.error_event is not None:
        error = answer.error_event["error"]
        detail = "stream error event: " + str(error)[:200]
        return MixOutcome(cls, int(error.get("code") or 500), sent, ended, None, None, detail)
    return MixOutcome(cls, 200, sent, ended, answer.ttft_s)


async def run_mix(base_url: str, model: str, mix: Mix) -> list[MixOutcome]:
    """Send the mix open-loop; wait for every answer (up to ``mix.timeout_s`` each)."""
    rng = random.Random(mix.seed)
    timeout = aiohttp.ClientTimeout(total=mix.timeout_s)
    tasks: list[asyncio.Task[MixOutcome]] = []
    async with aiohttp.ClientSession(timeout=timeout, connector=pooled_connector(0)) as session:
        start = time.monotonic()
        at = 0.0
        while True:
            at += rng.expovariate(mix.rate_per_s)
            if at >= mix.duration_s:
                break
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            interactive = rng.random() < mix.interactive_share
            cls, tokens, priority, stream = (
                (INTERACTIVE, mix.interactive_tokens, 0, True)
                if interactive
                else (BATCH, mix.batch_tokens, mix.batch_priority, mix.batch_stream)
            )
            prompt = _prompt(mix.prompt_words, rng)
            request = one_request(session, base_url, model, cls, tokens, priority, prompt, stream)
            tasks.append(asyncio.create_task(request))
        return list(await asyncio.gather(*tasks))


async def unloaded_ttft(base_url: str, model: str, n: int = 8, tokens: int = 16) -> float:
    """Median TTFT of interactive requests sent one at a time to an idle server."""
    rng = random.Random(1)
    async with aiohttp.ClientSession(connector=pooled_connector(1)) as session:
        ttfts = []
        for _ in range(n):
            out = await one_request(session, base_url, model, INTERACTIVE, tokens, 0, _prompt(24, rng))
            if not out.served or out.ttft_s is None:
                raise RuntimeError(f"unloaded request failed: {out.status} {out.detail}")
            ttfts.append(out.ttft_s)
    return statistics.median(ttfts)


async def capacity(base_url: str, model: str, mix: Mix, concurrency: int, duration_s: float) -> float:
    """Completions per second of the mix's request shapes with ``concurrency`` requests always in
    flight (closed loop): what the server sustains."""
    rng = random.Random(2)
    done = 0
    stop = time.monotonic() + duration_s

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop:
            interactive = rng.random() < mix.interactive_share
            tokens = mix.interactive_tokens if interactive else mix.batch_tokens
            stream = interactive or mix.batch_stream
            prompt = _prompt(mix.prompt_words, rng)
            out = await one_request(session, base_url, model, INTERACTIVE, tokens, 0, prompt, stream)
            if out.status != 200:
                raise RuntimeError(f"capacity probe failed: {out.status} {out.detail}")
            if time.monotonic() < stop:
                done += 1

    start = time.monotonic()
    async with aiohttp.ClientSession(connector=pooled_connector(0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return done / (time.monotonic() - start)


def _ms(values: Sequence[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else 1000 * value


def summarize(outcomes: list[MixOutcome], slo_s: dict[str, float], duration_s: float) -> dict[str, Any]:
    """Per class: sent, served, refused (429), other errors, TTFT percentiles of the served, the share
    served within the class's TTFT SLO, and goodput (served within SLO per second; refused, failed
    and abandoned requests are misses)."""
    out: dict[str, Any] = {}
    for cls in (INTERACTIVE, BATCH):
        mine = [o for o in outcomes if o.cls == cls]
        served = [o.ttft_s for o in mine if o.served and o.ttft_s is not None]
        good = sum(1 for t in served if t <= slo_s[cls])
        refused = [o for o in mine if o.status == 429]
        out[cls] = {
            "sent": len(mine),
            "served": len(served),
            "refused_429": len(refused),
            "refused_with_retry_after": sum(1 for o in refused if o.retry_after),
            "refused_in_stream": sum(1 for o in refused if o.detail.startswith("stream error event")),
            "server_errors_5xx": sum(1 for o in mine if o.status >= 500),
            "no_answer": sum(1 for o in mine if o.status == 0),
            "other": sum(1 for o in mine if o.status not in (0, 200, 429) and o.status < 500),
            "ttft_p50_ms": _ms(served, 50),
            "ttft_p99_ms": _ms(served, 99),
            "slo_ms": 1000 * slo_s[cls],
            "within_slo": good,
            "within_slo_share": good / len(mine) if mine else None,
            "goodput_per_s": good / duration_s,
        }
    out["goodput_per_s"] = sum(out[c]["goodput_per_s"] for c in (INTERACTIVE, BATCH))
    out["first_failures"] = [
        f"{o.cls} {o.status} {o.detail}" for o in outcomes if o.status not in (200, 429)
    ][:5]
    return out

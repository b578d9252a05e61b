"""vLLM's own routes and call patterns through the daemon's admission gate, on the tiny model: a
streamed completion with more prompts than the limit, the batch chat route, beam search and
``n > 1`` each pass the gate's rules (the limit, the queue bounds, ``[admission] most_urgent_priority``).

The gate's ``acquire`` is watched in place: each call's priority and weight, and the gate's waiting
requests when it is called.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, url, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LIMIT, MAX_QUEUE, MIN_PRIORITY = 4, 6, 1


class Watched:
    """The daemon's gate with each call's queueing for a slot recorded (``Admission.acquire``)."""

    def __init__(self, d: Daemon) -> None:
        self.gate = d.parts.gate
        self.calls: list[dict[str, Any]] = []
        original = self.gate._acquire

        async def acquire(priority: int, *args: Any, **kwargs: Any) -> Any:
            stats = self.gate.stats()
            waiting = stats.queued + stats.pending
            self.calls.append({"priority": priority, "weight": kwargs.get("weight", 1), "waiting": waiting})
            return await original(priority, *args, **kwargs)

        self.gate._acquire = acquire  # type: ignore[method-assign]

    def idle(self) -> bool:
        stats = self.gate.stats()
        return stats.in_flight == stats.queued == stats.pending == 0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("routes") / "config.toml",
        admission={
            "limit": LIMIT,
            "max_queue": MAX_QUEUE,
            "most_urgent_priority": MIN_PRIORITY,
            "default_priority": 1,
        },
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


@pytest.fixture
def watched(daemon: Daemon) -> Iterator[Watched]:
    w = Watched(daemon)
    assert w.idle()
    yield w
    del w.gate._acquire  # the gate's own method again


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "the engine serves", "max_tokens": 8, "ignore_eos": True, **fields}


async def test_a_stream_with_more_prompts_than_the_limit_leaves_room_for_others(
    daemon: Daemon, watched: Watched
) -> None:
    """Each of its prompts takes its own slot when it runs and gives it back when the engine ends
    it: it never holds four while it waits for a fifth that never frees, refusing everyone else
    until its deadline (60 s in the batch class)."""
    body = completion(prompt=[f"prompt {i}" for i in range(6)], max_tokens=16, stream=True)
    async with http_session() as s:

        async def streamed() -> tuple[int, str]:
            async with s.post(url(daemon, "/v1/completions"), json=body) as r:
                return r.status, await r.text()

        stream = asyncio.create_task(streamed())
        await wait_for(lambda: len(watched.calls) >= LIMIT, 30, "the stream's prompts at the gate")
        t0 = time.monotonic()
        async with s.post(url(daemon, "/v1/completions"), json=completion()) as r:
            single = r.status, time.monotonic() - t0
        status, text = await asyncio.wait_for(stream, 60.0)
    assert status == 200 and "[DONE]" in text
    assert single[0] == 200 and single[1] < 20.0, single
    assert [c["weight"] for c in watched.calls] == [1] * 7  # six prompts and the single request
    assert watched.idle()


async def test_the_batch_route_is_bounded_by_the_queue_limit(daemon: Daemon, watched: Watched) -> None:
    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(40)]
    body = {"model": "tiny", "messages": conversations, "max_tokens": 4}
    async with http_session() as s, s.post(url(daemon, "/v1/chat/completions/batch"), json=body) as r:
        status, answer = r.status, await r.json()
    assert status == 429, answer
    assert "gate queue limit" in answer["error"]["message"]
    assert max((c["waiting"] for c in watched.calls), default=0) <= LIMIT + MAX_QUEUE
    assert watched.idle()  # no pending place left behind by the conversations never run


async def test_a_batch_priority_more_urgent_than_most_urgent_priority_is_refused_before_the_gate(
    daemon: Daemon, watched: Watched
) -> None:
    conversations = [[{"role": "user", "content": "hello"}]] * 2
    body = {"model": "tiny", "messages": conversations, "max_tokens": 4, "priority": -1000}
    async with http_session() as s, s.post(url(daemon, "/v1/chat/completions/batch"), json=body) as r:
        status, answer = r.status, await r.json()
    assert (status, answer["error"]["param"]) == (400, "priority"), answer
    assert watched.calls == [] and watched.idle()
    del body["priority"]  # naming none: [admission] default_priority, not vLLM's 0
    async with http_session() as s, s.post(url(daemon, "/v1/chat/completions/batch"), json=body) as r:
        assert r.status == 200, await r.text()
    assert [c["priority"] for c in watched.calls] == [1, 1]


async def test_beam_search_steps_run_at_the_requests_priority(daemon: Daemon, watched: Watched) -> None:
    body = completion(use_beam_search=True, n=2, max_tokens=3, priority=7)
    async with http_session() as s, s.post(url(daemon, "/v1/completions"), json=body) as r:
        assert r.status == 200, await r.text()
    assert len(watched.calls) >= 3  # one call per beam per token
    assert {c["priority"] for c in watched.calls} == {7}
    assert watched.idle()


async def test_n_sequences_hold_n_of_the_limit(daemon: Daemon, watched: Watched) -> None:
    body = completion(n=4, max_tokens=16)
    async with http_session() as s:

        async def one() -> int:
            async with s.post(url(daemon, "/v1/completions"), json=body) as r:
                return r.status

        statuses = await asyncio.gather(*(one() for _ in range(4)))
    assert statuses == [200] * 4
    assert [c["weight"] for c in watched.calls] == [4] * 4
    assert watched.idle()

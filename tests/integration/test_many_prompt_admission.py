"""On the real engine, a completion with many prompts is counted whole at admission: it cannot slip
past the gate's bounds.

One daemon for the module, in the test's event loop so the tests can read the gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_QUEUE = 16
LIMIT = 2


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("cfg") / "config.toml",
        admission={"limit": LIMIT, "max_queue": MAX_QUEUE},
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


def url(d: Daemon) -> str:
    return f"http://{d.config.server.host}:{d.config.server.port}/v1/completions"


async def test_a_40_prompt_completion_is_refused_and_the_queue_stays_within_bound(daemon: Daemon) -> None:
    gate = daemon.parts.gate
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            stats = gate.stats()
            peak = max(peak, stats.queued + stats.pending)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    try:
        async with http_session() as s:
            body = {"model": "tiny", "prompt": [f"p{i}" for i in range(40)], "max_tokens": 4}
            async with s.post(url(daemon), json=body) as r:
                assert r.status == 429, await r.text()
                assert "gate queue limit 16" in (await r.json())["error"]["message"]
                assert int(r.headers["Retry-After"]) >= 1
            body = {"model": "tiny", "prompt": [f"p{i}" for i in range(10)], "max_tokens": 4}
            async with s.post(url(daemon), json=body) as r:
                assert r.status == 200, await r.text()
                assert len((await r.json())["choices"]) == 10
    finally:
        watcher.cancel()
    # pending places count the calls admitted and not yet at the gate: up to LIMIT of them go
    # straight to a free slot, the rest may queue, so the waiting never passes the queue bound plus
    # the free slots (a burst of calls admitted before the event loop turns shows all of them)
    assert peak <= MAX_QUEUE + LIMIT
    stats = gate.stats()
    assert (stats.queued, stats.pending, stats.in_flight) == (0, 0, 0)

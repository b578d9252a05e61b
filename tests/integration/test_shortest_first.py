"""On the real engine (the tiny model): a class that serves the shortest prompt first
(``order = "shortest"``) ranks its waiters by the prompt length vLLM rendered. With the gate's one slot
held by the test, a long prompt queues first and a short one after it; when the slot comes back the
short one is served first. In a class in arrival order the long one would be (the gate's unit tests:
``tests/unit/test_gate_shortest.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, url, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LONG = " ".join(["the engine serves a long prompt"] * 60)
SHORT = "hi"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    classes = {
        "interactive": {"max_priority": 0, "queue_deadline_s": 120.0, "order": "shortest"},
        "batch": {"min_priority": 1, "queue_deadline_s": 120.0},
    }
    path = write_config(
        tmp_path_factory.mktemp("shortest") / "config.toml",
        admission={"limit": 1, "max_queue": 8, "classes": classes},
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


async def test_the_short_prompt_queued_second_is_served_first(daemon: Daemon) -> None:
    gate = daemon.parts.gate
    assert gate.uses_prompt_length  # the engine client passes each prompt's length to the gate
    finished: list[str] = []

    async def post(label: str, prompt: str) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
        async with http_session() as s, s.post(url(daemon, "/v1/completions"), json=body) as r:
            assert r.status == 200, await r.text()
            await r.json()
        finished.append(label)

    held = await gate.acquire(0)
    try:
        long = asyncio.create_task(post("long", LONG))
        await wait_for(lambda: gate.stats().queued == 1, 30.0, "the long prompt to queue")
        short = asyncio.create_task(post("short", SHORT))
        await wait_for(lambda: gate.stats().queued == 2, 30.0, "the short prompt to queue behind it")
    finally:
        gate.release(held)
    await asyncio.wait_for(asyncio.gather(long, short), 120.0)
    assert finished == ["short", "long"]

"""A swap longer than the renderer grace, on the real engine.

A GPU engine builds for minutes; the tiny CPU model builds in seconds and hid this. Here the host's
build is slowed to 45 s (the real build runs after the sleep) and a memory restart retires the old
engine first, as on a GPU. Requests go through the real serving objects, which keep preprocessing
with the retired engine's renderer until the swap has finished, at several points of the swap: just
after the retire, before and after the 30 s renderer grace would have run out had it started at the
retire, near the end of the build, and after the swap. Every one must be answered in full.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller.engine.runtime import host as host_module
from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, stream_completion, url, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SLOW_BUILD_S = 45.0
KV = 64 << 20


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("swap") / "config.toml",
        engine={"kv_cache_memory_bytes": KV},
    )
    async with running_daemon(path) as d:
        yield d


def slow_builds(d: Daemon) -> None:
    """Every later build of the host sleeps first (the fault injected: a build of minutes)."""
    real = d.parts.host._builder

    def slowed(args: argparse.Namespace) -> Any:
        time.sleep(SLOW_BUILD_S)
        return real(args)

    d.parts.host._builder = slowed


async def completion(session: Any, d: Daemon) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": "the swap keeps serving", "max_tokens": 12, "ignore_eos": True}
    async with session.post(url(d, "/v1/completions"), json=body) as r:
        return {"status": r.status, "body": await r.text()}


async def test_requests_at_every_point_of_a_swap_longer_than_the_renderer_grace_are_answered(
    daemon: Daemon,
) -> None:
    assert SLOW_BUILD_S > host_module.RENDERER_GRACE_S + 10
    slow_builds(daemon)
    generation = daemon.parts.host.generation
    async with http_session() as s:
        running = asyncio.create_task(stream_completion(s, url(daemon, ""), 200))
        await asyncio.sleep(0.5)
        restart = asyncio.create_task(
            daemon.parts.guard.restart("host_memory_low", {"kv_cache_memory_bytes": KV // 2}, drain=True)
        )
        deadline = time.monotonic() + 30
        while not daemon.parts.host.dead:  # the old engine is retired: the slow build begins
            assert time.monotonic() < deadline, "the old engine was not retired"
            await asyncio.sleep(0.05)
        t_retired, requests = time.monotonic(), []
        for at in (1.0, 20.0, 35.0, 43.0):
            await asyncio.sleep(max(0.0, t_retired + at - time.monotonic()))
            requests.append(asyncio.create_task(stream_completion(s, url(daemon, ""), 12)))
            requests.append(asyncio.create_task(completion(s, daemon)))
        await asyncio.wait_for(restart, 180)
        requests.append(asyncio.create_task(stream_completion(s, url(daemon, ""), 12)))
        requests.append(asyncio.create_task(completion(s, daemon)))
        results = await asyncio.wait_for(asyncio.gather(*requests), 120)
        first = await asyncio.wait_for(running, 60)
    assert first["status"] == 200, first
    assert all(r["status"] == 200 for r in results), results
    assert all(r.get("tokens", 12) == 12 for r in results), results
    assert daemon.parts.host.generation == generation + 1

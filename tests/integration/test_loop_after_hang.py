"""The control loop on the real engine when its EngineCore hangs: an EngineCore stopped with SIGSTOP
never answers the tick's step drain (a vLLM utility call); the guard sees the stall and rebuilds the
engine, and the loop ticks again on the new one: its subscribers (the memory guard among them) see
each tick, the step-cost model learns from the new engine's steps, and /healthz says serving."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
import pytest_asyncio

from controller.admin import status
from controller.lifecycle.daemon import Daemon
from tests.helpers import (
    engine_core,
    http_session,
    running_daemon,
    stream_completion,
    url,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("hang") / "config.toml",
        control={"tick_s": 0.5},
        guard={"stall_timeout_s": 3.0, "check_interval_s": 0.2, "backoff_initial_s": 0.5},
    )
    async with running_daemon(path) as d:
        yield d


async def test_the_loop_ticks_again_after_the_guard_rebuilds_a_hung_engine(daemon: Daemon) -> None:
    parts = daemon.parts
    ticks: list[float] = []  # each tick that reached its subscribers, as the memory guard is one
    parts.loop.subscribe(lambda obs, _changes: ticks.append(obs.now_mono))
    generation, base, core = parts.host.generation, url(daemon, ""), engine_core()
    try:
        async with http_session() as s:
            running = asyncio.create_task(stream_completion(s, base, 100_000 // 50))
            await wait_for(lambda: parts.window.total_steps > 5, 30, "the request to be stepping")
            os.kill(core.pid, signal.SIGSTOP)  # the next tick's drain asks an engine that never answers
            await asyncio.wait_for(running, 60)
            await wait_for(
                lambda: parts.host.ready and parts.host.generation > generation, 120, "a new engine"
            )
            seen, learned = len(ticks), parts.cost.model.samples
            await wait_for(lambda: len(ticks) >= seen + 4, 15, "the loop to tick on the new engine")
            later = await asyncio.wait_for(stream_completion(s, base, 16), 60)
            await wait_for(lambda: parts.cost.model.samples > learned, 15, "the tick to drain the new engine")
    finally:
        with contextlib.suppress(psutil.Error):
            core.send_signal(signal.SIGCONT)
            core.kill()
    assert later["status"] == 200 and later["tokens"] == 16, later
    assert status.health(parts) == (True, "serving") and status.loop_stall(parts) is None
    assert parts.host.generation == generation + 1

"""Liveness on the real engine: an EngineCore stopped with SIGSTOP while a request
runs in it is alive to vLLM (``errored`` stays False) but makes no progress. The guard sees work in
the engine and no step for ``stall_timeout_s``, restarts it, the request ends with a clear error, new
requests get 503 with Retry-After while no engine can serve, and the next engine serves."""

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
        tmp_path_factory.mktemp("stall") / "config.toml",
        guard={"stall_timeout_s": 3.0, "check_interval_s": 0.2, "backoff_initial_s": 0.5},
    )
    async with running_daemon(path) as d:
        yield d


async def test_a_stopped_engine_core_is_restarted_and_its_request_ends_with_a_clear_error(
    daemon: Daemon,
) -> None:
    generation = daemon.parts.host.generation
    base = url(daemon, "")
    core = engine_core()
    try:
        async with http_session() as s:
            running = asyncio.create_task(stream_completion(s, base, 100_000 // 50))
            await wait_for(lambda: daemon.parts.window.total_steps > 5, 30, "the request to be stepping")
            os.kill(core.pid, signal.SIGSTOP)
            result = await asyncio.wait_for(running, 60)  # never hangs
            during = await asyncio.wait_for(stream_completion(s, base, 8), 10)
            await wait_for(lambda: daemon.parts.host.ready, 120, "the new engine")
            later = await asyncio.wait_for(stream_completion(s, base, 8), 60)
    finally:
        with contextlib.suppress(psutil.Error):
            core.send_signal(signal.SIGCONT)
            core.kill()
    message = str(result.get("error", "")) + str(result.get("body", ""))
    assert result["status"] in (500, 503) and "retry" in message.lower(), result
    assert during["status"] == 503 and "retry-after" in {k.lower() for k in during["headers"]}, during
    assert later["status"] == 200 and later["tokens"] == 8, later
    assert daemon.parts.host.generation == generation + 1
    value = daemon.parts.registry.get_sample_value(
        "autopilot_engine_restarts_total", {"reason": "engine_stalled"}
    )
    assert value == 1
    assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE

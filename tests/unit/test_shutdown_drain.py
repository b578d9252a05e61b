"""Shutdown: at the drain deadline every request left gets an answer (queued
ones 503, running ones a retryable 503), not a dropped connection; and a SIGTERM during an engine
build does not wait for the build (systemd's TimeoutStopSec would SIGKILL the service first), while
the engine that build makes is shut down, not leaked. The parts are real (nothing started); the data
plane's server and the engine builder are fakes."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from controller.admission.gate import GateRejected
from controller.config.load import load_config
from controller.control.steps import StepFeed
from controller.engine.runtime.host import EngineHost
from controller.lifecycle.daemon import Daemon
from tests.helpers import settle, write_config


class NeverDoneServer:
    """uvicorn as the drain sees it: it exits once its connections close (here: never)."""

    should_exit = False
    force_exit = False


async def test_at_the_drain_deadline_queued_requests_get_503_and_running_ones_are_ended(
    tmp_path: Path,
) -> None:
    path = write_config(tmp_path / "config.toml", server={"shutdown_timeout_s": 0.3}, admission={"limit": 1})
    d = Daemon(load_config(path), install_signals=False)
    p = d.parts
    p.server = NeverDoneServer()
    d._server_task = asyncio.create_task(asyncio.Event().wait())
    slot = await p.gate.acquire(0)  # one request running in the engine...
    p.host.in_flight[7] = ("req-7", None)  # type: ignore[assignment]
    queued = asyncio.create_task(p.gate.acquire(0))  # ...and one queued
    await settle()
    p.gate.stop_admitting()
    t0 = time.monotonic()
    await d._drain_data_plane()
    assert time.monotonic() - t0 < 0.3 + 5.0 + 1.0
    with pytest.raises(GateRejected) as refused:
        await asyncio.wait_for(queued, 1.0)
    assert refused.value.status == 503
    assert p.host.aborted == {7: "the server is shutting down"}  # its client gets a retryable 503
    assert p.server.should_exit
    p.gate.release(slot)
    d._server_task.cancel()


class FakeLLM:
    def __init__(self) -> None:
        self.shut_down = threading.Event()

    def shutdown(self, timeout: float | None = None) -> None:
        self.shut_down.set()


async def test_a_shutdown_during_an_engine_build_does_not_wait_for_the_build() -> None:
    entered, release, built = threading.Event(), threading.Event(), FakeLLM()

    def slow_build(_args: argparse.Namespace) -> Any:
        entered.set()
        release.wait(30.0)  # a GPU build: minutes
        return built

    def daemon_loop() -> float:
        async def main() -> None:
            host = EngineHost(argparse.Namespace(max_num_seqs=4), StepFeed(), builder=slow_build)
            restart = asyncio.create_task(host.start())
            await asyncio.get_running_loop().run_in_executor(None, entered.wait)
            restart.cancel()  # SIGTERM: shutdown cancels the background tasks...
            await asyncio.gather(restart, return_exceptions=True)
            host.stop()  # ...and stops the engine

        t0 = time.monotonic()
        asyncio.run(main())  # as `serve` runs the daemon: asyncio.run joins its default executor
        return time.monotonic() - t0

    took = await asyncio.to_thread(daemon_loop)
    assert took < 5.0, f"the daemon's loop waited {took:.1f}s for the build"
    assert not built.shut_down.is_set()
    release.set()  # the build ends after the daemon stopped: its engine is shut down, not leaked
    assert await asyncio.to_thread(built.shut_down.wait, 5.0)

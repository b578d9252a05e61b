"""The memory guard and crash recovery on the real engine.

One daemon for the module, in the test's loop, with a fake host-memory reading source (the sampler's
input, not the guard's logic) and a crash budget of 2 an hour (only crashes spend it: the memory
restart of (a) does not). In order: (a) a memory-risk reading
under 20 streaming clients gives exactly one restart with a smaller KV cache and loses no queued
request; (b) SIGKILL of the EngineCore under load is recovered; (c) repeated crashes spend the budget
and the daemon answers 503 instead of hanging clients.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller.control.samplers import FakeHostSource, HostReading
from controller.lifecycle.daemon import Daemon
from tests.helpers import engine_core, http_session, running_daemon, stream_completion, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

KV_BYTES = 64 << 20
PLENTY = 16 << 30


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("guard") / "config.toml",
        engine={"kv_cache_memory_bytes": KV_BYTES, "max_num_seqs": 32},
        admission={"limit": 32, "max_queue": 512},
        control={"tick_s": 0.2, "policy": "static"},
        guard={
            "consecutive_samples": 3,
            "host_available_margin_bytes": 1 << 30,
            "drain_timeout_s": 3.0,
            "max_restarts_per_hour": 2,
            "backoff_initial_s": 0.5,
            "check_interval_s": 0.2,
            "cooldown_s": 5.0,
        },
    )
    async with running_daemon(path, host_source=FakeHostSource(PLENTY)) as d:
        yield d


def base(d: Daemon) -> str:
    return f"http://{d.config.server.host}:{d.config.server.port}"


def set_available(d: Daemon, nbytes: int) -> None:
    assert isinstance(d.parts.host_source, FakeHostSource)
    d.parts.host_source.reading = HostReading(nbytes, 0.0)


def restarts(d: Daemon, reason: str) -> float:
    value = d.parts.registry.get_sample_value("autopilot_engine_restarts_total", {"reason": reason})
    return value or 0.0


def ok(r: dict[str, Any], tokens: int) -> bool:
    return r["status"] == 200 and r["tokens"] == tokens


def clear_error(r: dict[str, Any]) -> bool:
    """A request that did not complete must say why and that a retry is fine."""
    message = str(r.get("error", "")) + str(r.get("body", ""))
    return r["status"] in (500, 503) and "retry" in message.lower()


async def test_a_memory_risk_restarts_once_with_smaller_kv_and_loses_no_queued_request(
    daemon: Daemon,
) -> None:
    async with http_session() as s:
        streaming = [asyncio.create_task(stream_completion(s, base(daemon), 600)) for _ in range(20)]
        await wait_for(lambda: daemon.parts.gate.stats().in_flight >= 20, 30, "20 streams inside the engine")
        set_available(daemon, 256 << 20)  # below the 1 GiB margin: the sampler reads it on each tick
        await wait_for(lambda: daemon.parts.guard.restarting, 10, "the restart to start")
        set_available(daemon, PLENTY)  # the smaller engine frees memory
        queued = [asyncio.create_task(stream_completion(s, base(daemon), 24)) for _ in range(10)]
        await wait_for(lambda: not daemon.parts.guard.restarting, 180, "the restart to finish")
        results = await asyncio.wait_for(asyncio.gather(*streaming), 120)
        queued_results = await asyncio.wait_for(asyncio.gather(*queued), 120)
    assert all(ok(r, 600) or clear_error(r) for r in results), results
    assert all(ok(r, 24) for r in queued_results), queued_results
    assert restarts(daemon, "host_memory_low") == 1
    assert daemon.parts.host.generation == 2
    assert daemon.parts.host.memory_settings()["kv_cache_memory_bytes"] < KV_BYTES
    restart = daemon.parts.guard.last_restart
    assert restart is not None
    first_new = min(r["first_token_mono"] for r in queued_results)
    print(
        f"restart (drain start -> new engine serving) {restart['duration_s']:.1f} s; drain start -> "
        f"first token from the new engine {first_new - restart['started_mono']:.1f} s; "
        f"{sum(ok(r, 600) for r in results)}/20 streams completed, the rest got a retryable error"
    )


async def test_b_engine_core_sigkill_under_load_is_recovered(daemon: Daemon) -> None:
    generation = daemon.parts.host.generation
    async with http_session() as s:
        load = [asyncio.create_task(stream_completion(s, base(daemon), 300)) for _ in range(8)]
        await wait_for(lambda: daemon.parts.gate.stats().in_flight >= 8, 30, "load inside the engine")
        os.kill(engine_core().pid, signal.SIGKILL)
        waiting = [asyncio.create_task(stream_completion(s, base(daemon), 16)) for _ in range(5)]
        results = await asyncio.wait_for(asyncio.gather(*load), 180)  # none may hang
        waiting_results = await asyncio.wait_for(asyncio.gather(*waiting), 180)
        later = await stream_completion(s, base(daemon), 16)
    assert all(ok(r, 300) or clear_error(r) for r in results), results
    assert all(ok(r, 16) for r in waiting_results), waiting_results
    assert ok(later, 16)
    assert daemon.parts.host.generation == generation + 1
    assert restarts(daemon, "engine_died") == 1


async def test_c_repeated_crashes_spend_the_budget_then_503_without_hanging(daemon: Daemon) -> None:
    # Budget 2 crashes an hour: (b) spent 1 ((a)'s memory restart spent none); this crash spends the
    # second, the next one finds it spent.
    for expected_generation in (daemon.parts.host.generation + 1, None):
        os.kill(engine_core().pid, signal.SIGKILL)
        if expected_generation is not None:
            await wait_for(
                lambda g=expected_generation: daemon.parts.host.generation == g and daemon.parts.host.ready,
                180,
                "recovery",
            )
    await wait_for(lambda: daemon.parts.guard.unavailable_reason is not None, 60, "the budget to be spent")
    async with http_session() as s:
        r = await asyncio.wait_for(stream_completion(s, base(daemon), 8), 10)
        async with s.get(f"http://{daemon.config.admin.host}:{daemon.config.admin.port}/healthz") as h:
            health = await h.json()
            health_status = h.status
    assert r["status"] == 503 and "retry-after" in {k.lower() for k in r["headers"]}, r
    assert health_status == 503 and health["reason"] == "restart_budget_spent"
    assert restarts(daemon, "engine_died") == 2

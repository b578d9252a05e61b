"""Liveness and bounded waits: an engine that is alive but makes no progress is
recovered like a crash, new requests are refused with 503 + Retry-After while no engine can serve,
and a queued request's wait through restarts is bounded. Fakes stand in for the engine (an
``EngineControl`` that records restarts and whose recovery sleep can be held); the gate is real."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.clock import FakeClock
from controller.config.load import GuardConfig
from controller.lifecycle.guard import Guard
from controller.lifecycle.liveness import StallWatch
from tests.helpers import settle


class FakeEngine:
    """An ``EngineControl`` that counts restarts; ``mark_failed`` makes it dead, a restart alive."""

    memory_knob = "kv_cache_memory_bytes"
    died_out_of_memory = False

    def __init__(self) -> None:
        self.dead = False
        self.failed: list[str] = []
        self.restarts: list[dict[str, Any]] = []

    def memory_settings(self) -> dict[str, Any]:
        return {"kv_cache_memory_bytes": 64 << 20, "gpu_memory_utilization": None}

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        self.restarts.append(overrides)
        self.dead = False

    async def abort_in_flight(self, reason: str) -> int:
        return 0

    def mark_failed(self, reason: str) -> None:
        self.failed.append(reason)
        self.dead = True


def gate(clock: FakeClock, deadline_s: float = 5.0) -> AdmissionGate:
    return AdmissionGate(1, 16, [PriorityClass("default", 0, queue_deadline_s=deadline_s)], clock=clock)


# -- the stall check itself --------------------------------------------------------------------------


def test_work_inside_an_engine_with_no_step_for_the_timeout_is_a_stall() -> None:
    watch = StallWatch(10.0)
    assert watch.check(100.0, 2, last_step_age_s=0.5) is None
    assert watch.check(105.0, 2, last_step_age_s=5.5) is None
    why = watch.check(111.0, 2, last_step_age_s=11.5)
    assert why is not None and "2 requests" in why and "stall_timeout_s = 10" in why


def test_an_engine_idle_for_long_is_not_stalled_the_moment_work_arrives() -> None:
    watch = StallWatch(10.0)
    assert watch.check(0.0, 0, last_step_age_s=3600.0) is None
    assert watch.check(1.0, 1, last_step_age_s=3601.0) is None  # busy since 1.0: quiet 0 s
    assert watch.check(9.0, 1, last_step_age_s=3609.0) is None
    assert watch.check(11.5, 1, last_step_age_s=3611.5) is not None


def test_a_stall_timeout_of_zero_never_reports_a_stall() -> None:
    watch = StallWatch(0.0)
    assert watch.check(1e6, 5, last_step_age_s=1e6) is None


# -- the guard recovers a stalled engine ------------------------------------------------------------


async def test_a_stalled_engine_is_marked_failed_and_recovered_by_the_watcher() -> None:
    """The watcher's own interval paces it; the test waits for its checks and its restart, each an
    event, and moves the engine's quiet time on the fake clock."""
    clock, engine, reasons = FakeClock(), FakeEngine(), []
    g = gate(clock)
    slot = await g.acquire(0)  # a request inside the engine
    age, checked, restarted = [0.0], asyncio.Event(), asyncio.Event()

    def last_step_age() -> float:
        checked.set()
        return age[0]

    def on_restart(reason: str, _duration_s: float) -> None:
        reasons.append(reason)
        restarted.set()

    guard = Guard(
        GuardConfig(stall_timeout_s=5.0, check_interval_s=0.05, backoff_initial_s=0.0),
        g,
        engine,
        on_restart,
        clock,
        lambda: None,
        last_step_age=last_step_age,
    )
    watcher = asyncio.create_task(guard.watch())
    try:
        await asyncio.wait_for(checked.wait(), 5.0)
        assert engine.failed == [] and reasons == []  # busy, but the engine stepped just now
        clock.advance(6.0)
        age[0] = 6.0
        await asyncio.wait_for(restarted.wait(), 5.0)
        assert len(engine.failed) == 1 and "no engine step" in engine.failed[0]
        assert reasons == ["engine_stalled"] and engine.restarts == [{}] and not engine.dead
        assert not g.paused
    finally:
        watcher.cancel()
        g.release(slot)


async def test_new_requests_get_503_with_retry_after_while_no_engine_can_serve() -> None:
    clock, engine = FakeClock(), FakeEngine()
    g = gate(clock, deadline_s=60.0)
    asleep, wake = asyncio.Event(), asyncio.Event()

    async def sleep(_s: float) -> None:
        asleep.set()
        await wake.wait()

    guard = Guard(
        GuardConfig(backoff_initial_s=4.0), g, engine, lambda _r, _d: None, clock, lambda: None, sleep
    )
    held = await g.acquire(0)  # the one slot, in the engine that dies
    g.check_admission(0)
    queued = asyncio.create_task(g.acquire(0))  # queued before the crash: keeps its place
    await settle()
    engine.dead = True
    recovery = asyncio.create_task(guard.recover())
    await asleep.wait()
    with pytest.raises(GateRejected) as refused:
        g.check_admission(0)
    assert refused.value.status == 503 and refused.value.retry_after_s >= 4
    assert "no engine can serve" in refused.value.message
    assert not queued.done()
    wake.set()
    await recovery
    g.release(held)  # the dead engine's request ended
    slot = await asyncio.wait_for(queued, 1)
    g.check_admission(0)  # an engine serves again: admitted
    g.release(slot)


# -- a queued request's wait through restarts is bounded --------------------------------------------


async def test_a_request_queued_through_a_long_restart_gets_503_after_max_restart_wait() -> None:
    clock = FakeClock()
    g = gate(clock, deadline_s=5.0)
    g.set_restart_wait(10.0)
    g.pause()
    waiter = asyncio.create_task(g.acquire(0))
    await settle()
    clock.advance(14.0)  # 5 s deadline + 10 s of restart not yet spent
    assert g.expire_overdue() == 0
    clock.advance(2.0)
    assert g.expire_overdue() == 1
    with pytest.raises(GateRejected) as refused:
        await waiter
    assert refused.value.status == 503 and refused.value.reason == "restart_wait"
    assert "max_restart_wait_s = 10s" in refused.value.message


async def test_a_short_restart_still_does_not_count_against_the_queue_deadline() -> None:
    clock = FakeClock()
    g = gate(clock, deadline_s=5.0)
    g.set_restart_wait(10.0)
    g.pause()
    waiter = asyncio.create_task(g.acquire(0))
    await settle()
    clock.advance(8.0)
    g.resume()
    await settle()
    assert waiter.done() and g.stats().in_flight == 1  # granted, not refused

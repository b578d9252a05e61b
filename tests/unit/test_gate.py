"""admission/gate.py: the gate's limit, strict priority, cancellation, admission and drain.

No real time passes: ``await asyncio.sleep(0)`` only lets the tasks we created run; every timestamp
comes from a ``FakeClock``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from controller.admission.classes import CompletionRate, PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected, GateStats, Slot
from controller.clock import FakeClock
from tests.helpers import Events, Recorder, settle

ONE_CLASS = (PriorityClass("all", max_queue=100_000, queue_deadline_s=1e6),)
"""One class for every priority and no deadline to speak of: the tests of the limit and the order."""


IDLE = GateStats(0, 0, 0, 0, admitted_total=0, rejected_total=0, completed_total=0, closed=False)
"""Nothing in flight, queued, pending, refused or closed: a case names only what differs."""


def stats(**fields: Any) -> GateStats:
    return dataclasses.replace(IDLE, **fields)


class Waiters:
    """Tasks that each acquire a slot and record, in order, the label of who got one."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.granted: list[str] = []
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def _wait(self, label: str, priority: int) -> None:
        await self.gate.acquire(priority)
        self.granted.append(label)

    async def add(self, label: str, priority: int = 0) -> asyncio.Task[None]:
        task = asyncio.create_task(self._wait(label, priority))
        self.tasks[label] = task
        await settle()
        return task


def make_gate(limit: int = 1, max_queue: int = 100) -> tuple[AdmissionGate, FakeClock, list[str]]:
    clock = FakeClock()
    reasons: list[str] = []
    gate = AdmissionGate(limit, max_queue, ONE_CLASS, clock=clock, events=Recorder(reasons, Events()))
    return gate, clock, reasons


def release(gate: AdmissionGate, cls: str = "all") -> None:
    gate.release(Slot(cls, 0.0))


# -- limit ----------------------------------------------------------------------------------------


async def test_limit_admits_up_to_limit_and_queues_the_rest() -> None:
    gate, _, _ = make_gate(limit=2)
    waiters = Waiters(gate)
    for label in ("a", "b", "c"):
        await waiters.add(label)
    assert waiters.granted == ["a", "b"]
    assert gate.stats() == stats(limit=2, in_flight=2, queued=1, admitted_total=2, completed_total=0)
    release(gate)
    await settle()
    assert waiters.granted == ["a", "b", "c"]
    assert (gate.stats().in_flight, gate.stats().queued, gate.stats().completed_total) == (2, 0, 1)


@pytest.mark.parametrize("limit", [0, -1])
def test_limit_below_one_is_refused(limit: int) -> None:
    with pytest.raises(ValueError, match="admission limit must be >= 1"):
        AdmissionGate(limit, 10, ONE_CLASS)
    gate = AdmissionGate(1, 10, ONE_CLASS)
    with pytest.raises(ValueError, match="admission limit must be >= 1"):
        gate.set_limit(limit)
    assert gate.limit == 1


@pytest.mark.parametrize(
    ("arrivals", "expected_order"),
    [
        # (label, priority) in arrival order -> order of release: lower value first, FIFO among equals
        ([("a", 5), ("b", 1), ("c", 5), ("d", 0), ("e", 1)], ["d", "b", "e", "a", "c"]),
        ([("a", 0), ("b", 0), ("c", 0)], ["a", "b", "c"]),
        ([("a", 3), ("b", 2), ("c", 1)], ["c", "b", "a"]),
        ([("a", -1), ("b", 10), ("c", -1)], ["a", "c", "b"]),
    ],
)
async def test_release_order_is_strict_priority_then_fifo(
    arrivals: list[tuple[str, int]], expected_order: list[str]
) -> None:
    gate, _, _ = make_gate(limit=1)
    await gate.acquire()  # hold the only slot so that everyone queues
    waiters = Waiters(gate)
    for label, priority in arrivals:
        await waiters.add(label, priority)
    assert waiters.granted == []
    assert gate.queued_by_class() == {"all": len(arrivals)}
    for _ in arrivals:
        release(gate)
        await settle()
    assert waiters.granted == expected_order
    assert gate.stats().in_flight == 1  # the last one still holds its slot


async def test_raising_the_limit_admits_waiters_at_once() -> None:
    gate, _, _ = make_gate(limit=1)
    waiters = Waiters(gate)
    for label in ("a", "b", "c", "d"):
        await waiters.add(label)
    assert (gate.stats().in_flight, gate.stats().queued) == (1, 3)
    gate.set_limit(3)
    # granted synchronously inside set_limit, before any task runs
    assert (gate.limit, gate.stats().in_flight, gate.stats().queued) == (3, 3, 1)
    await settle()
    assert waiters.granted == ["a", "b", "c"]


async def test_lowering_the_limit_never_evicts() -> None:
    gate, _, _ = make_gate(limit=3)
    waiters = Waiters(gate)
    for label in ("a", "b", "c", "d"):
        await waiters.add(label)
    gate.set_limit(1)
    assert (gate.stats().in_flight, gate.stats().queued) == (3, 1)
    release(gate)
    release(gate)
    await settle()
    assert (gate.stats().in_flight, gate.stats().queued) == (1, 1)  # still above the new limit: d waits
    release(gate)
    await settle()
    assert (gate.stats().in_flight, gate.stats().queued) == (1, 0)
    assert waiters.granted == ["a", "b", "c", "d"]


async def test_slot_releases_on_error() -> None:
    gate, _, _ = make_gate(limit=1)
    with pytest.raises(RuntimeError):
        async with gate.slot(priority=2):
            assert gate.stats().in_flight == 1
            raise RuntimeError("request failed")
    assert (gate.stats().in_flight, gate.stats().completed_total) == (0, 1)


# -- cancellation ---------------------------------------------------------------------------------


async def test_cancelled_waiter_leaves_the_queue() -> None:
    gate, _, _ = make_gate(limit=1)
    await gate.acquire()
    waiters = Waiters(gate)
    await waiters.add("a", priority=1)
    cancelled = await waiters.add("b", priority=0)
    await waiters.add("c", priority=2)
    assert gate.stats().queued == 3
    cancelled.cancel()
    await settle()
    assert cancelled.cancelled()
    assert gate.stats().queued == 2
    release(gate)
    await settle()
    assert waiters.granted == ["a"]  # b's place is skipped, not granted
    assert (gate.stats().in_flight, gate.stats().queued) == (1, 1)


async def test_cancelling_the_only_waiter_does_not_block_later_requests() -> None:
    gate, _, _ = make_gate(limit=1)
    await gate.acquire()
    waiters = Waiters(gate)
    task = await waiters.add("a")
    task.cancel()
    await settle()
    assert gate.stats().queued == 0
    release(gate)
    assert gate.stats().in_flight == 0
    # the queue is empty, so a new request takes the free slot without waiting
    await asyncio.wait_for(gate.acquire(), timeout=1.0)
    assert gate.stats() == stats(limit=1, in_flight=1, admitted_total=2, completed_total=1)


async def test_cancel_racing_with_grant_gives_the_slot_back() -> None:
    gate, _, _ = make_gate(limit=1)
    await gate.acquire()
    waiters = Waiters(gate)
    first = await waiters.add("a", priority=0)
    await waiters.add("b", priority=1)
    release(gate)  # grants a's future ...
    assert (gate.stats().in_flight, gate.stats().queued) == (1, 1)
    first.cancel()  # ... and a is cancelled before it could run
    await settle()
    assert first.cancelled()
    assert waiters.granted == ["b"]  # a's slot went back and on to b
    assert (gate.stats().in_flight, gate.stats().queued) == (1, 0)
    release(gate)
    assert gate.stats().in_flight == 0


# -- check_admission ------------------------------------------------------------------------------


async def test_check_admission_refuses_beyond_limit_plus_queue_and_counts_pending() -> None:
    gate, _, reasons = make_gate(limit=1, max_queue=2)
    for _ in range(3):
        gate.check_admission()
    assert gate.stats().pending == 3
    with pytest.raises(GateRejected) as exc:
        gate.check_admission()
    assert exc.value.status == 429
    assert "queue limit 2" in exc.value.message
    assert reasons == ["queue_full"]
    assert (gate.stats().pending, gate.stats().rejected_total) == (3, 1)

    await gate.acquire()  # the first request reaches the gate: pending -> in flight
    waiters = Waiters(gate)
    await waiters.add("b")
    await waiters.add("c")
    assert (gate.stats().in_flight, gate.stats().queued, gate.stats().pending) == (1, 2, 0)
    with pytest.raises(GateRejected):
        gate.check_admission()  # 1 in flight + 2 queued = limit + max_queue
    release(gate)
    await settle()
    assert (gate.stats().in_flight, gate.stats().queued) == (1, 1)
    gate.check_admission()  # room for one again
    assert gate.stats().pending == 1
    assert reasons == ["queue_full", "queue_full"]


def test_check_admission_counts_n_requests_against_the_capacity() -> None:
    gate, _, reasons = make_gate(limit=2, max_queue=1)
    gate.check_admission(n=3)
    assert gate.stats().pending == 1  # one generate() call follows, whatever n is
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(n=3)  # behind the one pending: past the limit and the queue's 1
    assert exc.value.status == 429
    assert gate.stats().rejected_total == 3
    assert reasons == ["queue_full"]


@pytest.mark.parametrize(
    ("elapsed_s", "pending"),
    [(0.0, 1), (29.9, 1), (AdmissionGate.PENDING_TTL_S, 1), (30.1, 0), (3600.0, 0)],
)
def test_pending_admission_expires_after_ttl(elapsed_s: float, pending: int) -> None:
    gate, clock, _ = make_gate(limit=1, max_queue=0)
    gate.check_admission()
    clock.advance(elapsed_s)
    assert gate.stats().pending == pending


def test_expired_pending_frees_capacity() -> None:
    gate, clock, reasons = make_gate(limit=1, max_queue=0)
    gate.check_admission()  # never reaches the gate (say, it failed validation)
    with pytest.raises(GateRejected):
        gate.check_admission()
    clock.advance(30.5)
    gate.check_admission()
    assert gate.stats().pending == 1
    assert reasons == ["queue_full"]


# -- retry_after_s --------------------------------------------------------------------------------


async def complete_at(gate: AdmissionGate, clock: FakeClock, times: list[float]) -> None:
    """One request acquires and completes at each clock time in ``times``."""
    for t in times:
        clock.advance(t - clock.now)
        slot = await gate.acquire()
        gate.release(slot)


@pytest.mark.parametrize(
    ("completions", "now", "pending", "expected"),
    [
        ([], 1010.0, 0, 1),  # no data: 1 s
        ([1000.0], 1010.0, 0, 1),  # one completion is no rate
        # 5 completions in 1000..1010 s -> 0.5/s; backlog = pending + 1
        ([1000.0, 1002.0, 1004.0, 1006.0, 1008.0], 1010.0, 0, 2),  # 1 / 0.5
        ([1000.0, 1002.0, 1004.0, 1006.0, 1008.0], 1010.0, 3, 8),  # 4 / 0.5
        ([1000.0, 1002.0, 1004.0, 1006.0, 1008.0], 1010.0, 39, 60),  # 40 / 0.5 = 80, capped at 60
        # 10 completions in 1 s -> 10/s: 2 / 10 = 0.2 rounds up to 1
        ([1000.0 + i / 10 for i in range(10)], 1001.0, 1, 1),
        # only completions of the last 10 s count: 1006 and 1008 -> 2 / 10 s; 1 / 0.2 = 5
        ([1000.0, 1002.0, 1004.0, 1006.0, 1008.0], 1016.0, 0, 5),
        # all completions at the same instant as now: no measurable span
        ([1000.0, 1000.0], 1000.0, 0, 1),
    ],
)
async def test_retry_after_from_completion_rate(
    completions: list[float], now: float, pending: int, expected: int
) -> None:
    gate, clock, _ = make_gate(limit=1, max_queue=1000)
    await complete_at(gate, clock, completions)
    clock.advance(now - clock.now)
    for _ in range(pending):
        gate.check_admission()
    assert gate.retry_after_s() == expected


async def test_429_carries_retry_after() -> None:
    gate, clock, _ = make_gate(limit=1, max_queue=2)
    await complete_at(gate, clock, [1000.0, 1002.0, 1004.0, 1006.0, 1008.0])  # 0.5/s at t=1010
    clock.advance(1010.0 - clock.now)
    await gate.acquire()
    gate.check_admission()
    gate.check_admission()
    with pytest.raises(GateRejected) as exc:
        gate.check_admission()
    # 3 would wait for a gate that holds 2: the one beyond drains in 1 / 0.5/s
    assert (exc.value.status, exc.value.retry_after_s, exc.value.reason) == (429, 2, "queue_full")


# -- drain ----------------------------------------------------------------------------------------


async def test_stop_admitting_refuses_new_but_queued_ones_proceed() -> None:
    gate, _, reasons = make_gate(limit=1)
    await gate.acquire()
    waiters = Waiters(gate)
    await waiters.add("a")
    gate.stop_admitting()
    with pytest.raises(GateRejected) as exc:
        gate.check_admission()
    assert (exc.value.status, exc.value.retry_after_s) == (503, 1)
    assert reasons == ["shutting_down"]
    assert gate.stats().closed is True
    release(gate)
    await settle()
    assert waiters.granted == ["a"]
    assert (gate.stats().in_flight, gate.stats().queued) == (1, 0)


async def test_close_fails_queued_waiters_and_keeps_in_flight() -> None:
    gate, _, reasons = make_gate(limit=1)
    await gate.acquire()
    waiters = Waiters(gate)
    a = await waiters.add("a", priority=0)
    b = await waiters.add("b", priority=1)
    gate.close()
    await settle()
    for task in (a, b):
        assert isinstance(task.exception(), GateRejected)
        assert task.exception().status == 503  # type: ignore[union-attr]
    assert waiters.granted == []
    assert (gate.stats().in_flight, gate.stats().queued, gate.stats().closed) == (1, 0, True)
    assert gate.queued_by_class() == {"all": 0}
    with pytest.raises(GateRejected) as exc:
        await gate.acquire()
    assert exc.value.status == 503
    with pytest.raises(GateRejected):
        gate.check_admission()
    assert reasons == ["shutting_down"]
    release(gate)
    assert gate.stats().in_flight == 0


async def test_wait_idle_without_waiting() -> None:
    gate, _, _ = make_gate(limit=1)
    assert await gate.wait_idle(0.0) is True
    await gate.acquire()
    assert await gate.wait_idle(0.0) is False


# -- stats ----------------------------------------------------------------------------------------


async def test_stats_and_queue_depth() -> None:
    gate, clock, _ = make_gate(limit=2, max_queue=10)
    gate.check_admission()
    gate.check_admission()
    await gate.acquire()  # consumes one pending
    await gate.acquire()  # consumes the other
    waiters = Waiters(gate)
    for label, priority in (("a", 3), ("b", 1), ("c", 2), ("d", 1)):
        await waiters.add(label, priority)
    gate.check_admission()
    waiters.tasks["c"].cancel()
    await settle()
    release(gate)
    await settle()
    assert waiters.granted == ["b"]
    assert gate.queued_by_class() == {"all": 2}
    assert gate.stats() == stats(
        limit=2, in_flight=2, queued=2, pending=1, admitted_total=3, completed_total=1, arrivals_total=3
    )
    clock.advance(31.0)
    assert gate.stats().pending == 0


async def test_completion_rate_is_measured_over_the_last_ten_seconds() -> None:
    gate, clock, _ = make_gate(limit=4)
    for _ in range(3):
        await gate.acquire(0)
    assert gate.completion_rate() is None  # nothing completed yet
    release(gate)
    assert gate.completion_rate() is None  # one completion is no rate
    clock.advance(2.0)
    release(gate)
    clock.advance(2.0)
    release(gate)
    assert gate.completion_rate() == pytest.approx(3 / 4.0)
    clock.advance(7.0)  # t = 11: the completion at t = 0 left the window, those at 2 and 4 remain
    assert gate.completion_rate() == pytest.approx(2 / 9.0)
    clock.advance(10.0)
    assert gate.completion_rate() is None  # an idle gate has no rate, so it refuses nothing on it


def test_the_service_rate_is_what_is_in_flight_over_the_mean_hold_where_that_is_more() -> None:
    clock = FakeClock(0.0)
    rate = CompletionRate(clock)
    for _ in range(10):  # one completion a second, each held 2 s
        rate.record(held_s=2.0)
        clock.advance(1.0)
    assert (rate.per_second(), rate.mean_held_s()) == (pytest.approx(1.0), pytest.approx(2.0))
    assert rate.service_per_second(4) == pytest.approx(2.0)  # 4 in flight free a slot each 0.5 s
    assert rate.service_per_second(1) == pytest.approx(1.0)  # never below what was measured
    assert rate.service_per_second(0) == pytest.approx(1.0)
    clock.advance(5.0)  # t = 15: completions at 5..9 s remain
    rate.record(held_s=8.0)
    assert (rate.per_second(), rate.mean_held_s()) == (pytest.approx(6 / 10), pytest.approx(18 / 6))
    clock.advance(11.0)
    assert (rate.per_second(), rate.mean_held_s(), rate.service_per_second(4)) == (None, None, None)
    zero = CompletionRate(clock)
    for _ in range(3):  # holds too short to measure tell nothing: the completion rate stands
        zero.record()
        clock.advance(1.0)
    assert zero.service_per_second(4) == pytest.approx(3 / 3.0)

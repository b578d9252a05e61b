"""A request's tries counted once per gate: a refusal of a request with an ``X-Request-Id`` excuses the
next few arrivals of that id within a window, and each of them the gate refuses in turn is a retry
(``GateStats.retries_total``), which the capacity meter's offered rate leaves out; an excused arrival
that is admitted is demand, and the refusal of an excused try excuses nothing more. The memory of
refused ids is bounded in time and in number. On a fake clock."""

from __future__ import annotations

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.admission.retries import MAX_IDS, TRIES, WINDOW_S, RefusedIds
from controller.clock import FakeClock
from controller.control.capacity import CapacityMeter, new_arrivals
from controller.control.telemetry import TelemetryWindow

ONE_CLASS = (PriorityClass("all", max_queue=0, queue_deadline_s=1e6),)
ROOMY = (PriorityClass("all", max_queue=10, queue_deadline_s=1e6),)


async def full_gate(clock: FakeClock) -> AdmissionGate:
    """A gate whose one slot is taken and whose queue holds none: every arrival is refused."""
    gate = AdmissionGate(1, 0, ONE_CLASS, clock=clock)
    await gate.acquire()  # the slot a long request holds
    return gate


def arrive(gate: AdmissionGate, request_id: str | None) -> None:
    """One try: refused (the gate is full), and the refusal answered, as the engine client does."""
    retry = gate.take_retry(request_id)
    with pytest.raises(GateRejected):
        gate.check_admission()
    gate.refused(request_id, retry)


def counts(gate: AdmissionGate) -> tuple[int, int]:
    stats = gate.stats()
    return stats.arrivals_total, stats.retries_total


async def test_a_refused_id_arriving_again_is_a_retry() -> None:
    clock = FakeClock()
    gate = await full_gate(clock)
    arrive(gate, "r1")
    assert counts(gate) == (1, 0)
    for _ in range(4):  # vllm-router's four retries, about half a second
        clock.advance(0.1)
        arrive(gate, "r1")
    assert counts(gate) == (5, 4)
    arrive(gate, "r2")  # another request: new demand
    assert counts(gate) == (6, 4)


async def test_a_refusal_excuses_a_bounded_number_of_tries() -> None:
    """200 requests that all carry one id, all refused: each refusal of a new request excuses the next
    ``TRIES`` (a router's retries) and no refusal of an excused try excuses more, so one in
    ``TRIES + 1`` counts as new demand, however long the id is reused."""
    clock = FakeClock()
    gate = await full_gate(clock)
    for _ in range(200):
        clock.advance(0.01)
        arrive(gate, "fixed")
    arrivals, retries = counts(gate)
    assert arrivals == 200 and arrivals - retries == 200 // (TRIES + 1) == 40


async def test_the_refusal_of_an_excused_try_does_not_renew_the_window() -> None:
    clock = FakeClock()
    gate = await full_gate(clock)
    arrive(gate, "r1")
    clock.advance(WINDOW_S - 0.5)
    arrive(gate, "r1")  # within the window: a retry, whose refusal renews nothing
    assert counts(gate) == (2, 1)
    clock.advance(0.5)  # exactly a window after the refusal of the new request: forgotten
    arrive(gate, "r1")
    assert counts(gate) == (3, 1)
    clock.advance(WINDOW_S - 0.5)
    arrive(gate, "r1")  # that refusal was of a new request: it excuses again
    assert counts(gate) == (4, 2)


async def test_an_admitted_arrival_of_a_refused_id_is_new_demand() -> None:
    """A try of a refused id that the gate admits is work this replica serves: demand, never hidden.
    It takes one of the excused tries all the same."""
    clock = FakeClock()
    gate = AdmissionGate(1, 0, ONE_CLASS, clock=clock)
    held = await gate.acquire()
    arrive(gate, "r1")
    gate.release(held)
    before = new_arrivals(gate.stats())
    for _ in range(3):  # three requests with that id, each onto the free slot
        assert gate.take_retry("r1")
        gate.check_admission()
        gate.release(await gate.acquire())
    assert new_arrivals(gate.stats()) - before == 3
    held = await gate.acquire()
    arrive(gate, "r1")  # the last excused try, refused: a retry
    arrive(gate, "r1")  # none left: new demand, whose refusal excuses the next ones
    assert counts(gate) == (6, 1)


async def test_without_an_id_every_try_is_new_demand() -> None:
    clock = FakeClock()
    gate = await full_gate(clock)
    for _ in range(3):
        arrive(gate, None)
    assert counts(gate) == (3, 0)


def test_an_id_the_gate_admitted_is_not_a_retry() -> None:
    clock = FakeClock()
    gate = AdmissionGate(1, 10, ROOMY, clock=clock)
    for _ in range(2):
        assert not gate.take_retry("r1")
        gate.check_admission()
    assert counts(gate) == (2, 0)


def test_a_later_call_of_a_request_is_not_an_arrival() -> None:
    clock = FakeClock()
    gate = AdmissionGate(1, 10, ROOMY, clock=clock)
    request = gate.enter()
    request.admit(0)
    request.admit(0)  # its second call
    assert counts(gate) == (1, 0)


def test_the_refused_ids_are_bounded_in_number_oldest_first() -> None:
    clock = FakeClock()
    ids = RefusedIds(clock, window_s=60.0, max_ids=3)
    for name in ("a", "b", "c"):
        ids.refused(name)
        clock.advance(1.0)
    ids.refused("a")  # refused again: now the newest
    ids.refused("d")  # a fourth: "b", the oldest refusal, is forgotten
    assert len(ids) == 3
    assert [ids.take(name) for name in ("a", "b", "c", "d")] == [True, False, True, True]
    assert MAX_IDS == 10_000


def test_a_refusal_excuses_its_tries_then_none() -> None:
    ids = RefusedIds(FakeClock(), tries=2)
    ids.refused("a")
    assert [ids.take("a") for _ in range(3)] == [True, True, False]
    assert not ids.take("b")


def test_the_refused_ids_expire_in_time_without_arrivals() -> None:
    clock = FakeClock()
    ids = RefusedIds(clock, window_s=10.0, max_ids=100)
    for i in range(50):
        ids.refused(f"r{i}")
        clock.advance(0.1)  # 50 refusals over 5 s
    clock.advance(7.55)  # the first 26 (0 s to 2.5 s) are now more than 10 s old
    assert not ids.take("never")
    assert len(ids) == 24


def test_a_long_id_takes_no_more_memory_than_a_short_one() -> None:
    clock = FakeClock()
    ids = RefusedIds(clock, max_ids=2)
    ids.refused("x" * 100_000)
    assert ids.take("x" * 100_000) and not ids.take("x" * 99_999)
    assert all(isinstance(key, int) for key in ids._refused)


def test_refused_ids_refuse_a_window_size_or_tries_out_of_bounds() -> None:
    with pytest.raises(ValueError, match="window_s"):
        RefusedIds(FakeClock(), window_s=0.0)
    with pytest.raises(ValueError, match="max_ids"):
        RefusedIds(FakeClock(), max_ids=0)
    with pytest.raises(ValueError, match="tries"):
        RefusedIds(FakeClock(), tries=0)


async def test_the_offered_rate_counts_each_request_once_however_often_it_is_tried() -> None:
    """10 requests a second for 10 s, each refused and tried 4 more times (the router's five
    attempts): 50 tries a second reach the gate, the offered rate reads 10."""
    clock = FakeClock()
    gate = await full_gate(clock)
    meter = CapacityMeter(TelemetryWindow(10.0, clock), gate)
    assert meter._offered_rps(clock()) is None
    for second in range(10):
        for i in range(10):
            for _ in range(5):
                arrive(gate, f"s{second}-{i}")
        clock.advance(1.0)
        offered = meter._offered_rps(clock())
    assert counts(gate) == (500, 400)
    assert offered == 10.0

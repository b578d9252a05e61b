"""admission/gate.py: slots with a weight (a request's ``n`` sequences, a stream's prompts taken
together), granted all at once or not at all, and arrivals counted once per request.

No real time passes: a ``FakeClock`` and ``await asyncio.sleep(0)`` only.
"""

from __future__ import annotations

import asyncio

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.clock import FakeClock
from tests.helpers import settle

ONE_CLASS = (PriorityClass("all", max_queue=100_000, queue_deadline_s=1e6),)
TWO_CLASSES = (
    PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=1e6),
    PriorityClass("batch", min_priority=1, max_queue=100, queue_deadline_s=1e6, reserved_share=0.25),
)


def make_gate(limit: int, classes: tuple[PriorityClass, ...] = ONE_CLASS) -> AdmissionGate:
    return AdmissionGate(limit, 100, classes, clock=FakeClock())


async def test_a_weighted_slot_counts_its_weight_against_the_limit() -> None:
    gate = make_gate(limit=4)
    heavy = await gate.acquire(weight=3)
    assert (heavy.weight, gate.stats().in_flight) == (3, 3)
    light = await gate.acquire()
    second = asyncio.create_task(gate.acquire())
    await settle()
    assert not second.done() and gate.stats().queued == 1  # 3 + 1 fill the limit of 4
    gate.release(heavy)
    await settle()
    assert second.done() and gate.stats().in_flight == 2
    gate.release(light)
    gate.release(second.result())
    assert gate.stats().in_flight == 0


async def test_a_weighted_waiter_takes_its_slots_all_at_once_or_waits() -> None:
    gate = make_gate(limit=4)
    held = [await gate.acquire(), await gate.acquire()]
    heavy = asyncio.create_task(gate.acquire(weight=3))
    await settle()
    assert not heavy.done() and gate.stats().in_flight == 2  # nothing taken while it waits
    gate.release(held.pop())
    await settle()
    assert heavy.done() and heavy.result().weight == 3 and gate.stats().in_flight == 4


async def test_a_weight_above_the_limit_is_capped_and_runs_alone() -> None:
    gate = make_gate(limit=4)
    held = await gate.acquire()
    heavy = asyncio.create_task(gate.acquire(weight=64))
    await settle()
    assert not heavy.done()
    gate.release(held)
    await settle()
    assert heavy.result().weight == 4 and gate.stats().in_flight == 4


async def test_a_weight_is_capped_at_what_its_class_can_hold_beside_reservations() -> None:
    gate = make_gate(limit=4, classes=TWO_CLASSES)  # batch reserves 1 of 4
    slot = await gate.acquire(0, weight=16)
    assert slot.weight == 3


async def test_a_heavy_head_is_not_starved_by_lighter_requests_of_a_lower_class() -> None:
    gate = make_gate(limit=4, classes=TWO_CLASSES)
    held = [await gate.acquire(0) for _ in range(3)]
    heavy = asyncio.create_task(gate.acquire(0, weight=3))
    await settle()
    light = [asyncio.create_task(gate.acquire(5)) for _ in range(3)]
    await settle()
    gate.release(held.pop())  # 2 interactive in flight: the heavy head does not fit yet
    await settle()
    assert not heavy.done() and sum(t.done() for t in light) == 1  # batch's own reserved slot only
    for slot in held:
        gate.release(slot)
    await settle()
    assert heavy.done() and sum(t.done() for t in light) == 1


def test_arrivals_count_each_request_once_whatever_its_n_or_outcome() -> None:
    gate = AdmissionGate(1, 1, ONE_CLASS, clock=FakeClock())
    request = gate.enter()
    request.admit(0, 1)  # takes the free slot's place
    with pytest.raises(GateRejected):
        gate.check_admission(0, 2)  # refused: 2 sequences, one request, behind the one pending
    request.admit(0, 1)  # a further call of the admitted request
    stats = gate.stats()
    assert stats.arrivals_total == 2
    assert stats.rejected_total == 2  # refusals still count what was refused


def test_an_n_that_no_idle_gate_admits_is_answered_400_naming_the_bound_and_the_fix() -> None:
    """n = 16,384 (vLLM's most sequences) on an idle gate: the class's queue limit refuses it at every
    try, so it is a client error naming how many sequences fit, not a 429 to retry for ever; the
    largest n that fits is admitted (it runs alone under a slot capped at the limit)."""
    gate = AdmissionGate(64, 1024, clock=FakeClock())  # interactive: max_queue 256
    with pytest.raises(GateRejected) as refused:
        gate.enter().preflight(0, 16_384)
    assert (refused.value.status, refused.value.reason) == (400, "too_many_sequences")
    assert "at most 320 sequences" in refused.value.message
    assert "[admission.classes.interactive] max_queue = 256" in refused.value.message
    with pytest.raises(GateRejected):
        gate.check_admission(0, 321)
    stats = gate.stats()
    assert (stats.arrivals_total, stats.rejected_total, stats.pending) == (0, 0, 0)  # no demand, no overload
    gate.check_admission(0, 320)
    assert gate.stats().arrivals_total == 1


def test_an_n_past_the_gates_own_queue_limit_names_that_limit() -> None:
    gate = AdmissionGate(4, 2, TWO_CLASSES, clock=FakeClock())  # batch reserves 1 of the 4 slots
    with pytest.raises(GateRejected) as refused:
        gate.check_admission(0, 7)
    assert refused.value.status == 400 and "[admission] max_queue = 2" in refused.value.message
    gate.check_admission(0, 6)  # the limit's 4 and the gate's 2 queue places

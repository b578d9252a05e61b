"""controller/admission/gate.py with priority classes: routing, refusal math, Retry-After, deadlines, aging,
shedding order, reserved shares and reconfiguration. Every timestamp comes from a ``FakeClock``;
deadlines expire through ``expire_overdue`` (the timers do the same in production)."""

from __future__ import annotations

import asyncio

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected, Slot
from controller.clock import FakeClock
from tests.helpers import Events, Recorder, settle

INTERACTIVE = PriorityClass("interactive", max_priority=0, max_queue=4, queue_deadline_s=2.0)
BATCH = PriorityClass("batch", min_priority=1, max_queue=8, queue_deadline_s=30.0)
PATIENT = (
    PriorityClass("interactive", max_priority=0, max_queue=4, queue_deadline_s=1e6),
    PriorityClass("batch", min_priority=1, max_queue=8, queue_deadline_s=1e6),
)
"""Deadlines out of the way, for the tests of order and aging."""


def make(
    limit: int = 1,
    max_queue: int = 100,
    classes: tuple[PriorityClass, ...] = (INTERACTIVE, BATCH),
    aging_s: float = 0.0,
) -> tuple[AdmissionGate, FakeClock, Events]:
    clock, events = FakeClock(), Events()
    gate = AdmissionGate(limit, max_queue, classes, aging_s, clock=clock, events=Recorder([], events))
    return gate, clock, events


class Requests:
    """Tasks that acquire a slot; ``granted`` lists labels in grant order, ``slots`` their slots."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.granted: list[str] = []
        self.slots: dict[str, Slot] = {}
        self.refused: dict[str, GateRejected] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def _run(self, label: str, priority: int) -> None:
        try:
            self.slots[label] = await self.gate.acquire(priority)
        except GateRejected as exc:
            self.refused[label] = exc
            return
        self.granted.append(label)

    async def add(self, label: str, priority: int) -> None:
        self.tasks[label] = asyncio.create_task(self._run(label, priority))
        await settle()

    async def finish(self, label: str) -> None:
        self.gate.release(self.slots[label])
        await settle()


async def make_rate(gate: AdmissionGate, clock: FakeClock, per_s: float) -> None:
    """Completions ``1/per_s`` apart over the gate's 10 s rate window, the first exactly 10 s ago:
    a measured rate of ``per_s``."""
    for _ in range(round(10 * per_s)):
        slot = await gate.acquire(0)
        gate.release(slot)
        clock.advance(1.0 / per_s)


# -- routing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("priority", "cls"), [(-100, "interactive"), (0, "interactive"), (1, "batch"), (10**6, "batch")]
)
def test_priority_selects_its_class(priority: int, cls: str) -> None:
    gate, _, _ = make()
    assert gate.class_name(priority) == cls


async def test_slots_and_admissions_are_counted_per_class() -> None:
    gate, clock, events = make(limit=1)
    reqs = Requests(gate)
    await reqs.add("b1", 5)
    await reqs.add("i1", 0)
    clock.advance(0.5)
    await reqs.finish("b1")
    assert gate.in_flight_by_class() == {"interactive": 1, "batch": 0}
    assert events.admitted == [("batch", 0.0), ("interactive", 0.5)]


# -- strict priority and aging --------------------------------------------------------------------


async def one_slot_held(aging_s: float, hold_priority: int = 0, batch: int = 1) -> tuple[FakeClock, Requests]:
    """One slot (deadlines out of the way), taken by "hold"; batch requests b0, b1, ... wait behind it."""
    gate, clock, _ = make(limit=1, classes=PATIENT, aging_s=aging_s)
    reqs = Requests(gate)
    await reqs.add("hold", hold_priority)
    for i in range(batch):
        await reqs.add(f"b{i}", 3)
    return clock, reqs


async def test_interactive_never_waits_behind_batch_without_aging() -> None:
    clock, reqs = await one_slot_held(0.0, hold_priority=5, batch=3)
    clock.advance(100.0)  # however long batch waited
    await reqs.add("i0", 0)
    await reqs.finish("hold")
    assert reqs.granted == ["hold", "i0"]


async def test_aging_lets_an_old_batch_request_take_one_slot_per_aging_period() -> None:
    clock, reqs = await one_slot_held(5.0, batch=2)
    clock.advance(1.0)
    for i in range(4):
        await reqs.add(f"i{i}", 0)
    clock.advance(4.0)  # b0 has waited 5 s = aging_s; batch got no slot for 5 s
    await reqs.finish("hold")
    assert reqs.granted[-1] == "b0"
    await reqs.finish("b0")  # batch just got a slot: interactive goes first again
    assert reqs.granted[-1] == "i0"
    clock.advance(5.0)
    await reqs.finish("i0")
    assert reqs.granted[-1] == "b1"  # another aging period: batch again
    await reqs.finish("b1")
    await reqs.finish("i1")
    assert reqs.granted == ["hold", "b0", "i0", "b1", "i1", "i2"]


async def test_aging_of_zero_is_pure_strict_priority() -> None:
    clock, reqs = await one_slot_held(0.0)
    await reqs.add("i0", 0)
    clock.advance(1000.0)
    await reqs.finish("hold")
    assert reqs.granted == ["hold", "i0"]


# -- refusal: queue bounds, expected wait, Retry-After ---------------------------------------------


def test_class_queue_full_refuses_that_class_only() -> None:
    gate, _, events = make(limit=1)
    for _ in range(1 + INTERACTIVE.max_queue):  # one takes the slot, four wait
        gate.check_admission(0)
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0)
    assert (exc.value.status, exc.value.reason) == (429, "queue_full")
    assert "interactive requests already wait (queue limit 4)" in exc.value.message
    gate.check_admission(5)  # batch has its own queue
    assert events.rejected == [("interactive", "queue_full")]


async def test_expected_wait_beyond_the_deadline_is_refused_at_once() -> None:
    roomy = PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=2.0)
    gate, clock, events = make(limit=1, classes=(roomy, BATCH))
    await make_rate(gate, clock, per_s=2.0)  # 2 completions/s
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    for _ in range(3):
        gate.check_admission(0)  # positions 1..3: 0.5, 1.0, 1.5 s <= 2 s
    gate.check_admission(0)  # position 4: 2.0 s, still within the deadline
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0)  # position 5: 2.5 s > 2 s
    assert (exc.value.status, exc.value.reason) == (429, "expected_wait")
    assert "expected wait 2.5s exceeds the interactive queue deadline of 2s" in exc.value.message
    # Retry-After: the backlog beyond what the deadline allows (5 - 2/s * 2 s = 1) drains in 0.5 s -> 1
    assert exc.value.retry_after_s == 1
    assert events.rejected == [("interactive", "expected_wait")]


async def test_batch_counts_interactive_work_ahead_so_it_sheds_first() -> None:
    gate, clock, events = make(limit=1)
    await make_rate(gate, clock, per_s=1.0)
    reqs = Requests(gate)
    await reqs.add("hold", 5)
    batch = PriorityClass("batch", min_priority=1, max_queue=8, queue_deadline_s=3.0)
    gate.configure((INTERACTIVE, batch), 0.0, 100)
    gate.check_admission(0)
    gate.check_admission(0)  # interactive: positions 1, 2 (<= 2 s)
    gate.check_admission(5)  # batch: position 3 behind both interactive: 3 s <= 3 s
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(5)  # 4 s > 3 s
    assert exc.value.reason == "expected_wait"
    assert exc.value.retry_after_s == 1  # 4 - 1/s * 3 s = 1 request beyond -> 1 s
    with pytest.raises(GateRejected):
        gate.check_admission(0)  # interactive ignores batch: position 3 at 1/s = 3 s > 2 s
    assert events.rejected == [("batch", "expected_wait"), ("interactive", "expected_wait")]


async def test_retry_after_grows_with_the_backlog_and_caps_at_60() -> None:
    gate, clock, _ = make(limit=1, classes=(PriorityClass("all", max_queue=1000, queue_deadline_s=10.0),))
    await make_rate(gate, clock, per_s=0.5)  # a 2 s service time
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    for _ in range(5):
        gate.check_admission(0)  # positions 1..5: 2..10 s
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0)  # position 6: 12 s > 10 s; one beyond -> 2 s
    assert exc.value.retry_after_s == 2
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0, n=40)  # 45 positions: 40 beyond at 0.5/s = 80 s, capped
    assert exc.value.retry_after_s == 60


# -- deadlines ------------------------------------------------------------------------------------


async def test_a_waiter_past_its_deadline_gets_429_and_leaves_the_queue() -> None:
    gate, clock, events = make(limit=1)
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    await reqs.add("i0", 0)
    await reqs.add("b0", 5)
    clock.advance(1.9)
    assert gate.expire_overdue() == 0
    clock.advance(0.1)  # interactive deadline (2 s) reached; batch has 30 s
    assert gate.expire_overdue() == 1
    await settle()
    error = reqs.refused["i0"]
    assert (error.status, error.reason) == (429, "deadline")
    assert "past the interactive deadline of 2s" in error.message
    assert gate.queued_by_class() == {"interactive": 0, "batch": 1}
    assert events.timed_out == [("interactive", pytest.approx(2.0))]
    assert gate.stats().timed_out_total == 1
    await reqs.finish("hold")
    assert reqs.granted == ["hold", "b0"]


async def test_time_paused_for_an_engine_restart_does_not_count_against_deadlines() -> None:
    gate, clock, _ = make(limit=1)
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    await reqs.add("i0", 0)
    clock.advance(1.0)
    gate.pause()  # the guard restarts the engine; queued requests are kept
    clock.advance(30.0)
    assert gate.expire_overdue() == 0
    gate.resume()
    clock.advance(0.9)  # 1.9 s of the 2 s deadline counted
    assert gate.expire_overdue() == 0
    clock.advance(0.1)
    assert gate.expire_overdue() == 1
    await settle()
    assert reqs.refused["i0"].reason == "deadline"
    assert "waited 32.0s" in reqs.refused["i0"].message


async def test_a_slot_freed_after_the_deadline_but_before_the_timer_is_not_granted_late() -> None:
    gate, clock, events = make(limit=1)
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    await reqs.add("i0", 0)
    await reqs.add("i1", 0)
    clock.advance(1.0)
    await reqs.add("i2", 0)
    clock.advance(1.5)  # i0, i1 are past 2 s; their timers (real time) have not fired
    await reqs.finish("hold")
    assert reqs.granted == ["hold", "i2"]
    assert sorted(reqs.refused) == ["i0", "i1"]
    assert [cls for cls, _ in events.timed_out] == ["interactive", "interactive"]
    assert max(wait for _, wait in events.admitted) <= INTERACTIVE.queue_deadline_s


async def test_deadline_timer_fires_on_the_event_loop() -> None:
    """The production path: a real (short) deadline, the loop's timer, the monotonic clock."""
    gate = AdmissionGate(1, 10, (PriorityClass("all", queue_deadline_s=0.05),))
    held = await gate.acquire(0)
    with pytest.raises(GateRejected) as exc:
        await asyncio.wait_for(gate.acquire(0), timeout=2.0)
    assert exc.value.reason == "deadline"
    assert gate.stats().queued == 0
    gate.release(held)


async def test_a_granted_request_never_waited_past_its_deadline() -> None:
    gate, clock, events = make(limit=2)
    reqs = Requests(gate)
    for i in range(12):
        await reqs.add(f"r{i}", i % 3 - 1)  # -1, 0 interactive; 1 batch
        clock.advance(0.3)
        gate.expire_overdue()
        if i % 2:
            await reqs.finish(reqs.granted[0])
            reqs.granted.pop(0)
    deadlines = {"interactive": INTERACTIVE.queue_deadline_s, "batch": BATCH.queue_deadline_s}
    assert all(wait <= deadlines[cls] for cls, wait in events.admitted)


# -- shedding -------------------------------------------------------------------------------------


async def test_full_gate_sheds_the_newest_lowest_class_waiter_first() -> None:
    lowest = PriorityClass("bulk", min_priority=10, max_queue=8, queue_deadline_s=30.0)
    batch = PriorityClass("batch", min_priority=1, max_priority=9, max_queue=8, queue_deadline_s=30.0)
    gate, _, events = make(limit=1, max_queue=3, classes=(INTERACTIVE, batch, lowest))
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    await reqs.add("b0", 5)
    await reqs.add("x0", 10)
    await reqs.add("x1", 10)
    gate.check_admission(5)  # batch arrives into a full gate: bulk's newest (x1) is shed
    await settle()
    assert reqs.refused["x1"].reason == "shed"
    gate.check_admission(0)  # interactive: bulk's next (x0)
    await settle()
    assert reqs.refused["x0"].reason == "shed"
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(10)  # bulk itself has nobody below to shed: refused
    assert exc.value.reason == "queue_full"
    assert events.rejected == [("bulk", "shed"), ("bulk", "shed"), ("bulk", "queue_full")]
    assert not reqs.tasks["b0"].done()


async def test_the_preflight_sheds_nobody_and_the_calls_own_check_does() -> None:
    lowest = PriorityClass("bulk", min_priority=10, max_queue=8, queue_deadline_s=30.0)
    batch = PriorityClass("batch", min_priority=1, max_priority=9, max_queue=8, queue_deadline_s=30.0)
    gate, _, events = make(limit=1, max_queue=2, classes=(INTERACTIVE, batch, lowest))
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    await reqs.add("x0", 10)
    await reqs.add("x1", 10)
    request = gate.enter()
    request.preflight(5)  # room only by shedding: passes, sheds nobody
    await settle()
    assert reqs.refused == {} and events.rejected == []
    request.admit(5)  # its call, the prompt's length known: sheds x1
    await settle()
    assert reqs.refused["x1"].reason == "shed"
    with pytest.raises(GateRejected) as exc:
        gate.enter().preflight(10)  # nobody below bulk to shed: refused at once
    assert exc.value.reason == "queue_full"
    assert not reqs.tasks["x0"].done()


# -- reserved shares ------------------------------------------------------------------------------


async def test_reserved_share_keeps_slots_free_for_its_class() -> None:
    interactive = PriorityClass("interactive", max_priority=0, queue_deadline_s=2.0, reserved_share=0.5)
    gate, _, _ = make(limit=4, classes=(interactive, BATCH))
    reqs = Requests(gate)
    for i in range(4):
        await reqs.add(f"b{i}", 5)
    assert reqs.granted == ["b0", "b1"]  # two of four slots are interactive's
    await reqs.add("i0", 0)
    await reqs.add("i1", 0)
    await reqs.add("i2", 0)  # interactive may use every free slot, shared ones included
    assert reqs.granted == ["b0", "b1", "i0", "i1"]
    await reqs.finish("b0")
    assert reqs.granted[-1] == "i2"  # a shared slot goes to the most urgent class
    await reqs.finish("i0")
    assert reqs.granted[-1] == "b2"  # interactive still holds its two reserved slots: this one is shared
    await reqs.finish("i1")
    assert reqs.granted[-1] == "b2"  # a reserved slot stays interactive's: b3 waits
    assert gate.queued_by_class() == {"interactive": 0, "batch": 1}


async def test_reserved_share_counts_in_admission_math() -> None:
    batch = PriorityClass("batch", min_priority=1, max_queue=1, queue_deadline_s=30.0, reserved_share=0.5)
    gate, _, _ = make(limit=2, classes=(INTERACTIVE, batch))
    reqs = Requests(gate)
    await reqs.add("i0", 0)
    gate.check_admission(0)  # slot 2 is batch's: interactive would wait (position 1)
    gate.check_admission(5)  # batch takes its reserved slot
    gate.check_admission(5)  # batch waits: 1 <= max_queue 1
    with pytest.raises(GateRejected):
        gate.check_admission(5)


# -- pending and reconfiguration ------------------------------------------------------------------


def test_cancel_pending_gives_the_place_back() -> None:
    gate, _, _ = make(limit=1)
    for _ in range(5):
        gate.check_admission(0)
    with pytest.raises(GateRejected):
        gate.check_admission(0)
    gate.cancel_pending(0)  # vLLM answered 400 after admission
    gate.check_admission(0)
    assert gate.stats().pending == 5


async def test_configure_moves_waiters_to_their_new_class_and_rearms_deadlines() -> None:
    gate, clock, events = make(limit=1)
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    await reqs.add("b3", 3)
    await reqs.add("b1", 1)
    clock.advance(3.0)
    urgent = PriorityClass("interactive", max_priority=1, max_queue=4, queue_deadline_s=2.0)
    rest = PriorityClass("rest", min_priority=2, max_queue=8, queue_deadline_s=30.0)
    gate.configure((urgent, rest), 0.0, 100)
    await settle()
    # b1 is interactive now and has waited 3 s > 2 s: refused at once; b3 moved to "rest"
    assert reqs.refused["b1"].reason == "deadline"
    assert gate.queued_by_class() == {"interactive": 0, "rest": 1}
    assert [c.name for c in gate.classes] == ["interactive", "rest"]
    await reqs.finish("hold")
    assert reqs.granted == ["hold", "b3"]
    assert events.timed_out[0][0] == "interactive"


async def test_dead_entries_do_not_accumulate() -> None:
    gate, clock, _ = make(limit=1)
    reqs = Requests(gate)
    await reqs.add("hold", 0)
    for round_ in range(50):
        for i in range(4):
            await reqs.add(f"b{round_}.{i}", 5)
        clock.advance(31.0)
        gate.expire_overdue()
    await settle()
    queue = gate._order[1]
    assert queue.queued == 0
    assert len(queue.heap) <= 2 * queue.queued + 16

"""A class that serves the shortest prompt first (``order = "shortest"``): who gets the next slot, what
a request's expected wait counts, the deadline of a long prompt overtaken, and the class table's
check of the setting. Every timestamp comes from a ``FakeClock``."""

from __future__ import annotations

import asyncio

import pytest

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected, Slot
from controller.clock import FakeClock
from controller.config.classes_table import parse_classes
from tests.helpers import settle

SHORTEST = PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=2.0, order="shortest")
ARRIVAL = PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=2.0)
BATCH = PriorityClass("batch", min_priority=1, max_queue=100, queue_deadline_s=60.0)


class Waiting:
    """Requests that wait for the gate's one slot; ``granted`` lists their labels in grant order."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate, self.granted, self.slots = gate, list[str](), dict[str, Slot]()
        self.refused: dict[str, GateRejected] = {}
        self.tasks: list[asyncio.Task[None]] = []

    async def _run(self, label: str, priority: int, tokens: int) -> None:
        try:
            self.slots[label] = await self.gate.acquire(priority, prompt_tokens=tokens)
        except GateRejected as exc:
            self.refused[label] = exc
            return
        self.granted.append(label)

    async def add(self, label: str, tokens: int, priority: int = 0) -> None:
        self.tasks.append(asyncio.create_task(self._run(label, priority, tokens)))
        await settle()

    async def drain(self) -> None:
        """Release each slot as it is granted until nobody waits."""
        done = 0
        while done < len(self.granted):
            self.gate.release(self.slots[self.granted[done]])
            done += 1
            await settle()


async def busy_gate(cls: PriorityClass, per_s: float = 2.0) -> tuple[AdmissionGate, FakeClock, Waiting]:
    """A gate of limit 1 whose measured rate is ``per_s`` slots a second, its slot held by "hold"."""
    clock = FakeClock()
    gate = AdmissionGate(1, 1000, (cls, BATCH), clock=clock)
    for _ in range(round(10 * per_s)):
        gate.release(await gate.acquire(0))
        clock.advance(1.0 / per_s)
    waiting = Waiting(gate)
    await waiting.add("hold", 1)
    return gate, clock, waiting


async def test_the_shortest_prompt_gets_the_next_slot_then_arrival_breaks_ties() -> None:
    _, _, waiting = await busy_gate(SHORTEST)
    for label, tokens in [("long", 900), ("short-a", 20), ("mid", 300), ("short-b", 20)]:
        await waiting.add(label, tokens)
    await waiting.drain()
    assert waiting.granted == ["hold", "short-a", "short-b", "mid", "long"]


async def test_in_arrival_order_the_prompt_length_changes_nothing() -> None:
    _, _, waiting = await busy_gate(ARRIVAL)
    for label, tokens in [("long", 900), ("short-a", 20), ("mid", 300)]:
        await waiting.add(label, tokens)
    await waiting.drain()
    assert waiting.granted == ["hold", "long", "short-a", "mid"]


async def test_priority_still_comes_before_the_prompt_length_within_the_class() -> None:
    wide = PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=2.0, order="shortest")
    _, _, waiting = await busy_gate(wide)
    await waiting.add("short-later", 10, priority=0)
    await waiting.add("long-urgent", 900, priority=-5)
    await waiting.drain()
    assert waiting.granted == ["hold", "long-urgent", "short-later"]


async def test_the_expected_wait_counts_only_the_waiters_a_request_would_queue_behind() -> None:
    gate, _, waiting = await busy_gate(SHORTEST, per_s=2.0)
    for i in range(4):
        await waiting.add(f"long-{i}", 1000)
    # A short prompt queues ahead of the four long ones: position 1 at 2 slots/s is 0.5 s <= 2 s.
    gate.check_admission(0, prompt_tokens=10)
    gate.cancel_pending(0)
    # A prompt as long as theirs queues behind them: position 5 is 2.5 s > 2 s.
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0, prompt_tokens=1000)
    assert exc.value.reason == "expected_wait"
    assert "expected wait 2.5s exceeds the interactive queue deadline of 2s" in exc.value.message


async def test_in_arrival_order_a_short_prompt_waits_behind_everyone() -> None:
    gate, _, waiting = await busy_gate(ARRIVAL, per_s=2.0)
    for i in range(4):
        await waiting.add(f"long-{i}", 1000)
    with pytest.raises(GateRejected) as exc:
        gate.check_admission(0, prompt_tokens=10)
    assert "expected wait 2.5s" in exc.value.message


async def test_a_long_prompt_overtaken_by_shorter_ones_is_refused_at_its_deadline() -> None:
    gate, clock, waiting = await busy_gate(SHORTEST)
    await waiting.add("long", 900)
    for i in range(3):  # each short one takes the slot the long one waited for
        await waiting.add(f"short-{i}", 10)
        gate.release(waiting.slots[waiting.granted[-1]])
        await settle()
        clock.advance(0.6)
    assert waiting.granted == ["hold", "short-0", "short-1", "short-2"]
    assert gate.expire_overdue() == 0  # 1.8 s waited of its 2 s
    clock.advance(0.3)
    assert gate.expire_overdue() == 1
    await settle()
    assert waiting.refused["long"].status == 429
    assert waiting.refused["long"].reason == "deadline"


def test_the_class_table_reads_the_order_and_names_the_choices() -> None:
    errors: list[str] = []
    classes = parse_classes({"chat": {"order": "shortest"}}, errors)
    assert errors == []
    assert classes[0].shortest_first
    parse_classes({"chat": {"order": "longest"}}, errors)
    assert errors == [
        "[admission.classes.chat] order = 'longest': must be one of 'arrival', 'shortest'. "
        "Who of the class's waiters goes first: arrival, or the shortest prompt."
    ]
    errors.clear()
    parse_classes({"chat": {"ordr": "shortest"}}, errors)
    assert errors == ["[admission.classes.chat] unknown key 'ordr': did you mean 'order'?"]


def test_the_gate_asks_for_prompt_lengths_only_where_it_uses_them() -> None:
    assert not AdmissionGate(1, 10, (ARRIVAL, BATCH), clock=FakeClock()).uses_prompt_length
    assert AdmissionGate(1, 10, (SHORTEST, BATCH), clock=FakeClock()).uses_prompt_length

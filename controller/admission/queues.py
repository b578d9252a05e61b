"""The gate's data: slots, stats, and one priority class's queue of waiters."""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import deque
from dataclasses import dataclass

from controller.admission.classes import PriorityClass


@dataclass(frozen=True)
class Slot:
    """A granted place inside the engine; give it back with ``release``."""

    cls: str
    granted_mono: float
    weight: int = 1
    """How much of the limit it holds: the sequences its call runs in the engine (``n``), at most
    what its class can ever hold."""


@dataclass(frozen=True)
class GateStats:
    """A snapshot of the gate for /state, metrics and the control loop."""

    limit: int
    in_flight: int
    """Slots held, each counted by its weight: the sequences inside the engine."""
    queued: int
    """Requests waiting in the gate for a slot."""
    pending: int
    """Requests that passed check_admission but have not reached the gate yet."""
    admitted_total: int
    rejected_total: int
    completed_total: int
    closed: bool
    timed_out_total: int = 0
    """Requests refused because their queue deadline passed while they waited."""
    arrivals_total: int = 0
    """Requests that reached admission, each try counted once whatever its prompts, ``n`` or outcome;
    a router's or a client's retry of a refused request is a further arrival."""
    retries_total: int = 0
    """Of ``arrivals_total``, the tries refused in turn of a request this gate refused within the
    last minute (by its ``X-Request-Id``, a bounded number per refusal and never an admitted one:
    ``retries.py``): offered load is ``arrivals_total - retries_total`` (``control/capacity.py``)."""


@dataclass(eq=False)
class Waiter:
    priority: int
    seq: int
    enqueued_mono: float
    future: asyncio.Future[Slot]
    queue: ClassQueue
    paused_at_enqueue_s: float = 0.0
    """The gate's paused seconds when this request queued (paused time does not count)."""
    weight: int = 1
    """The weight it asked for (``Slot.weight``; capped when granted)."""
    deadline_from_mono: float | None = None
    """What its queue deadline counts from: when it queued, or under a TTFT bound when it reached
    the server (None: when it queued)."""
    ttft_bound_s: float | None = None
    """Its own TTFT bound (a gateway's header), which only tightens its class's; None without one."""
    prompt_tokens: int = 0
    """Tokens its prompt prefills, where known (0: unknown); ranks it in a ``shortest`` class."""
    timer: asyncio.TimerHandle | None = None


class ClassQueue:
    """One class's waiters (priority, then arrival or, in a ``shortest`` class, prompt length then
    arrival) and its pending admissions."""

    def __init__(self, spec: PriorityClass) -> None:
        self.spec = spec
        self.heap: list[tuple[int, int, int, Waiter]] = []
        self.queued = 0
        self.pending: deque[float] = deque()
        self.last_grant_mono = -math.inf

    def head(self) -> Waiter | None:
        while self.heap and self.heap[0][3].future.done():  # cancelled, expired or shed
            heapq.heappop(self.heap)
        return self.heap[0][3] if self.heap else None

    def live(self) -> list[Waiter]:
        return [e[3] for e in self.heap if not e[3].future.done()]

    def _rank(self, prompt_tokens: int | None) -> int:
        return (prompt_tokens or 0) if self.spec.shortest_first else 0

    def push(self, w: Waiter) -> None:
        """Queue ``w`` in its place (``head`` is the next to get a slot)."""
        heapq.heappush(self.heap, (w.priority, self._rank(w.prompt_tokens), w.seq, w))
        self.queued += 1

    def ahead_of(self, priority: int, prompt_tokens: int | None) -> int:
        """Waiters that a request of ``priority`` and ``prompt_tokens`` would queue behind: all of
        them in arrival order; in a ``shortest`` class, those of a more urgent priority or of the
        same with as short a prompt (a prompt of unknown length ranks as the shortest)."""
        if not self.spec.shortest_first:
            return self.queued
        mine = (priority, self._rank(prompt_tokens))
        return sum(1 for e in self.heap if e[:2] <= mine and not e[3].future.done())

    def expire_pending(self, horizon: float) -> None:
        """Forget pending admissions older than ``horizon`` (their request never reached the gate)."""
        while self.pending and self.pending[0] < horizon:
            self.pending.popleft()

    def compact(self) -> None:
        """Drop finished entries once they outnumber the live ones (memory stays flat)."""
        if len(self.heap) > 2 * self.queued + 16:
            self.heap = [e for e in self.heap if not e[3].future.done()]
            heapq.heapify(self.heap)

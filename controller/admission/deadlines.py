"""Queue deadlines that stand still while the gate is paused.

A waiter's deadline is its enqueue time (under a TTFT bound, when it reached the server) plus its
class's queue deadline (under a TTFT bound, its class's or its own, cut by the measured time from a
slot to the first token: ``ttft.AfterSlot``), plus the time the gate has been paused since it
arrived (engine restarts), up to ``max_pause_s`` (``[guard] max_restart_wait_s``): a request queued
through a short restart is kept, as the guard promises, but one never waits without bound through
failed rebuilds. Its total wait is at most ``queue_deadline_s + max_pause_s``. Each waiter has one
timer on the event loop; a fake clock in tests moves deadlines without waiting (the gate's
``expire_overdue`` then refuses the overdue ones).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from controller.admission.classes import PriorityClass
from controller.admission.queues import Waiter
from controller.clock import Clock


class Deadlines:
    """The pause bookkeeping and the per-waiter timers; ``on_expire`` refuses a waiter past its
    deadline."""

    def __init__(
        self,
        clock: Clock,
        on_expire: Callable[[Waiter], None],
        max_pause_s: float = math.inf,
        queue_deadline_s: Callable[[PriorityClass, float | None], float] | None = None,
    ) -> None:
        self._clock = clock
        self._on_expire = on_expire
        self.queue_deadline_s = queue_deadline_s or (lambda spec, _: spec.queue_deadline_s)
        """A class's queue deadline now for a request with its own TTFT bound or None (the gate's:
        shorter under SLO steering as the measured time from a slot to the first token grows, and
        under a request's own bound, ``ttft.AfterSlot.queue_deadline_s``)."""
        self.max_pause_s = max_pause_s
        """Paused seconds that stop a waiter's clock at most (the rest of a pause counts)."""
        self.paused = False
        self._paused_total_s = 0.0
        self._paused_since: float | None = None

    def pause(self) -> None:
        if not self.paused:
            self._paused_since = self._clock()
        self.paused = True

    def resume(self) -> None:
        if self._paused_since is not None:
            self._paused_total_s += self._clock() - self._paused_since
            self._paused_since = None
        self.paused = False

    def paused_s(self) -> float:
        """Seconds the gate has been paused in all: not counted against deadlines."""
        current = 0.0 if self._paused_since is None else self._clock() - self._paused_since
        return self._paused_total_s + current

    def deadline(self, w: Waiter) -> float:
        paused = min(self.paused_s() - w.paused_at_enqueue_s, self.max_pause_s)
        start = w.enqueued_mono if w.deadline_from_mono is None else w.deadline_from_mono
        return start + self.queue_deadline_s(w.queue.spec, w.ttft_bound_s) + paused

    def arm(self, w: Waiter) -> None:
        delay = max(0.0, self.deadline(w) - self._clock())
        if self.paused:
            delay = max(delay, 0.25)  # the deadline moves while paused: look again later
        w.timer = asyncio.get_running_loop().call_later(delay, self._on_timer, w)

    def _on_timer(self, w: Waiter) -> None:
        w.timer = None
        if w.future.done():
            return
        if self._clock() < self.deadline(w):
            self.arm(w)  # the loop's clock ran ahead of ours
        else:
            self._on_expire(w)

"""The admission gate: how many requests may be inside the engine at once, and who goes next.

Requests beyond the limit wait here in a priority queue (lower ``priority`` first, then arrival), so
priority is strict even when vLLM's running set is full. The limit moves at runtime. No vLLM import:
the engine client in ``controller/engine`` adapts the gate's errors to HTTP.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from controller.clock import Clock, monotonic


def _shutting_down() -> GateRejected:
    return GateRejected("the server is shutting down; retry on another instance", 503, 1)


class GateRejected(Exception):
    """The request is refused before it starts (HTTP 429 or 503)."""

    def __init__(self, message: str, status: int, retry_after_s: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class GateStats:
    """A snapshot of the gate for /state, metrics and the control loop."""

    limit: int
    in_flight: int
    """Requests holding a slot (inside the engine)."""
    queued: int
    """Requests waiting in the gate for a slot."""
    pending: int
    """Requests that passed check_admission but have not reached the gate yet."""
    admitted_total: int
    rejected_total: int
    completed_total: int
    closed: bool


@dataclass
class _Waiter:
    priority: int
    future: asyncio.Future[None]


class AdmissionGate:
    """A runtime-adjustable concurrency limit with a strict-priority wait queue.

    ``check_admission`` runs before a response starts (vLLM calls it from its handlers); it counts the
    request as *pending* until ``acquire`` sees it, because a burst passes admission before anything
    reaches the gate. Requests are refused with 429 when in-flight + queued + pending would exceed
    ``limit + max_queue``.
    """

    PENDING_TTL_S = 30.0
    """A pending admission that never reaches the gate (the request failed validation) expires."""

    def __init__(
        self,
        limit: int,
        max_queue: int,
        clock: Clock = monotonic,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self._limit = limit
        self.max_queue = max_queue
        self._clock = clock
        self._in_flight = 0
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._queued = 0
        self._seq = itertools.count()
        self._pending: deque[float] = deque()
        self._completions: deque[float] = deque(maxlen=256)
        self._paused = False
        self._refuse_new: tuple[GateRejected, str] | None = None
        """When set, check_admission raises this error, counted under this reason."""
        self._refuse_queued: GateRejected | None = None
        """When set, acquire raises it too: nobody else gets in."""
        self._on_reject = on_reject or (lambda reason: None)
        self.admitted_total = 0
        self.rejected_total = 0
        self.completed_total = 0

    # -- limit ------------------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        return self._limit

    def set_limit(self, limit: int) -> None:
        """Change the limit; raising it admits waiters at once, lowering it never evicts anyone."""
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self._limit = limit
        self._wake()

    # -- admission --------------------------------------------------------------------------------
    def _expire_pending(self) -> None:
        horizon = self._clock() - self.PENDING_TTL_S
        while self._pending and self._pending[0] < horizon:
            self._pending.popleft()

    def check_admission(self, n: int = 1) -> None:
        """Refuse now (raise ``GateRejected``) or count ``n`` requests as pending."""
        if self._refuse_new is not None:
            error, reason = self._refuse_new
            self._on_reject(reason)
            raise error
        self._expire_pending()
        demand = self._in_flight + self._queued + len(self._pending) + n
        if demand > self._limit + self.max_queue:
            self.rejected_total += n
            self._on_reject("queue_full")
            raise GateRejected(
                f"overloaded: {self._queued} requests already wait for {self._limit} slots "
                f"(queue limit {self.max_queue}); retry later",
                429,
                self.retry_after_s(),
            )
        self._pending.append(self._clock())  # one generate() call follows, whatever n is

    def retry_after_s(self) -> int:
        """Seconds until the queue ahead has likely drained, from the measured completion rate."""
        now = self._clock()
        recent = [t for t in self._completions if t >= now - 30.0]
        backlog = self._queued + len(self._pending) + 1
        if len(recent) < 2 or now - recent[0] <= 0:
            return 1
        rate = len(recent) / (now - recent[0])
        return max(1, min(60, round(backlog / rate)))

    async def acquire(self, priority: int = 0) -> None:
        """Wait for a slot. Strict priority: a lower value always goes first."""
        if self._pending:
            self._pending.popleft()
        if self._refuse_queued is not None:
            raise self._refuse_queued
        if not self._paused and self._in_flight < self._limit and self._queued == 0:
            self._take()
            return
        waiter = _Waiter(priority, asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, (priority, next(self._seq), waiter))
        self._queued += 1
        try:
            await waiter.future
        except BaseException:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release()  # granted and cancelled in the same instant: give the slot back
            elif waiter.future.cancelled() or not waiter.future.done():
                # Task.cancel() cancels the future we await, so a cancelled future is the usual case
                # here; only _wake (result) and close (exception) uncount a waiter themselves.
                waiter.future.cancel()
                self._queued -= 1
            raise

    def _take(self) -> None:
        self._in_flight += 1
        self.admitted_total += 1

    def release(self) -> None:
        """Give a slot back (completion, error, abort or disconnect)."""
        self._in_flight -= 1
        self.completed_total += 1
        self._completions.append(self._clock())
        self._wake()

    def _wake(self) -> None:
        while self._heap and not self._paused and self._in_flight < self._limit:
            _, _, waiter = heapq.heappop(self._heap)
            if waiter.future.done():  # cancelled while queued; already uncounted
                continue
            self._queued -= 1
            self._take()
            waiter.future.set_result(None)

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    # -- drain, pause, refuse ---------------------------------------------------------------------
    def stop_admitting(self) -> None:
        """Refuse new requests (503); queued and in-flight ones go on (graceful drain)."""
        self._refuse_new = (_shutting_down(), "shutting_down")

    def close(self) -> None:
        """Refuse new requests; those already queued are refused too (503), in-flight ones finish."""
        self.refuse_all(_shutting_down(), "shutting_down")

    def refuse_all(self, error: GateRejected, reason: str) -> None:
        """Refuse every request that has no slot yet with ``error``, until ``reopen``."""
        self._refuse_new = (error, reason)
        self._refuse_queued = error
        while self._heap:
            _, _, waiter = heapq.heappop(self._heap)
            if not waiter.future.done():
                self._queued -= 1
                waiter.future.set_exception(error)

    def reopen(self) -> None:
        """Admit again after ``refuse_all`` (the engine is back)."""
        self._refuse_new = None
        self._refuse_queued = None

    def pause(self) -> None:
        """Hold every new slot: requests wait in the queue (not refused) until ``resume``."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake()

    @property
    def paused(self) -> bool:
        return self._paused

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False when the deadline passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self._in_flight == 0

    def queued_priorities(self) -> list[int]:
        """Priorities of the requests waiting now (for per-class queue depth)."""
        return [p for p, _, w in self._heap if not w.future.done()]

    def stats(self) -> GateStats:
        self._expire_pending()
        return GateStats(
            limit=self._limit,
            in_flight=self._in_flight,
            queued=self._queued,
            pending=len(self._pending),
            admitted_total=self.admitted_total,
            rejected_total=self.rejected_total,
            completed_total=self.completed_total,
            closed=self._refuse_new is not None,
        )

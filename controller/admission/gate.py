"""The admission gate: how many requests may be inside the engine at once, and who goes next.

Requests beyond the limit wait here, one queue per priority class (``controller/admission/classes.py``).
Slots go to the most urgent class first (strict priority, so an interactive request never waits
behind batch work), except that a class whose oldest waiter has waited ``aging_s`` takes one slot
per ``aging_s`` ahead of the others (aging: lower classes still progress). A request is refused
early with 429 when its class queue is full or its expected wait (position / the rate slots free up
at, ``classes.CompletionRate``) exceeds its class's queue deadline; past it in the queue, 429 too.
A request whose ``n`` sequences overflow the queue limits even on an idle gate gets 400 instead (no
try of it is ever admitted at this limit). When the whole gate is full, the least urgent class sheds
first. No vLLM import: the engine client in ``controller/engine`` adapts the gate's errors to HTTP.

Beside the load, three states turn requests away with 503, each a stored ``GateRejected`` raised
afresh per request (``GateRejected.fresh``): shutdown (new requests refused, queued ones go on;
``close`` refuses those too), the restart budget spent (``refuse_all``: everyone without a slot,
until ``reopen``), and no engine able to serve while the guard rebuilds one (``refuse_new``: new
requests get 503 with Retry-After instead of queueing without bound; those already queued keep their
place). An engine restart pauses the gate: every new slot is held while the queue deadlines stand
still (``deadlines.py``), and a drain waits for the slots in flight to come back.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from controller.admission.classes import DEFAULT_CLASSES, CompletionRate, GateEvents, NoEvents, PriorityClass
from controller.admission.deadlines import Deadlines
from controller.admission.errors import OWN_BOUND, GateRejected, shutting_down
from controller.admission.handle import Admission, Call
from controller.admission.order import capped, next_queue
from controller.admission.queues import ClassQueue, GateStats, Slot, Waiter
from controller.admission.retries import RefusedIds
from controller.admission.shedding import shed_order
from controller.admission.ttft import NO_BOUNDS, AfterSlot, TtftBounds, TtftCheck
from controller.clock import Clock, monotonic

__all__ = ["Admission", "AdmissionGate", "Call", "GateRejected", "GateStats", "Slot"]


class AdmissionGate:
    """A runtime-adjustable concurrency limit with per-class strict-priority queues.

    A request enters once (``enter``) and holds an ``Admission`` handle (``handle.py``) for its
    life. Its calls' admission runs before a response starts (vLLM calls ``generate`` from its
    handlers); an admitted call counts as *pending* in its class until it queues for its slot,
    because a burst passes admission before anything reaches the gate.
    """

    PENDING_TTL_S = 30.0
    """Safety net: a pending admission that never reaches the gate expires (the data plane also
    cancels it when the request ends without generating)."""

    def __init__(
        self,
        limit: int,
        max_queue: int,
        classes: Sequence[PriorityClass] = DEFAULT_CLASSES,
        aging_s: float = 0.0,
        clock: Clock = monotonic,
        events: GateEvents | None = None,
        max_restart_wait_s: float = math.inf,
    ) -> None:
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self._limit = limit
        self.max_queue = max_queue
        self.aging_s = aging_s
        self._clock = clock
        self._events: GateEvents = events or NoEvents()
        self.ttft, self._configured = NO_BOUNDS, list(classes)  # configure's bounds; classes as configured
        self._order: list[ClassQueue] = [ClassQueue(c) for c in classes]
        self._in_flight: Counter[str] = Counter()
        self._in_flight_total = 0
        self._seq = itertools.count()
        self._rate = CompletionRate(clock)
        self.after_slot = AfterSlot(clock, lambda: self.ttft)  # the client tells it each first token
        # and each admitted request's measured TTFT against its prediction, with the lag as it is now
        self.ttft_check = TtftCheck(clock, lag=self.after_slot.seconds)
        self._deadlines = Deadlines(clock, self._expire, max_restart_wait_s, self.after_slot.queue_deadline_s)
        self.admitted_total = self.rejected_total = self.completed_total = self.timed_out_total = 0
        self.arrivals_total = self.retries_total = 0
        self.refused_ids = RefusedIds(clock)
        """Ids of requests refused lately: their next few tries, refused in turn, are retries
        (``retries_total``)."""
        self._refuse_new: GateRejected | None = None
        self._refuse_queued: GateRejected | None = None
        self._unavailable: GateRejected | None = None
        """The refusal ``refuse_new`` set (lifted only by ``refuse_new(None)``)."""

    # -- limit and classes ------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        return self._limit

    def set_limit(self, limit: int) -> None:
        """Change the limit; raising it admits waiters at once, lowering it never evicts anyone."""
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self._limit = limit
        self._wake()

    def configure(
        self,
        classes: Sequence[PriorityClass] | None = None,
        aging_s: float | None = None,
        max_queue: int | None = None,
        *,
        ttft: TtftBounds | None = None,
    ) -> None:
        """Apply a reloaded ``[admission]`` and the TTFT bounds the policy steers by (``ttft.py``:
        deadlines cut to the bounds, refusal by predicted TTFT); what is None stays as it is. Waiters
        move to their new class, keeping their place in time; deadlines are re-armed against the new
        class and bounds. Pending counts of a class that no longer exists are dropped. The one setter
        of the gate's settings, at the first build and every reload (``ControlCore.apply``)."""
        if ttft is not None:
            self.ttft = ttft
        if classes is not None:
            self._configured = list(classes)
        old = {q.spec.name: q for q in self._order}
        self._order = [ClassQueue(c) for c in self.ttft.bounded(self._configured)]
        for q in self._order:
            if q.spec.name in old:
                q.pending = old[q.spec.name].pending
                q.last_grant_mono = old[q.spec.name].last_grant_mono
        for oq in old.values():
            for w in oq.live():
                w.queue = self._queue_of(w.priority)
                w.queue.push(w)
                if w.timer is not None:
                    w.timer.cancel()
                self._deadlines.arm(w)
        if aging_s is not None:
            self.aging_s = aging_s
        if max_queue is not None:
            self.max_queue = max_queue
        self.expire_overdue()
        self._wake()

    @property
    def classes(self) -> list[PriorityClass]:
        return [q.spec for q in self._order]

    @property
    def uses_prompt_length(self) -> bool:
        """A request's prompt length counts here: in its predicted TTFT (``ttft.TtftBounds``) or
        in its rank in a class that serves the shortest prompt first."""
        return self.ttft.uses_prompt_length or any(q.spec.shortest_first for q in self._order)

    def class_name(self, priority: int) -> str:
        return self._queue_of(priority).spec.name

    def _queue_of(self, priority: int) -> ClassQueue:
        for q in self._order:
            if q.spec.contains(priority):
                return q
        return self._order[-1]  # unreachable with validated classes; the least urgent is safe

    def _free_for(self, q: ClassQueue) -> int:
        """Slots class ``q`` may take now: the limit minus what is in flight and minus the unused
        reservations of the other classes."""
        held = sum(
            max(0, o.spec.reserved_slots(self._limit) - self._in_flight[o.spec.name])
            for o in self._order
            if o is not q
        )
        return self._limit - self._in_flight_total - held

    def _weight(self, q: ClassQueue, asked: int) -> int:
        return capped(asked, q, self._order, self._limit)

    # -- admission --------------------------------------------------------------------------------
    def _expire_pending(self) -> None:
        for q in self._order:
            q.expire_pending(self._clock() - self.PENDING_TTL_S)

    def enter(
        self,
        arrived_mono: float | None = None,
        ttft_bound_s: float | None = None,
        request_id: str | None = None,
    ) -> Admission:
        """A request enters the gate: its one ``Admission`` handle (``handle.py``), whose methods are
        its preflight, each call's admission, each call's slot and their release, and whose ``close``
        at the request's end gives back what it still holds. ``arrived_mono``: when it reached the
        server (a TTFT bound counts from then); ``ttft_bound_s``: its own TTFT bound (a gateway's
        header); ``request_id``: the client's ``X-Request-Id``."""
        return Admission(self, arrived_mono, ttft_bound_s, request_id)

    def check_admission(
        self,
        priority: int = 0,
        n: int = 1,
        prompt_tokens: int | None = None,
        arrived_mono: float | None = None,
        ttft_bound_s: float | None = None,
    ) -> float | None:
        """Refuse now (raise ``GateRejected``) or count an arriving one-call request as pending in its
        class, one place, until ``acquire`` takes it: ``n`` is what it will generate (prompts x
        sequences each); ``prompt_tokens`` (where known) adds its own prefill to its predicted wait,
        and under TTFT bounds the time since it ``arrived_mono`` counts too (``configure``,
        ``ttft.AfterSlot``). ``ttft_bound_s``: the request's own TTFT bound (a gateway's header),
        which only tightens its class's (``TtftBounds.bound_s``). A request with several calls, a
        preflight or a slot held before a later call enters the gate instead (``enter``).

        Returns its predicted TTFT, counted from ``arrived_mono``, where a TTFT bound holds it (None
        otherwise): the engine client tells ``ttft_check`` what it measured against it, and the
        expected-wait check adds the class's correction (``ttft.TtftCheck``)."""
        return self._check(priority, n, 1, prompt_tokens, arrived_mono, ttft_bound_s)

    def _check(
        self,
        priority: int,
        n: int,
        places: int,
        prompt_tokens: int | None = None,
        arrived_mono: float | None = None,
        ttft_bound_s: float | None = None,
        later_call: bool = False,
        ttft_done: bool = False,
        early: bool = False,
    ) -> float | None:
        """``check_admission`` for a request in any stage (the ``Admission`` handle's): ``places``
        the pending places it holds until it queues; ``later_call``: a further call of a request
        admitted before, not an arrival; ``ttft_done``: its request has held a slot (its TTFT has
        happened): no expected wait refuses it, bounds still do. ``early``: vLLM's preflight, before
        the prompt is rendered (``places`` 0): refuse what is sure to be refused, but shed no waiter
        for room, since the check with the prompt's length may still refuse the request; that check
        sheds. Nor does it count the arrival: the first call's check does, or
        ``refused(arrival=True)`` where this one refuses, so that a request vLLM refuses after its
        preflight (a prompt past ``max_model_len``) is no demand."""
        q = self._queue_of(priority)
        self._check_fits(q, n)
        self.arrivals_total += not later_call and not early
        if self._refuse_new is not None:
            self._events.rejected(q.spec.name, self._refuse_new.reason)
            raise self._refuse_new.fresh()
        self._expire_pending()
        position, own = self._position(q, n, priority, prompt_tokens)
        bounded = ttft_bound_s is not None
        backlog = 0.0 if ttft_done else self.ttft.backlog_s()  # once a check: it walks the ledger
        own_s = None if ttft_done else self.after_slot.own_s(prompt_tokens, arrived_mono, bounded, backlog)
        bound = self.ttft.bound_s(q.spec.name, ttft_bound_s)
        if position > 0:  # only an expected wait reads the correction (a sort of its samples)
            correction = 0.0 if bound is None else self.ttft_check.correction_s(q.spec.name, bound)
            self._check_wait(q, position, own, n, own_s, ttft_bound_s, early, correction)
        elif ttft_bound_s is not None and own_s is not None and bound is not None:
            self._check_own_bound(q, n, bound, own_s)
        elif own_s is not None and bound is not None and not early and backlog > 0:
            sure = self.after_slot.sure_s(prompt_tokens, arrived_mono, backlog)
            self._check_backlog(q, n, bound, sure, backlog)
        q.pending.extend([self._clock()] * places)
        if bound is None or own_s is None or later_call:
            return None
        rate = self.service_rate()
        return own_s + (position / rate if position > 0 and rate else 0.0)

    def lag_s(self) -> float:
        """The after-slot lag a prediction reads now (``ttft.AfterSlot.seconds``): the TTFT check
        sets each residual against the lag of its prediction (``ttft.TtftCheck``)."""
        return self.after_slot.seconds()

    def uncached_tokens(self, prompt_tokens: int | None) -> int | None:
        """Of a prompt of ``prompt_tokens``, what a prediction now expects the engine to prefill
        (``ttft.TtftBounds.uncached_tokens``): the TTFT check sets the request's own cache hits
        against it."""
        return self.ttft.uncached_tokens(prompt_tokens)

    def _check_own_bound(self, q: ClassQueue, n: int, bound: float, own_s: float) -> None:
        """A request that names its own TTFT bound and finds a free slot is refused where what it
        needs besides a wait (``own_s``: its prefill, the after-slot lag, the time since it arrived)
        passes ``bound``, the one it is held to (``TtftBounds.bound_s``), tighter than its class's:
        served, it would miss it for certain, and the engine's time goes to no good request."""
        if own_s > bound and bound < (self.ttft.bound_s(q.spec.name) or math.inf):
            why = f"its first token needs {own_s:.2f}s, past its own TTFT bound of {bound:g}s"
            self._refuse(q, n, OWN_BOUND, 0, why)

    def _check_backlog(self, q: ClassQueue, n: int, bound: float, sure: float, backlog: float) -> None:
        """A request that finds a slot free behind a prefill ``backlog`` is refused where ``sure``,
        the time since it arrived, the backlog and its own prefill (``AfterSlot.sure_s``: no learned
        lag), passes its TTFT bound: served, it would miss it for certain, and
        its prefill would delay every request behind it. The step-cost model's terms only: the
        learned lag and the TTFT check's correction do not refuse a request a free slot waits for
        (with them, the twin's H200 shared-prefix load at 40 req/s refused for 25 s while the engine
        stood idle)."""
        if sure > bound:
            why = (
                f"its first token needs {sure:.2f}s ({backlog:.2f}s behind the prompts the engine is"
                f" prefilling), past the {q.spec.name} TTFT bound of {bound:g}s"
            )
            rate = self.service_rate() or 0.0  # Retry-After: when the backlog has drained enough
            self._refuse(q, n, "expected_wait", (sure - bound) * rate, why)

    def take_retry(self, request_id: str | None) -> bool:
        """A request with the client's id ``request_id`` (``X-Request-Id``) arrives: True when it
        takes one of the tries a recent refusal of its id excuses (``RefusedIds.take``). The engine
        request's ``Admission`` keeps the answer and hands it to ``refused``."""
        return request_id is not None and self.refused_ids.take(request_id)

    def refused(self, request_id: str | None, retry: bool = False, arrival: bool = False) -> None:
        """A refusal of the gate's (early or in the queue) was answered to a request, once per
        request. ``retry``: its arrival took an excused try (``take_retry``) and it was never admitted
        to a slot: it counts in ``retries_total``, not as new demand, and excuses nothing more; any
        other refused request with an id excuses the next tries of its id (``RefusedIds.refused``).
        ``arrival``: the refusal of vLLM's preflight (``Admission.preflight``), which counted
        no arrival: it is counted here, and it takes an excused try as any arrival does."""
        if arrival:
            self.arrivals_total += 1
            retry = self.take_retry(request_id)
        if retry:
            self.retries_total += 1
        elif request_id is not None:
            self.refused_ids.refused(request_id)

    def _position(self, q: ClassQueue, n: int, priority: int, prompt_tokens: int | None) -> tuple[int, int]:
        """(requests that would wait ahead of a slot for this one, itself included; how many of
        them are of its own class). Its class's own waiters first fill the class's free reserved
        slots; the rest compete for shared slots behind every more urgent waiter. In a class that
        serves the shortest prompt first, only the waiters it would queue behind count
        (``ClassQueue.ahead_of``)."""
        free = max(0, self._free_for(q))
        reserved_free = min(free, max(0, q.spec.reserved_slots(self._limit) - self._in_flight[q.spec.name]))
        shared = free - reserved_free
        higher = sum(o.queued + len(o.pending) for o in self._order[: self._order.index(q)])
        own = n + q.ahead_of(priority, prompt_tokens) + len(q.pending) - reserved_free
        return (own + higher - shared if own > 0 else own), own

    def _check_fits(self, q: ClassQueue, n: int) -> None:
        """Refuse with 400 a request whose ``n`` sequences overflow a queue limit with every slot free
        and nothing waiting (``_check_wait`` on an idle gate: ``n`` less the slots its class may take
        against the class's ``max_queue``, ``n`` less the limit against the gate's): at this limit
        every try of it is refused, and a 429's Retry-After would send its client back for ever. A
        request no replica like this one takes is neither an arrival nor an overload refusal."""
        free = self._limit - sum(o.spec.reserved_slots(self._limit) for o in self._order if o is not q)
        by_class, by_gate = max(0, free) + q.spec.max_queue, self._limit + self.max_queue
        if n <= min(by_class, by_gate):
            return
        name = q.spec.name
        key, room = (
            (f"[admission.classes.{name}] max_queue = {q.spec.max_queue}", by_class)
            if by_class <= by_gate
            else (f"[admission] max_queue = {self.max_queue}", by_gate)
        )
        raise GateRejected(
            f"n = {n} sequences (prompts x n) can never be admitted at the admission limit of {self._limit}:"
            f" one {name} request holds at most {room} (the slots it may take and {key});"
            f" ask for at most {room} sequences, or have the operator raise max_queue",
            400,
            0,
            "too_many_sequences",
        )

    def _check_wait(
        self,
        q: ClassQueue,
        position: int,
        own: int,
        n: int,
        prefill_s: float | None,
        asked_s: float | None,
        early: bool = False,
        correction_s: float = 0.0,
    ) -> None:
        """``position`` requests (this one included) would wait ahead of a slot for it, ``own`` of
        them of its class; ``prefill_s`` what it needs after the wait (``AfterSlot.own_s``; None:
        no expected wait refuses it); ``asked_s`` its own TTFT bound, None without one; ``early``:
        the preflight, which sheds nobody (``check_admission``)."""
        spec = q.spec
        deadline = self.ttft.queue_deadline_s(spec, asked_s)
        own = min(position, own)
        if own > spec.max_queue:
            why = f"{own - n} {spec.name} requests already wait (queue limit {spec.max_queue})"
            self._refuse(q, n, "queue_full", own - spec.max_queue, why)
        rate = self.service_rate()  # under SLO steering the deadline is a share of the TTFT bound
        late = (
            rate is not None
            and prefill_s is not None
            and position / rate + prefill_s + correction_s > deadline
        )
        if late and rate is not None and prefill_s is not None:
            wait = f"{position / rate:.1f}s" + (
                f" + {prefill_s:.2f}s to its first token" if prefill_s else ""
            )
            if correction_s:  # what the class's admitted requests measured beyond their prediction
                wait += f" {'+' if correction_s > 0 else '-'} {abs(correction_s):.2f}s measured beyond"
            why = f"expected wait {wait} exceeds the {spec.name} queue deadline of {deadline:g}s"
            reason = "expected_wait"
            if asked_s is not None and deadline < self.ttft.queue_deadline_s(spec):
                why += f" (its own TTFT bound of {asked_s:g}s)"
                reason = OWN_BOUND
            self._refuse(q, n, reason, position - rate * deadline, why)
        waiting = sum(o.queued + len(o.pending) for o in self._order)
        free_any = max(0, self._limit - self._in_flight_total)
        excess = waiting + n - free_any - self.max_queue
        if excess > 0 and not self._shed_below(q, min(excess, n), dry=early):
            why = f"{waiting} requests already wait (gate queue limit {self.max_queue})"
            self._refuse(q, n, "queue_full", excess, why)

    def _refuse(self, q: ClassQueue, n: int, reason: str, excess: float, why: str) -> None:
        self.rejected_total += n
        self._events.rejected(q.spec.name, reason)
        raise GateRejected(f"overloaded: {why}; retry later", 429, self._retry_after(excess), reason)

    def _retry_after(self, excess: float) -> int:
        """Seconds until ``excess`` queued requests have completed at the measured rate."""
        rate = self.service_rate()
        return 1 if rate is None else max(1, min(60, math.ceil(excess / rate)))

    def completion_rate(self) -> float | None:
        """Completions per second over the last 10 s (None below two); see ``service_rate``."""
        return self._rate.per_second()

    def service_rate(self) -> float | None:
        """Slots freed per second, what expected waits and Retry-After use (``CompletionRate``)."""
        return self._rate.service_per_second(self._in_flight_total)

    def retry_after_s(self) -> int:
        """Seconds until the whole queue has likely drained (for 503s and answers without a class)."""
        return self._retry_after(1 + sum(q.queued + len(q.pending) for q in self._order))

    def _shed_below(self, q: ClassQueue, count: int, dry: bool = False) -> bool:
        """Refuse the ``count`` newest waiters of the least urgent classes below ``q``
        (``shedding.py``); False, and none refused, when fewer wait. ``dry``: only whether they wait."""
        victims = shed_order(self._order[self._order.index(q) + 1 :], count, self._retry_after)
        if dry:
            return bool(victims)
        for w, error in victims:
            self._drop(w, error)
            self._events.rejected(w.queue.spec.name, "shed")
        self.rejected_total += len(victims)
        return bool(victims)

    def cancel_pending(self, priority: int, count: int = 1) -> None:
        """The request passed check_admission but ends with ``count`` of its pending places never
        taken (a 4xx from vLLM, the client gone: ``Admission.close``)."""
        q = self._queue_of(priority)
        for _ in range(min(count, len(q.pending))):
            q.pending.pop()

    async def acquire(
        self,
        priority: int = 0,
        arrived_mono: float | None = None,
        weight: int = 1,
        ttft_bound_s: float | None = None,
        prompt_tokens: int | None = None,
    ) -> Slot:
        """Wait for a slot in strict class order; raise ``GateRejected`` past the class deadline. It
        takes up to ``weight`` of its class's pending places (a request that passed
        ``check_admission``; an ``Admission``'s call takes its own, ``Admission.acquire``).
        ``arrived_mono``: when the request reached the server (a TTFT bound counts from then);
        ``weight``: how much of the limit it holds, granted all at once or not at all (``_weight``);
        ``ttft_bound_s``: the request's own TTFT bound, which only tightens its class's (its queue
        deadline); ``prompt_tokens``: what it prefills, where known (its rank in a ``shortest``
        class)."""
        return await self._acquire(priority, weight, arrived_mono, weight, ttft_bound_s, prompt_tokens)

    async def _acquire(
        self,
        priority: int,
        places: int,
        arrived_mono: float | None = None,
        weight: int = 1,
        ttft_bound_s: float | None = None,
        prompt_tokens: int | None = None,
    ) -> Slot:
        """``acquire`` for a request that takes ``places`` of its class's pending places as it
        queues, granted or refused (the ``Admission`` handle's)."""
        q = self._queue_of(priority)
        for _ in range(min(places, len(q.pending))):  # one place per sequence
            q.pending.popleft()
        if self._refuse_queued is not None:
            raise self._refuse_queued.fresh()
        urgent_waiting = any(o.queued for o in self._order[: self._order.index(q) + 1])
        if not self._deadlines.paused and not urgent_waiting and self._free_for(q) >= self._weight(q, weight):
            return self._grant(q, self._clock(), weight=self._weight(q, weight))
        now, loop = self._clock(), asyncio.get_running_loop()
        w = Waiter(priority, next(self._seq), now, loop.create_future(), q, self._deadlines.paused_s())
        w.weight, w.ttft_bound_s, w.prompt_tokens = weight, ttft_bound_s, prompt_tokens or 0
        w.deadline_from_mono = self.after_slot.deadline_from(q.spec, now, arrived_mono, ttft_bound_s)
        q.push(w)
        self._deadlines.arm(w)
        try:
            return await w.future
        except BaseException:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                self.release(w.future.result())  # granted and cancelled in the same instant
            elif w.future.cancelled() or not w.future.done():
                # Task.cancel() cancels the future we await (a client disconnected while queued);
                # only grants, expiry, shedding and close uncount a waiter themselves.
                w.future.cancel()
                self._unqueue(w)
            raise

    def _unqueue(self, w: Waiter) -> None:
        w.queue.queued -= 1
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        w.queue.compact()

    def _drop(self, w: Waiter, error: GateRejected) -> None:
        self._unqueue(w)
        w.future.set_exception(error)

    def _grant(self, q: ClassQueue, now: float, enqueued_mono: float | None = None, weight: int = 1) -> Slot:
        name = q.spec.name
        self._in_flight[name] += weight
        self._in_flight_total += weight
        self.admitted_total += 1
        q.last_grant_mono = now
        self._events.admitted(name, 0.0 if enqueued_mono is None else now - enqueued_mono)
        return Slot(name, now, weight)

    def release(self, slot: Slot) -> None:
        """Give a slot back (completion, error, abort or disconnect)."""
        self._in_flight[slot.cls] -= slot.weight
        self._in_flight_total -= slot.weight
        self.completed_total += 1
        self._rate.record(self._clock() - slot.granted_mono)
        self._wake()

    def _wake(self) -> None:
        now = self._clock()
        while not self._deadlines.paused:
            q = self._next_queue(now)
            if q is None:
                return
            w = q.head()
            assert w is not None
            if now >= self._deadlines.deadline(w):
                self._expire(w)  # its timer has not fired yet: never grant past the deadline
                continue
            heapq.heappop(q.heap)
            self._unqueue(w)
            w.future.set_result(self._grant(q, now, w.enqueued_mono, self._weight(q, w.weight)))

    def _next_queue(self, now: float) -> ClassQueue | None:
        """The class whose head gets the next slot (``order.next_queue``)."""
        own = lambda q: max(0, q.spec.reserved_slots(self._limit) - self._in_flight[q.spec.name])  # noqa: E731
        return next_queue(self._order, now, self.aging_s, self._free_for, self._weight, own)

    @asynccontextmanager
    async def slot(
        self, priority: int = 0, arrived_mono: float | None = None, prompt_tokens: int | None = None
    ) -> AsyncIterator[Slot]:
        granted = await self.acquire(priority, arrived_mono=arrived_mono, prompt_tokens=prompt_tokens)
        try:
            yield granted
        finally:
            self.release(granted)

    # -- deadlines (controller/admission/deadlines.py keeps the timers) ----------------------------
    def expire_overdue(self) -> int:
        """Refuse every waiter whose deadline has passed; returns how many (timers call this per
        waiter in production; tests with a fake clock call it directly)."""
        now = self._clock()
        overdue = [w for q in self._order for w in q.live() if now >= self._deadlines.deadline(w)]
        for w in overdue:
            self._expire(w)
        return len(overdue)

    def _expire(self, w: Waiter) -> None:
        spec, now = w.queue.spec, self._clock()
        deadline = self._deadlines.queue_deadline_s(spec, w.ttft_bound_s)
        wait = now - w.enqueued_mono
        ahead = sum(o.queued for o in self._order[: self._order.index(w.queue) + 1])
        why = f"waited {wait:.1f}s for a slot: past the {spec.name} deadline of {deadline:.3g}s"
        since = w.deadline_from_mono is not None and w.deadline_from_mono < w.enqueued_mono
        bound = "its TTFT bound"
        if w.ttft_bound_s is not None and deadline < spec.queue_deadline_s:
            bound = f"its own TTFT bound of {w.ttft_bound_s:g}s"
            why += "" if since else f" ({bound})"
        if since and w.deadline_from_mono is not None:
            why += f" since it reached the server {now - w.deadline_from_mono:.1f}s ago ({bound})"
        if self._deadlines.paused:  # no engine served meanwhile: not an overload, a 503
            why += f" and max_restart_wait_s = {self._deadlines.max_pause_s:g}s of engine restart"
            self._drop(w, GateRejected(f"{why}; retry later", 503, self.retry_after_s(), "restart_wait"))
        else:
            self._drop(w, GateRejected(f"{why}; retry later", 429, self._retry_after(ahead), "deadline"))
        self.timed_out_total += 1
        self._events.timed_out(spec.name, wait)

    # -- refusals while the engine cannot serve, and at shutdown -----------------------------------
    def stop_admitting(self) -> None:
        """Refuse new requests (503); queued and in-flight ones go on (graceful drain)."""
        self._refuse_new = shutting_down()

    def close(self) -> None:
        """Refuse new requests; those already queued are refused too (503), in-flight ones finish."""
        self.refuse_all(shutting_down())

    def refuse_all(self, error: GateRejected) -> None:
        """Refuse every request that has no slot yet with ``error``, until ``reopen``."""
        self._refuse_new = self._refuse_queued = error
        waiting = [w for q in self._order for w in q.live()]  # each drop compacts its queue
        for w in waiting:
            self._drop(w, error.fresh())

    def reopen(self) -> None:
        """Admit again after ``refuse_all`` (the engine is back)."""
        self._refuse_new = None
        self._refuse_queued = None

    def refuse_new(self, error: GateRejected | None) -> None:
        """Refuse new requests with ``error`` while no engine can serve (queued ones keep waiting);
        None admits again. Never replaces or lifts a refusal it did not set (shutdown's)."""
        if error is not None and self._refuse_new is None:
            self._refuse_new = self._unavailable = error
        elif error is None and self._refuse_new is not None and self._refuse_new is self._unavailable:
            self._refuse_new = self._unavailable = None

    # -- pauses of an engine restart, and the drain ------------------------------------------------
    def set_restart_wait(self, seconds: float) -> None:
        """[guard] max_restart_wait_s."""
        self._deadlines.max_pause_s = seconds

    def pause(self) -> None:
        """Hold every new slot: requests wait in the queue (not refused, their deadlines stopped)
        until ``resume``."""
        self._deadlines.pause()

    def resume(self) -> None:
        self._deadlines.resume()
        self._wake()

    @property
    def paused(self) -> bool:
        """Slots are held (an engine restart)."""
        return self._deadlines.paused

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight; False when the deadline passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._in_flight_total > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self._in_flight_total == 0

    # -- what /state, the metrics and the control loop read ----------------------------------------
    def queued_by_class(self) -> dict[str, int]:
        """Requests waiting now, per class (every class present, most urgent first)."""
        return {q.spec.name: q.queued for q in self._order}

    def in_flight_by_class(self) -> dict[str, int]:
        return {q.spec.name: self._in_flight[q.spec.name] for q in self._order}

    def stats(self) -> GateStats:
        self._expire_pending()
        return GateStats(
            limit=self._limit,
            in_flight=self._in_flight_total,
            queued=sum(q.queued for q in self._order),
            pending=sum(len(q.pending) for q in self._order),
            admitted_total=self.admitted_total,
            rejected_total=self.rejected_total,
            completed_total=self.completed_total,
            closed=self._refuse_new is not None,
            timed_out_total=self.timed_out_total,
            arrivals_total=self.arrivals_total,
            retries_total=self.retries_total,
        )

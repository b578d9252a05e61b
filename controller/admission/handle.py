"""One request's way through the gate: the ``Admission`` handle ``AdmissionGate.enter`` gives each
request, after Netflix concurrency-limits' ``Limiter.acquire(context) -> Listener``.

A request enters the gate once and holds one handle for its life; every step of its admission is a
method of the handle, and each way a slot or a pending place goes back is named once here:

- ``preflight``: vLLM's ``check_admission``, before the prompt is rendered: refuse what is sure to be
  refused (queue bounds, a full gate with nobody below to shed, the expected wait), shed nobody, hold
  no place, count no arrival (the first call's admission counts it; a refusal here counts it itself).
- ``admit``: one call (``generate``/``encode``) with its ``n`` and its prompt's length: the request's
  arrival at its first call (a retry when a recent refusal of its id excuses it, ``take_retry``), a
  further call after that; a request that has held a slot (a beam search's later steps) is not refused
  by its TTFT. An admitted ``Call`` holds a pending place per sequence until it queues.
- ``acquire``: the call's slot; it takes the call's pending places (``_take_places``) either way.
- ``release``: the slot goes back, once, whoever calls it first (the engine ending the request, the
  attempt's end).
- ``close``: at the request's end; the places of calls that never queued go back (``_give_back``).

The handle keeps what admission knows of its request (admitted, served, its retry) and answers the
gate's retry accounting once per request (``AdmissionGate.refused``); the HTTP answer of a refusal is
the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from controller.admission.errors import GateRejected
from controller.admission.queues import Slot


class Gate(Protocol):
    """What a handle calls of its ``AdmissionGate`` (gate.py, which imports this module): the
    check and the queueing of a request in any stage, and the returns."""

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
    ) -> float | None: ...

    async def _acquire(
        self,
        priority: int,
        places: int,
        arrived_mono: float | None = None,
        weight: int = 1,
        ttft_bound_s: float | None = None,
        prompt_tokens: int | None = None,
    ) -> Slot: ...

    def release(self, slot: Slot) -> None: ...

    def lag_s(self) -> float: ...

    def uncached_tokens(self, prompt_tokens: int | None) -> int | None: ...

    def cancel_pending(self, priority: int, count: int = 1) -> None: ...

    def take_retry(self, request_id: str | None) -> bool: ...

    def refused(self, request_id: str | None, retry: bool = False, arrival: bool = False) -> None: ...


@dataclass
class Call:
    """One admitted ``generate()``/``encode()`` call of a request."""

    priority: int
    weight: int = 1
    """The sequences it runs in the engine (its sampling's ``n``): its slot's weight."""
    prompt_tokens: int | None = None
    """Tokens its prompt prefills, as vLLM rendered it (where the gate uses it:
    ``AdmissionGate.uses_prompt_length``; else None)."""
    predicted_ttft_s: float | None = None
    """The TTFT the gate predicted for it, from ``arrived_mono``, where a TTFT bound held it: its
    first token is measured against it (``ttft.TtftCheck``)."""
    predicted_lag_s: float = 0.0
    """Of ``predicted_ttft_s``, the after-slot lag (``ttft.AfterSlot.seconds``) it held."""
    arrived_mono: float | None = None
    """When its request reached the server (with ``predicted_ttft_s``)."""
    assumed_uncached: int | None = None
    """Of its prompt, the tokens ``predicted_ttft_s`` expected the engine to prefill (the rest from
    the prefix cache: ``ttft.TtftBounds.uncached_tokens``)."""
    places: int = 0
    """Pending places it holds in its class, one per sequence: taken when it queues
    (``Admission.acquire``), given back at the request's end where it never did (``Admission.close``)."""
    tries: int = 0
    """Times it has queued for a slot (more than once: the engine died under it)."""
    from_arrival: bool = False
    """Its first try queued before its request held any slot: its queue deadline counts from the
    request's arrival under its TTFT bound."""


class Admission:
    """One request's admission (module docstring). ``arrived_mono``: when it reached the server (a
    TTFT bound counts from then); ``ttft_bound_s``: its own TTFT bound (a gateway's header), which
    only tightens its class's; ``request_id``: the client's ``X-Request-Id`` (its retries)."""

    def __init__(
        self,
        gate: Gate,
        arrived_mono: float | None = None,
        ttft_bound_s: float | None = None,
        request_id: str | None = None,
    ) -> None:
        self._gate = gate
        self.arrived_mono = arrived_mono
        self.ttft_bound_s = ttft_bound_s
        self.request_id = request_id
        self._calls: list[Call] = []
        self._slots: list[Slot] = []
        """Slots it holds now."""
        self._admitted = False
        self._served = False
        self._retry = False
        """Its arrival took a try that a recent refusal of its id excuses (``take_retry``)."""
        self._refused = False

    @property
    def admitted(self) -> bool:
        """A call has passed admission: later calls are not new arrivals."""
        return self._admitted

    @property
    def served(self) -> bool:
        """A call has held a slot: its TTFT has happened, later calls are not refused by it."""
        return self._served

    @property
    def calls(self) -> list[Call]:
        """Its admitted calls, in order."""
        return list(self._calls)

    def preflight(self, priority: int, n: int = 1) -> None:
        """vLLM's preflight (its ``check_admission``), before the prompt's length is known: refuse
        (raise ``GateRejected``) what is sure to be refused; shed nobody, hold no place. Nothing to
        check once a call is admitted (vLLM calls it once per request)."""
        if self._admitted:
            return
        try:
            self._gate._check(
                priority,
                n,
                places=0,
                arrived_mono=self.arrived_mono,
                ttft_bound_s=self.ttft_bound_s,
                early=True,
            )
        except GateRejected as exc:
            self._refusal(exc, arrival=True)
            raise

    def admit(self, priority: int, n: int = 1, prompt_tokens: int | None = None) -> Call:
        """Admit one call of ``n`` sequences (raise ``GateRejected`` to refuse it); it holds a pending
        place per sequence. A request that has held a slot is checked without its prompt, its arrival
        or its TTFT bound: its TTFT has happened."""
        if not self._admitted:  # its arrival
            self._retry = self._gate.take_retry(self.request_id)
        served = self._served
        try:
            predicted = self._gate._check(
                priority,
                n,
                places=n,  # a pending place per sequence: n > 1 counts n against the queue
                prompt_tokens=None if served else prompt_tokens,
                arrived_mono=None if served else self.arrived_mono,
                ttft_bound_s=None if served else self.ttft_bound_s,
                later_call=self._admitted,
                ttft_done=served,
            )
        except GateRejected as exc:
            self._refusal(exc)
            raise
        self._admitted = True
        call = Call(priority, n, prompt_tokens, places=n)
        if predicted is not None:  # measured against it at its first token
            call.predicted_ttft_s, call.arrived_mono = predicted, self.arrived_mono
            call.predicted_lag_s = self._gate.lag_s()  # what the prediction just read
            call.assumed_uncached = self._gate.uncached_tokens(prompt_tokens)
        self._calls.append(call)
        return call

    def call(self, priority: int, n: int = 1) -> Call:
        """A call that passes no admission check and holds no place (a caller of our own, not a
        data-plane request): it only waits for its slot."""
        return Call(priority, n)

    async def acquire(self, call: Call) -> Slot:
        """Wait for ``call``'s slot (raise ``GateRejected`` past its deadline). Its first try, queued
        before the request held any slot, has its deadline from the request's arrival under its TTFT
        bound; a try after an engine died under it waits from when it queues again, as the guard
        promises; a call queued once the request has held a slot (a beam search's step), from when it
        queues, under no TTFT bound of the request's own."""
        if call.tries == 0:
            call.from_arrival = not self._served
        first = call.tries == 0
        call.tries += 1
        try:
            slot = await self._gate._acquire(
                call.priority,
                self._take_places(call),
                arrived_mono=self.arrived_mono if first and call.from_arrival else None,
                weight=call.weight,
                ttft_bound_s=self.ttft_bound_s if call.from_arrival else None,
                prompt_tokens=call.prompt_tokens,
            )
        except GateRejected as exc:
            self._refusal(exc)
            raise
        self._served = True
        self._slots.append(slot)
        return slot

    def release(self, slot: Slot) -> None:
        """The slot goes back (the engine ended its request, or its attempt ended: done, the engine
        dead, the client gone); once, whoever calls first."""
        if any(held is slot for held in self._slots):
            self._slots = [held for held in self._slots if held is not slot]
            self._gate.release(slot)

    def close(self) -> None:
        """The request has ended: the places of calls that never queued go back (vLLM answered 4xx
        after admitting them, the client left)."""
        for call in self._calls:
            self._give_back(call)

    def _take_places(self, call: Call) -> int:
        """The call's pending places, which the gate takes as it queues (granted or refused)."""
        places, call.places = call.places, 0
        return places

    def _give_back(self, call: Call) -> None:
        if call.places:
            self._gate.cancel_pending(call.priority, call.places)
            call.places = 0

    def _refusal(self, exc: GateRejected, arrival: bool = False) -> None:
        """The gate hears of the request's first refusal of those a client tries again (429, 503;
        not a 400): a retry where its arrival took an excused try and it never held a slot (an
        admitted arrival is demand), else a refusal whose id excuses the next tries
        (``AdmissionGate.refused``). ``arrival``: the preflight's refusal, whose arrival the gate has
        not counted yet."""
        if not self._refused and exc.status != HTTPStatus.BAD_REQUEST:
            self._gate.refused(self.request_id, retry=self._retry and not self._served, arrival=arrival)
        self._refused = True

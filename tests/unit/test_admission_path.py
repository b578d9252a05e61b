"""The data plane's admission path with the real gate and a fake engine: every ``generate()`` call
passes the gate's rules, whatever route or call pattern makes it.

``FakeServing`` has the call patterns of vLLM's handlers: a completion (``_preflight(n)`` once, then
one ``generate()`` per prompt, a stream returned before it runs; beam search calling ``generate()``
without a priority, one step after another), and the batch chat route (it does not ask
``_get_priority``: ``_preflight()`` once, then one ``generate()`` per conversation with the body's
priority).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from vllm.exceptions import GracefulHTTPError

from controller.admission.classes import PriorityBounds, PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.admission.ttft import TtftBounds
from controller.clock import FakeClock
from controller.control.capacity import new_arrivals
from controller.engine.frontend import context
from controller.engine.frontend.app import AdmissionMiddleware
from controller.engine.frontend.client import GateRefusal, GovernedEngineClient
from controller.engine.frontend.priority import resolve_priorities
from tests.helpers import Events, FakeHost, Recorder, settle, until

CLASSES = (
    PriorityClass("interactive", max_priority=0, max_queue=100, queue_deadline_s=1e6),
    PriorityClass("batch", min_priority=1, max_queue=100, queue_deadline_s=1e6),
)

ANY_PRIORITY = PriorityBounds()


class CountingLLM:
    """An engine whose requests take a few loop turns each, counting the sequences it runs at once
    and the priority each request ran at."""

    def __init__(self) -> None:
        self.running = self.most_running = 0
        self.priorities: list[int] = []
        self.encoded: list[tuple[str, int, Any]] = []

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(
        self, prompt: Any, params: Any, request_id: str, *, priority: int = 0, **kwargs: Any
    ) -> AsyncIterator[Any]:
        n = getattr(params, "n", 1)
        self.priorities.append(priority)
        self.running += n
        self.most_running = max(self.most_running, self.running)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
                yield SimpleNamespace(finished=False)
            yield SimpleNamespace(finished=True)
        finally:
            self.running -= n

    async def encode(
        self, prompt: Any, pooling_params: Any, request_id: str, *, priority: int = 0, **kwargs: Any
    ) -> AsyncIterator[Any]:
        self.encoded.append((request_id, priority, kwargs.get("lora_request")))
        async for output in self.generate(prompt, SimpleNamespace(n=1), request_id, priority=priority):
            yield output


async def merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[str]:
    """Every stream's outputs, the streams run together (vLLM's merge_async_iterators)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Any]) -> None:
        async for _ in stream:
            await queue.put("x")

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    done = asyncio.gather(*tasks)
    done.add_done_callback(lambda _: queue.put_nowait(None))
    while (item := await queue.get()) is not None:
        yield item
    await done


class FakeServing:
    def __init__(self, client: GovernedEngineClient) -> None:
        self.engine_client = client

    @staticmethod
    def _get_priority(request: dict[str, Any], raw_request: Request | None) -> int:
        return int(request.get("priority", 0))

    def _preflight(self, n: int = 1) -> None:
        self.engine_client.check_admission(n)

    async def _check_model(self, request: Any) -> Any:
        return None

    async def create_completion(self, request: dict[str, Any], raw_request: Request | None = None) -> Any:
        if (error := await self._check_model(SimpleNamespace(**request))) is not None:
            return error
        n = int(request.get("n", 1))
        self._preflight(n)
        if request.get("fail_after_preflight"):  # vLLM's render refuses it (a prompt past max_model_len)
            return JSONResponse({"error": "too long"}, status_code=400)
        if request.get("beam_steps"):
            return await self._beam_search(int(request["beam_steps"]))
        prompts = request.get("prompts", ["p"])
        params = SimpleNamespace(n=n)
        priority = self._get_priority(request, raw_request)
        streams = [
            self.engine_client.generate(p, params, f"c-{i}", priority=priority) for i, p in enumerate(prompts)
        ]
        if request.get("fail_after_generate"):
            return JSONResponse({"error": "bad"}, status_code=400)  # the generators never run
        if request.get("stream"):
            return merged(streams)
        return {"outputs": len([x async for x in merged(streams)])}

    async def _beam_search(self, steps: int) -> Any:
        for step in range(steps):  # as vLLM's online beam search: no priority, one call per beam
            async for _ in self.engine_client.generate("p", SimpleNamespace(n=1), f"beam-{step}"):
                pass
        return {"outputs": steps}

    async def create_batch_chat_completion(
        self, request: dict[str, Any], raw_request: Request | None = None
    ) -> Any:
        if (error := await self._check_model(SimpleNamespace(**request))) is not None:
            return error
        self._preflight()
        streams = [
            self.engine_client.generate(
                c, SimpleNamespace(n=1), f"b-{i}", priority=int(request.get("priority", 0))
            )
            for i, c in enumerate(request["conversations"])
        ]
        return {"outputs": len([x async for x in merged(streams)])}

    @staticmethod
    def create_error_response(message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": message, "param": param}, status_code=400)


def make_app(
    gate: AdmissionGate, llm: CountingLLM, bounds: PriorityBounds = ANY_PRIORITY
) -> httpx.AsyncClient:
    app = FastAPI()
    app.state.serving = FakeServing(GovernedEngineClient(FakeHost(llm), gate, lambda: None))  # type: ignore[arg-type]
    resolve_priorities(app.state)

    @app.exception_handler(GracefulHTTPError)
    async def graceful(request: Request, exc: GracefulHTTPError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=int(exc.http_status))

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Any:
        body = await raw_request.json()
        result = await app.state.serving.create_completion(body, raw_request)
        if isinstance(result, (JSONResponse, dict)):
            return result
        return StreamingResponse(f"data: {x}\n\n" async for x in result)

    @app.post("/v1/embeddings")
    async def embeddings(raw_request: Request) -> Any:
        # as vLLM's pooling handlers: no preflight, one encode() per prompt, keywords only
        body = await raw_request.json()
        client = app.state.serving.engine_client
        streams = [
            client.encode(
                request_id=f"embd-{i}", prompt=p, pooling_params=None, lora_request=None, priority=0
            )
            for i, p in enumerate(body["input"])
        ]
        return {"outputs": len([x async for x in merged(streams)])}

    @app.post("/v1/chat/completions/batch")
    async def batch(raw_request: Request) -> Any:
        return await app.state.serving.create_batch_chat_completion(await raw_request.json(), raw_request)

    transport = httpx.ASGITransport(app=AdmissionMiddleware(app, gate, lambda: bounds))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def make_gate(limit: int, max_queue: int = 100) -> tuple[AdmissionGate, Events]:
    events = Events()
    return AdmissionGate(limit, max_queue, CLASSES, events=Recorder([], events)), events


async def test_a_stream_with_more_prompts_than_the_limit_does_not_hold_the_gate() -> None:
    gate, _ = make_gate(limit=4)
    llm = CountingLLM()
    async with make_app(gate, llm) as http:
        stream = asyncio.create_task(
            http.post("/v1/completions", json={"prompts": ["a", "b", "c", "d", "e", "f"], "stream": True})
        )
        await settle()
        single = await asyncio.wait_for(http.post("/v1/completions", json={}), timeout=10.0)
        streamed = await asyncio.wait_for(stream, timeout=10.0)
    assert (streamed.status_code, single.status_code) == (200, 200)
    assert streamed.text.count("data:") == 6 * 4
    stats = gate.stats()
    assert (stats.in_flight, stats.queued, stats.pending) == (0, 0, 0)


async def test_the_batch_route_is_bounded_by_the_queue_limit() -> None:
    gate, _ = make_gate(limit=1, max_queue=4)
    seen: list[int] = []
    original = gate.acquire

    async def watched(*args: Any, **kwargs: Any) -> Any:
        stats = gate.stats()
        seen.append(stats.queued + stats.pending)
        return await original(*args, **kwargs)

    gate.acquire = watched  # type: ignore[method-assign]
    async with make_app(gate, CountingLLM()) as http:
        r = await http.post(
            "/v1/chat/completions/batch", json={"conversations": [f"c{i}" for i in range(40)]}
        )
        assert r.status_code == 429, r.text
        assert "gate queue limit 4" in r.json()["error"]
        stats = gate.stats()
        assert (stats.in_flight, stats.queued, stats.pending) == (0, 0, 0)  # nothing left behind
        ok = await http.post("/v1/chat/completions/batch", json={"conversations": ["a", "b", "c"]})
    assert (ok.status_code, ok.json()) == (200, {"outputs": 12})
    assert max(seen, default=0) <= 4 + 1
    assert gate.stats().arrivals_total == 2


async def test_a_batch_priority_more_urgent_than_allowed_is_refused_before_the_gate() -> None:
    gate, events = make_gate(limit=4)
    llm = CountingLLM()
    async with make_app(gate, llm, PriorityBounds(most_urgent=1, default=5)) as http:
        r = await http.post(
            "/v1/chat/completions/batch", json={"conversations": ["a", "b"], "priority": -1000}
        )
        assert (r.status_code, r.json()["param"]) == (400, "priority"), r.text
        assert llm.priorities == [] and events.admitted == events.rejected == []
        r = await http.post("/v1/chat/completions/batch", json={"conversations": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert llm.priorities == [5, 5]  # naming none: the default, not vLLM's 0
    assert [cls for cls, _ in events.admitted] == ["batch", "batch"]


async def test_beam_search_steps_keep_the_requests_priority() -> None:
    gate, events = make_gate(limit=4)
    llm = CountingLLM()
    async with make_app(gate, llm) as http:
        r = await http.post("/v1/completions", json={"beam_steps": 3, "priority": 7})
    assert r.status_code == 200, r.text
    assert llm.priorities == [7, 7, 7]
    assert [cls for cls, _ in events.admitted] == ["batch"] * 3
    assert gate.stats().arrivals_total == 1


async def test_a_later_call_of_a_served_request_is_not_refused_by_its_ttft_bound() -> None:
    """Its TTFT has happened: a beam search's next step queues from when it queues, not from the
    request's arrival long ago."""
    clock = FakeClock()
    gate = AdmissionGate(1, 100, CLASSES, clock=clock)
    gate.configure(ttft=TtftBounds({"interactive": 2.0}))
    client = GovernedEngineClient(FakeHost(CountingLLM()), gate, lambda: None)  # type: ignore[arg-type]
    with context.entered(context.RequestContext(arrived_mono=clock()), gate):
        client.check_admission()
        first = [x async for x in client.generate("p", None, "step-0")]
        clock.advance(10.0)  # the request is long past its 2 s bound: its first token came in time
        held = await gate.acquire(0)
        step = asyncio.create_task(anext(client.generate("p", None, "step-1")))
        await settle()
        assert not step.done() and gate.stats().queued == 1  # waiting, not refused at once
        gate.release(held)
        await asyncio.wait_for(step, timeout=5.0)
    assert len(first) == 4


async def test_n_sequences_hold_n_of_the_limit() -> None:
    gate, _ = make_gate(limit=4)
    llm = CountingLLM()
    async with make_app(gate, llm) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json={"n": 4}) for _ in range(4)))
    assert [r.status_code for r in answers] == [200] * 4
    assert llm.most_running == 4
    assert gate.stats().in_flight == 0


async def test_n_above_the_limit_runs_alone() -> None:
    gate, _ = make_gate(limit=4)
    llm = CountingLLM()
    async with make_app(gate, llm) as http:
        answers = await asyncio.gather(
            http.post("/v1/completions", json={"n": 8}), http.post("/v1/completions", json={"n": 1})
        )
    assert [r.status_code for r in answers] == [200, 200]
    assert llm.most_running == 8  # never 9: the other request waited for it
    assert gate.stats().in_flight == 0


async def test_a_generator_that_never_runs_gives_its_pending_place_back() -> None:
    gate, _ = make_gate(limit=1)
    async with make_app(gate, CountingLLM()) as http:
        r = await http.post("/v1/completions", json={"prompts": ["a", "b"], "fail_after_generate": True})
        assert r.status_code == 400
        assert gate.stats().pending == 0  # not 2 until the 30 s expiry


def test_refusals_of_a_generate_call_are_the_gates_http_errors() -> None:
    assert issubclass(GateRefusal, GracefulHTTPError)


async def test_check_admission_refuses_before_vllm_renders_and_counts_nothing() -> None:
    """vLLM calls ``check_admission`` before it tokenizes: a request the gate would refuse now is
    refused there, and counted as an arrival; one it admits is counted by its first call and holds
    no place until its calls."""
    gate, events = make_gate(limit=1, max_queue=0)
    client = GovernedEngineClient(FakeHost(CountingLLM()), gate, lambda: None)  # type: ignore[arg-type]
    held = await gate.acquire(0)
    refused = context.RequestContext()
    with context.entered(refused, gate):
        try:
            client.check_admission()
            raise AssertionError("admitted past a full gate")
        except GateRefusal as exc:
            assert exc.http_status == 429 and refused.refusal is not None
    gate.release(held)
    with context.entered(context.RequestContext(), gate):
        client.check_admission()
        assert (gate.stats().pending, gate.stats().arrivals_total) == (0, 1)  # the refused one
        outputs = [x async for x in client.generate("p", SimpleNamespace(n=1), "r")]
    assert len(outputs) == 4 and gate.stats().arrivals_total == 2  # the refused one and this one
    assert [cls for cls, _ in events.rejected] == ["interactive"]


async def test_a_pooling_request_passes_the_gate_as_a_generating_one() -> None:
    """``encode()`` (embeddings, classification, scoring) is gated: refused with 429 while the gate is
    full and with 503 while it refuses everyone, counted as an arrival, and run under a slot."""
    gate = AdmissionGate(1, 0, (PriorityClass("all", max_queue=0, queue_deadline_s=1e6),), clock=FakeClock())
    llm = CountingLLM()
    async with make_app(gate, llm) as http:
        held = await gate.acquire()
        r = await http.post("/v1/embeddings", json={"input": ["a"]})
        assert r.status_code == 429, r.text
        gate.refuse_all(GateRejected("restart budget spent", 503, 60, "engine_unavailable"))
        r = await http.post("/v1/embeddings", json={"input": ["a"]})
        assert r.status_code == 503, r.text
        gate.reopen()
        gate.release(held)
        gate.set_limit(2)  # room for its two prompts' calls, with no queue
        assert llm.encoded == []
        r = await http.post("/v1/embeddings", json={"input": ["a", "b"]})
        assert r.status_code == 200, r.text
    assert [request_id for request_id, _, _ in llm.encoded] == ["embd-0", "embd-1"]
    stats = gate.stats()
    assert (stats.arrivals_total, stats.admitted_total, stats.in_flight) == (3, 3, 0)  # the held one too


async def test_a_request_vllm_refuses_after_its_preflight_is_no_demand() -> None:
    """vLLM answers 400 after the preflight admitted the request (its prompt past ``max_model_len``,
    found when it renders): no ``generate()`` call follows, and it counts as no arrival; a request
    the preflight refuses and one that runs count one each."""
    gate = AdmissionGate(1, 0, (PriorityClass("all", max_queue=0, queue_deadline_s=1e6),), clock=FakeClock())
    async with make_app(gate, CountingLLM()) as http:
        for _ in range(3):
            r = await http.post("/v1/completions", json={"fail_after_preflight": True})
            assert r.status_code == 400, r.text
        assert gate.stats().arrivals_total == 0
        held = await gate.acquire()
        r = await http.post("/v1/completions", json={})
        assert r.status_code == 429, r.text
        gate.release(held)
        r = await http.post("/v1/completions", json={})
        assert r.status_code == 200, r.text
    assert (gate.stats().arrivals_total, gate.stats().pending) == (2, 0)


async def test_a_refused_request_tried_again_by_its_id_is_a_retry_not_an_arrival() -> None:
    """What a router does with a 429: the same request, the same ``X-Request-Id``, once more. The
    gate counts each try in ``arrivals_total`` and the refused tries of an id it refused in
    ``retries_total``."""
    clock = FakeClock()
    gate = AdmissionGate(1, 0, (PriorityClass("all", max_queue=0, queue_deadline_s=1e6),), clock=clock)
    held = await gate.acquire()
    async with make_app(gate, CountingLLM()) as http:
        for request_id in ("r1", "r1", "r2", "r1"):
            r = await http.post("/v1/completions", json={}, headers={"x-request-id": request_id})
            assert r.status_code == 429, r.text
        r = await http.post("/v1/completions", json={})  # no id: new demand on every try
        assert r.status_code == 429, r.text
        gate.release(held)
        r = await http.post("/v1/completions", json={}, headers={"x-request-id": "r2"})
        assert r.status_code == 200, r.text  # admitted: demand, though r2 was refused lately
    stats = gate.stats()
    assert (stats.arrivals_total, stats.retries_total) == (6, 2)


async def test_one_id_reused_for_every_request_hides_no_admitted_and_few_refused_requests() -> None:
    """A client that sends one fixed ``X-Request-Id`` with every request: of its requests the gate
    refuses, one in five counts as new demand (a refusal excuses a router's four retries, and the
    refusal of a retry excuses no more); every one it admits counts."""
    clock = FakeClock()
    gate = AdmissionGate(1, 0, (PriorityClass("all", max_queue=0, queue_deadline_s=1e6),), clock=clock)
    held = await gate.acquire()
    async with make_app(gate, CountingLLM()) as http:
        for _ in range(20):
            r = await http.post("/v1/completions", json={}, headers={"x-request-id": "same"})
            assert r.status_code == 429, r.text
        assert new_arrivals(gate.stats()) == 4
        gate.release(held)
        for _ in range(2):
            r = await http.post("/v1/completions", json={}, headers={"x-request-id": "same"})
            assert r.status_code == 200, r.text
        assert new_arrivals(gate.stats()) == 6


async def test_an_n_that_no_idle_gate_admits_is_a_400_counted_as_no_demand() -> None:
    """A request whose n overflows the queue limits with every slot free gets 400 naming how many
    sequences fit (no Retry-After: a router does not retry a 400), not a 429 its client would
    retry for ever; it is neither an arrival nor a refused id whose next tries are excused."""
    gate = AdmissionGate(4, 8, CLASSES, clock=FakeClock())  # the gate's 4 slots and 8 queue places
    async with make_app(gate, CountingLLM()) as http:
        for _ in range(2):
            r = await http.post("/v1/completions", json={"n": 500}, headers={"x-request-id": "big"})
            assert r.status_code == 400, r.text
            assert "retry-after" not in r.headers and "at most 12 sequences" in r.json()["error"]
    stats = gate.stats()
    assert (stats.arrivals_total, stats.retries_total, stats.rejected_total) == (0, 0, 0)
    assert len(gate.refused_ids) == 0


async def test_a_request_refused_in_the_queue_tried_again_is_a_retry() -> None:
    """A refusal of a request that had queued (its deadline passed) marks its id as well as one at
    the door."""
    clock = FakeClock()
    gate = AdmissionGate(1, 1, (PriorityClass("all", max_queue=1, queue_deadline_s=1.0),), clock=clock)
    held = await gate.acquire()
    async with make_app(gate, CountingLLM()) as http:
        for _ in range(2):
            queued = asyncio.create_task(
                http.post("/v1/completions", json={}, headers={"x-request-id": "r1"})
            )
            await until(lambda: gate.stats().queued == 1)
            clock.advance(2.0)
            assert gate.expire_overdue() == 1
            r = await queued
            assert r.status_code == 429, r.text
    gate.release(held)
    stats = gate.stats()
    assert (stats.arrivals_total, stats.retries_total, stats.timed_out_total) == (2, 1, 2)

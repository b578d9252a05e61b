"""Reliability of the admission gate and the governed client under refusals, many-prompt requests,
retired engines and reused request ids (issue "Never less reliable"). Fakes only, no engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import GracefulHTTPError

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate, GateRejected
from controller.clock import FakeClock
from controller.engine.frontend import tickets
from controller.engine.frontend.app import AdmissionMiddleware
from controller.engine.frontend.client import GovernedEngineClient

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
            await gate.acquire(0, from_pending=False)
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


class FakeHost:
    def __init__(self) -> None:
        self.llm = FakeLLM()
        self.in_flight: set[str] = set()
        self.aborted: dict[str, str] = {}


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
        streams = [self.client.generate(p, None, f"cmpl-{i}", priority=0) for i, p in enumerate(prompts)]

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
    serving = FakeCompletions(GovernedEngineClient(FakeHost(), gate, lambda: None))  # type: ignore[arg-type]
    app.state.serving = serving
    tickets.capture_priorities(app.state)

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
    gate.check_admission(0, 12, calls=12)
    with pytest.raises(GateRejected) as info:
        gate.check_admission(0, 12, calls=12)
    assert info.value.status == 429
    assert gate.stats().pending == 12
    gate.cancel_pending(0, 12)
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

"""The data plane's admission path without an engine: the middleware's ticket carries the request's
priority into ``check_admission`` (which vLLM calls without it), refusals get their class's
Retry-After, a deadline expiry answers 429, and a request vLLM refuses after admission (4xx) gives
its pending place back. vLLM's serving object is replaced by a fake with the same entry-point shape."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from vllm.exceptions import GracefulHTTPError

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.engine.frontend import tickets
from controller.engine.frontend.app import AdmissionMiddleware
from controller.engine.frontend.client import GateRefusal, GovernedEngineClient
from tests.helpers import Events, FakeHost, Recorder


class FakeLLM:
    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[int]:
        for i in range(3):
            yield i


class FakeServing:
    """vLLM's GenerateBaseServing shape: _get_priority, _preflight, create_completion."""

    def __init__(self, client: GovernedEngineClient) -> None:
        self.client = client

    @staticmethod
    def _get_priority(request: dict[str, Any], raw_request: Request | None) -> int:
        if raw_request is not None and raw_request.headers.get("x-vllm-priority") is not None:
            return int(raw_request.headers["x-vllm-priority"])
        return int(request.get("priority", 0))

    def _preflight(self, n: int = 1) -> None:
        self.client.check_admission(n)

    async def create_completion(self, request: dict[str, Any], raw_request: Request | None = None) -> Any:
        self._preflight()
        if request.get("prompt_too_long"):
            return JSONResponse({"error": "prompt too long"}, status_code=400)  # vLLM's render fails
        stream = self.client.generate("p", None, "id", priority=self._get_priority(request, raw_request))
        return {"outputs": [x async for x in stream]}


def make_app(gate: AdmissionGate) -> httpx.AsyncClient:
    app = FastAPI()
    client = GovernedEngineClient(FakeHost(FakeLLM()), gate, lambda: None)  # type: ignore[arg-type]
    app.state.serving = FakeServing(client)
    assert tickets.capture_priorities(app.state) == 1
    assert tickets.capture_priorities(app.state) == 0  # idempotent (refresh after an engine swap)

    @app.exception_handler(GracefulHTTPError)
    async def graceful(request: Request, exc: GracefulHTTPError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=int(exc.http_status))

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Any:
        return await app.state.serving.create_completion(await raw_request.json(), raw_request)

    transport = httpx.ASGITransport(app=AdmissionMiddleware(app, gate))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def make_gate(interactive_deadline_s: float = 5.0) -> tuple[AdmissionGate, Events]:
    classes = (
        PriorityClass("interactive", max_priority=0, max_queue=1, queue_deadline_s=interactive_deadline_s),
        PriorityClass("batch", min_priority=1, max_queue=0, queue_deadline_s=30.0),
    )
    events = Events()
    return AdmissionGate(1, 100, classes, events=Recorder([], events)), events


async def test_requests_are_served_through_the_gate() -> None:
    gate, events = make_gate()
    async with make_app(gate) as http:
        r = await http.post("/v1/completions", json={"priority": 3})
    assert (r.status_code, r.json()) == (200, {"outputs": [0, 1, 2]})
    assert [cls for cls, _ in events.admitted] == ["batch"]
    assert gate.stats().in_flight == 0 and gate.stats().pending == 0


@pytest.mark.parametrize(
    ("body", "headers", "cls"),
    [({"priority": 5}, {}, "batch"), ({}, {"X-Vllm-Priority": "7"}, "batch")],
)
async def test_refusal_names_the_class_from_body_or_header(
    body: dict[str, Any], headers: dict[str, str], cls: str
) -> None:
    gate, events = make_gate()
    held = await gate.acquire(0)  # the only slot is busy: batch (max_queue 0) cannot wait
    async with make_app(gate) as http:
        r = await http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert "batch requests already wait" in r.json()["error"]
    assert events.rejected == [(cls, "queue_full")]
    gate.release(held)


async def test_deadline_in_the_queue_answers_429_with_retry_after() -> None:
    gate, events = make_gate(interactive_deadline_s=0.05)
    held = await gate.acquire(0)
    async with make_app(gate) as http:
        r = await http.post("/v1/completions", json={"priority": 0})
    assert r.status_code == 429
    assert "past the interactive deadline" in r.json()["error"]
    assert int(r.headers["retry-after"]) >= 1
    assert [cls for cls, _ in events.timed_out] == ["interactive"]
    assert gate.stats().queued == 0 and gate.stats().pending == 0
    gate.release(held)


async def test_a_4xx_after_admission_gives_the_pending_place_back() -> None:
    gate, _ = make_gate()
    async with make_app(gate) as http:
        for _ in range(5):
            r = await http.post("/v1/completions", json={"prompt_too_long": True})
            assert r.status_code == 400
        assert gate.stats().pending == 0
        r = await http.post("/v1/completions", json={})
    assert r.status_code == 200


def test_gate_refusal_tracebacks_are_dropped_from_the_serving_loggers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = FastAPI()
    app.state.serving = FakeServing(GovernedEngineClient(FakeHost(FakeLLM()), make_gate()[0], lambda: None))  # type: ignore[arg-type]
    tickets.capture_priorities(app.state, GateRefusal)
    logger = logging.getLogger(FakeServing.__module__)
    with caplog.at_level(logging.INFO, logger=FakeServing.__module__):
        for exc in (GateRefusal("waited too long", HTTPStatus.TOO_MANY_REQUESTS), RuntimeError("a real bug")):
            try:
                raise exc
            except Exception:
                logger.exception("Error in completion stream generator.")
    assert [r.exc_info[1].__class__.__name__ for r in caplog.records if r.exc_info] == ["RuntimeError"]


async def test_the_slot_returns_when_the_engine_finishes_not_when_the_client_has_read() -> None:
    from types import SimpleNamespace

    class FinishingLLM(FakeLLM):
        async def generate(
            self, prompt: Any, params: Any, request_id: str, **kwargs: Any
        ) -> AsyncIterator[Any]:
            yield SimpleNamespace(finished=False)
            yield SimpleNamespace(finished=True)

    host = FakeHost(FakeLLM())
    host.llm = FinishingLLM()
    gate, _ = make_gate()
    client = GovernedEngineClient(host, gate, lambda: None)  # type: ignore[arg-type]
    stream = client.generate("p", None, "r1", priority=0)
    first = await anext(stream)
    assert not first.finished and gate.stats().in_flight == 1
    assert [request_id for request_id, _ in host.in_flight.values()] == ["r1"]
    last = await anext(stream)  # the client has not read it yet: the engine is done with it
    assert last.finished and gate.stats().in_flight == 0 and host.in_flight == {}
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    assert gate.stats().completed_total == 1  # released once

"""The data plane's admission path without an engine: the request's context carries its priority
into ``generate()`` (where the gate's rules run), refusals get their class's Retry-After, a deadline
expiry answers 429 (streamed or not: the middleware holds a stream's 200 until its first chunk), and
a request vLLM refuses after admission (4xx) gives its pending place back. vLLM's serving object is
replaced by a fake with the same shape (``_get_priority``, ``_preflight``, a stream that turns an
error into an error event, as vLLM's stream generators do)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from vllm.exceptions import GracefulHTTPError

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.engine.frontend.app import AdmissionMiddleware
from controller.engine.frontend.client import GateRefusal, GovernedEngineClient
from controller.engine.frontend.priority import resolve_priorities
from tests.helpers import Events, FakeHost, Recorder, until


class FakeLLM:
    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[int]:
        for i in range(3):
            yield i


class Body(dict[str, Any]):
    """A request body with vLLM's request models' ``stream`` attribute."""

    @property
    def stream(self) -> bool:
        return bool(self.get("stream"))


class FakeServing:
    """vLLM's GenerateBaseServing shape: _check_model, _get_priority, _preflight, create_completion
    (a stream is returned as its generator, as vLLM's handler does), create_error_response."""

    def __init__(self, client: GovernedEngineClient) -> None:
        self.client = self.engine_client = client

    @staticmethod
    def _get_priority(request: dict[str, Any], raw_request: Request | None) -> int:
        if raw_request is not None and raw_request.headers.get("x-vllm-priority") is not None:
            return int(raw_request.headers["x-vllm-priority"])
        return int(request.get("priority", 0))

    def _preflight(self, n: int = 1) -> None:
        self.client.check_admission(n)

    async def _check_model(self, request: Any) -> Any:
        return None

    async def create_completion(self, request: dict[str, Any], raw_request: Request | None = None) -> Any:
        if (error := await self._check_model(SimpleNamespace(**request))) is not None:
            return error
        self._preflight()
        if request.get("prompt_too_long"):
            return JSONResponse({"error": "prompt too long"}, status_code=400)  # vLLM's render fails
        stream = self.client.generate("p", None, "id", priority=self._get_priority(request, raw_request))
        if request.get("stream"):
            return stream
        return {"outputs": [x async for x in stream]}

    @staticmethod
    def create_error_response(message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": message, "param": param}, status_code=400)


async def events(stream: AsyncIterator[Any]) -> AsyncIterator[str]:
    """vLLM's stream generators: an error (the gate's refusal) becomes an error event in the 200."""
    try:
        async for x in stream:
            yield f"data: {x}\n\n"
    except Exception as exc:
        yield f"data: {{'error': {str(exc)!r}}}\n\n"
    yield "data: [DONE]\n\n"


class StatusLines:
    """ASGI: the status of each response as it starts (httpx's test transport returns a response
    only once it has ended)."""

    def __init__(self, app: Any, started: list[int]) -> None:
        self.app, self.started = app, started

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.started.append(message["status"])
            await send(message)

        await self.app(scope, receive, sending)


def make_app(gate: AdmissionGate, started: list[int] | None = None) -> httpx.AsyncClient:
    app = FastAPI()
    client = GovernedEngineClient(FakeHost(FakeLLM()), gate, lambda: None)  # type: ignore[arg-type]
    app.state.serving = FakeServing(client)
    assert resolve_priorities(app.state) == 1
    assert resolve_priorities(app.state) == 0  # idempotent (refresh after an engine swap)

    @app.exception_handler(GracefulHTTPError)
    async def graceful(request: Request, exc: GracefulHTTPError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=int(exc.http_status))

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Any:
        body = Body(await raw_request.json())
        result = await app.state.serving.create_completion(body, raw_request)
        if body.get("drop_stream") and not isinstance(result, JSONResponse):
            return {"dropped": True}  # the stream never runs, as when its client leaves first
        if body.stream and not isinstance(result, JSONResponse):
            return StreamingResponse(events(result))
        return result

    transport = httpx.ASGITransport(
        app=StatusLines(AdmissionMiddleware(app, gate), [] if started is None else started)
    )
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
    resolve_priorities(app.state, GateRefusal)
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


async def test_a_stream_whose_deadline_passes_in_the_queue_gets_429_not_200() -> None:
    gate, events = make_gate(interactive_deadline_s=0.05)
    held = await gate.acquire(0)
    async with make_app(gate) as http:
        r = await http.post("/v1/completions", json={"priority": 0, "stream": True})
    assert r.status_code == 429, r.text
    assert "past the interactive deadline" in r.json()["error"]["message"]  # vLLM's error body
    assert r.json()["error"]["code"] == 429 and "[DONE]" not in r.text
    assert int(r.headers["retry-after"]) >= 1
    assert [cls for cls, _ in events.timed_out] == ["interactive"]
    assert gate.stats().queued == 0 and gate.stats().pending == 0
    gate.release(held)


async def test_a_stream_waits_for_its_slot_before_its_200() -> None:
    import asyncio

    gate, _ = make_gate()
    held, started = await gate.acquire(0), []
    async with make_app(gate, started) as http:
        answer = asyncio.create_task(http.post("/v1/completions", json={"priority": 0, "stream": True}))
        await until(lambda: gate.stats().queued > 0)
        assert gate.stats().queued == 1 and started == []  # no status line while it waits
        gate.release(held)
        r = await answer
    assert r.status_code == 200 and started == [200]
    assert r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert gate.stats().in_flight == 0 and gate.stats().pending == 0
    assert gate.stats().completed_total == 2  # the held slot and the stream's, each released once


async def test_the_pending_place_of_a_stream_that_never_runs_goes_back() -> None:
    gate, _ = make_gate()
    async with make_app(gate) as http:
        for _ in range(3):  # more than the gate's one slot, if they leaked
            r = await http.post("/v1/completions", json={"stream": True, "drop_stream": True})
            assert (r.status_code, r.json()) == (200, {"dropped": True})
    assert gate.stats().in_flight == 0 and gate.stats().pending == 0

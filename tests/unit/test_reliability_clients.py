"""What one client may cost (issue 16, items 5 and 11): a client that stops reading no longer pins
its admission slot (it returns when the engine finishes), a response write it does not take is
bounded (``send_timeout_s``), the data plane caps its connections, and a request body past
``max_body_bytes`` gets 413. Fakes stand in for vLLM's engine and app; the gate is real."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.engine.frontend.app import make_server
from controller.engine.frontend.client import GovernedEngineClient
from controller.engine.frontend.limits import ClientLimits, Limits, SendStalled
from tests.helpers import FakeHost


def small_gate() -> AdmissionGate:
    return AdmissionGate(2, 16, (PriorityClass("all", queue_deadline_s=1e6),), clock=FakeClock())


class QuickLLM:
    """An engine that finishes a request in three outputs, as fast as they are taken; ``closed``
    says whether vLLM's generator was closed before the end (vLLM aborts the request then)."""

    def __init__(self, hang_after_first: bool = False) -> None:
        self.hang_after_first = hang_after_first
        self.closed_early = False

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        pass

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        done = False
        try:
            yield SimpleNamespace(finished=False, n=0)
            if self.hang_after_first:
                await asyncio.Event().wait()
            yield SimpleNamespace(finished=False, n=1)
            done = True
            yield SimpleNamespace(finished=True, n=2)
        finally:
            self.closed_early = not done


async def test_the_slot_returns_when_the_engine_finishes_not_when_the_client_reads() -> None:
    gate, llm = small_gate(), QuickLLM()
    client = GovernedEngineClient(FakeHost(llm), gate, lambda: None)  # type: ignore[arg-type]
    stream = client.generate("p", None, "r1")
    first = await anext(stream)  # the handler took one output, then blocks in its socket write
    assert first.n == 0
    for _ in range(10):
        await asyncio.sleep(0)
    assert gate.stats().in_flight == 0  # the engine finished: the slot is back
    rest = [o.n async for o in stream]  # the client reads again: nothing was lost
    assert rest == [1, 2] and gate.stats().in_flight == 0 and gate.completed_total == 1


async def test_a_client_gone_mid_stream_closes_the_engine_request_and_frees_the_slot() -> None:
    gate, llm = small_gate(), QuickLLM(hang_after_first=True)
    host = FakeHost(llm)
    client = GovernedEngineClient(host, gate, lambda: None)  # type: ignore[arg-type]
    stream = client.generate("p", None, "r1")
    await anext(stream)
    assert gate.stats().in_flight == 1
    await stream.aclose()  # the client disconnected
    assert llm.closed_early and gate.stats().in_flight == 0 and host.in_flight == {}


# -- the send timeout -----------------------------------------------------------------------------


async def test_a_response_write_the_client_never_takes_ends_after_send_timeout() -> None:
    sent: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})

    async def stalled_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the socket's buffers are full: the client reads nothing
        sent.append(message["type"])

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    limited = ClientLimits(app, Limits(send_timeout_s=0.2))
    scope = {"type": "http", "path": "/v1/completions", "headers": []}
    with pytest.raises(SendStalled, match="send_timeout_s"):
        await asyncio.wait_for(limited(scope, receive, stalled_send), 5.0)
    assert sent == ["http.response.start"]


def test_the_data_plane_caps_its_connections() -> None:
    args = argparse.Namespace(
        host="127.0.0.1", port=0, uvicorn_log_level="info", disable_uvicorn_access_log=True
    )
    server = make_server(FastAPI(), args, 5.0, small_gate(), limits=Limits(max_connections=7))
    assert server.config.limit_concurrency == 7


# -- the request body limit (item 11) --------------------------------------------------------------


def echo_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, int]:
        return {"received": len(await request.body())}

    return app


async def post(app: Any, content: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.post("/v1/completions", content=content, headers=headers)


async def test_a_body_over_max_body_bytes_gets_413_and_never_reaches_the_app() -> None:
    app = ClientLimits(echo_app(), Limits(max_body_bytes=1024))
    r = await post(app, b"x" * 1025)
    assert r.status_code == 413 and "max_body_bytes = 1024" in r.json()["error"]["message"]
    ok = await post(app, b"x" * 1024)
    assert ok.status_code == 200 and ok.json() == {"received": 1024}


async def test_a_chunked_body_over_the_limit_gets_413_and_one_under_it_arrives_whole() -> None:
    app = ClientLimits(echo_app(), Limits(max_body_bytes=1024))

    async def chunks(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b"y" * 300

    r = await post(app, chunks(4))  # no Content-Length: sent chunked
    assert r.status_code == 413
    ok = await post(app, chunks(3))
    assert ok.status_code == 200 and ok.json() == {"received": 900}

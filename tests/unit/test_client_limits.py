"""What one client may cost: a client that stops reading no longer pins
its admission slot (it returns when the engine finishes), a response write it does not take is
bounded (``send_timeout_s``), the data plane caps its connections, and a request body past
``max_body_bytes`` gets 413. Fakes stand in for vLLM's engine and app; the gate is real."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from vllm.outputs import CompletionOutput, RequestOutput

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.engine.frontend.app import make_server
from controller.engine.frontend.client import GovernedEngineClient
from controller.engine.frontend.limits import ClientLimits, SendStalled, ServerLimits, StallWatch
from controller.engine.frontend.pump import EngineStream
from tests.helpers import FakeHost, settle


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

    limited = ClientLimits(app, ServerLimits(send_timeout_s=0.2))
    scope = {"type": "http", "path": "/v1/completions", "headers": []}
    with pytest.raises(SendStalled, match="send_timeout_s"):
        await asyncio.wait_for(limited(scope, receive, stalled_send), 5.0)
    assert sent == ["http.response.start"]


def test_the_data_plane_caps_its_connections() -> None:
    args = argparse.Namespace(
        host="127.0.0.1", port=0, uvicorn_log_level="info", disable_uvicorn_access_log=True
    )
    server = make_server(FastAPI(), args, 5.0, small_gate(), limits=ServerLimits(max_connections=7))
    assert server.config.limit_concurrency == 7


# -- the request body limit --------------------------------------------------------------------------


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
    app = ClientLimits(echo_app(), ServerLimits(max_body_bytes=1024))
    r = await post(app, b"x" * 1025)
    assert r.status_code == 413 and "max_body_bytes = 1024" in r.json()["error"]["message"]
    ok = await post(app, b"x" * 1024)
    assert ok.status_code == 200 and ok.json() == {"received": 1024}


async def test_a_chunked_body_over_the_limit_gets_413_and_one_under_it_arrives_whole() -> None:
    app = ClientLimits(echo_app(), ServerLimits(max_body_bytes=1024))

    async def chunks(n: int) -> AsyncIterator[bytes]:
        for _ in range(n):
            yield b"y" * 300

    r = await post(app, chunks(4))  # no Content-Length: sent chunked
    assert r.status_code == 413
    ok = await post(app, chunks(3))
    assert ok.status_code == 200 and ok.json() == {"received": 900}


# -- the send timeout's watch: one timer per response, exact on a fake clock ------------------------


class FakeTimer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeTimers:
    """An event loop's clock and timers that move only when told; ``made`` counts the timers armed."""

    def __init__(self) -> None:
        self.clock = FakeClock(0.0)
        self.armed: list[tuple[float, Callable[[], object], FakeTimer]] = []
        self.made = 0

    def time(self) -> float:
        return self.clock()

    def call_at(self, when: float, callback: Callable[[], object], /) -> FakeTimer:
        self.made += 1
        timer = FakeTimer()
        self.armed.append((when, callback, timer))
        return timer

    def advance_to(self, when: float) -> None:
        self.clock.advance(when - self.clock())
        while due := [t for t in self.armed if t[0] <= when]:
            first = min(due, key=lambda t: t[0])
            self.armed.remove(first)
            if not first[2].cancelled:
                first[1]()


class FakeTask:
    """A task's cancel count, as ``asyncio.Task`` keeps it."""

    def __init__(self) -> None:
        self.count = 0

    def cancel(self, msg: Any = None) -> bool:
        self.count += 1
        return True

    def cancelling(self) -> int:
        return self.count

    def uncancel(self) -> int:
        self.count -= 1
        return self.count


def test_a_write_in_progress_for_send_timeout_cancels_its_task_then_and_not_before() -> None:
    timers, task = FakeTimers(), FakeTask()
    watch = StallWatch(30.0, timers)
    timers.advance_to(5.0)
    watch.begin(task)
    timers.advance_to(34.999)
    assert task.count == 0
    timers.advance_to(35.0)
    assert task.count == 1 and watch.owns(task) and task.count == 0


def test_writes_that_complete_arm_one_timer_per_send_timeout_not_one_per_write() -> None:
    timers, task = FakeTimers(), FakeTask()
    watch = StallWatch(30.0, timers)
    for i in range(1, 2001):  # a write every 10 ms for 20 s, each taken by the client at once
        timers.advance_to(i * 0.01)
        watch.begin(task)
        watch.end()
    assert timers.made == 1 and task.count == 0
    timers.advance_to(31.0)  # the timer finds no write in progress: none is armed again
    assert timers.made == 1 and task.count == 0 and not watch.owns(task)


def test_a_write_begun_after_the_timer_was_armed_gets_its_whole_timeout() -> None:
    timers, task = FakeTimers(), FakeTask()
    watch = StallWatch(30.0, timers)
    watch.begin(task)
    timers.advance_to(10.0)
    watch.end()
    timers.advance_to(20.0)
    watch.begin(task)  # this write stalls
    timers.advance_to(30.0)  # the timer armed for the first write finds a later one: armed again
    assert task.count == 0 and timers.made == 2
    timers.advance_to(49.999)
    assert task.count == 0
    timers.advance_to(50.0)
    assert task.count == 1 and watch.owns(task)


def test_a_cancellation_from_elsewhere_during_the_watch_s_own_is_not_taken_back() -> None:
    timers, task = FakeTimers(), FakeTask()
    watch = StallWatch(30.0, timers)
    watch.begin(task)
    timers.advance_to(30.0)
    task.cancel()  # the server's shutdown cancels the same task in the same turn
    assert not watch.owns(task) and task.count == 1  # the shutdown's cancellation stands


def test_a_closed_watch_leaves_no_timer_armed() -> None:
    timers, task = FakeTimers(), FakeTask()
    watch = StallWatch(30.0, timers)
    watch.begin(task)
    watch.end()
    watch.close()
    assert [t.cancelled for _, _, t in timers.armed] == [True]


async def test_a_cancelled_request_is_cancelled_not_stalled_whatever_its_send_timeout() -> None:
    started = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})

    async def slow_send(message: dict[str, Any]) -> None:
        started.set()
        await asyncio.Event().wait()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    limited = ClientLimits(app, ServerLimits(send_timeout_s=30.0))
    scope = {"type": "http", "path": "/v1/completions", "headers": []}
    task = asyncio.create_task(limited(scope, receive, slow_send))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- the output pump: outputs the reader has not taken are merged as vLLM merges them --------------


def delta(text: str, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, text, [ord(c) for c in text], None, None)
    return RequestOutput("r", None, [1], None, [completion], finished)


async def test_delta_outputs_the_reader_has_not_taken_arrive_as_one_with_every_token() -> None:
    async def engine() -> AsyncIterator[Any]:
        for text in ("a", "b", "c"):
            yield delta(text)
        yield delta("d", finished=True)

    finished: list[bool] = []
    outputs = EngineStream(engine(), lambda: finished.append(True), aggregate=True).outputs()
    first = await anext(outputs)
    await settle()  # the pump reads the rest while the reader is busy elsewhere
    rest = [o async for o in outputs]
    assert first.outputs[0].text == "a" and finished
    assert [(o.outputs[0].text, o.outputs[0].token_ids, o.finished) for o in rest] == [
        ("bcd", [98, 99, 100], True)
    ]


async def test_outputs_that_cannot_merge_arrive_one_by_one_in_order() -> None:
    async def engine() -> AsyncIterator[Any]:
        for n in range(4):
            yield SimpleNamespace(finished=n == 3, n=n)

    outputs = EngineStream(engine(), lambda: None, aggregate=True).outputs()
    first = await anext(outputs)
    await settle()
    assert [first.n] + [o.n async for o in outputs] == [0, 1, 2, 3]


async def test_the_engine_s_error_comes_after_the_outputs_before_it() -> None:
    async def engine() -> AsyncIterator[Any]:
        yield SimpleNamespace(finished=False, n=0)
        yield SimpleNamespace(finished=False, n=1)
        raise RuntimeError("engine died")

    outputs = EngineStream(engine(), lambda: None).outputs()
    seen = [(await anext(outputs)).n]
    await settle()
    with pytest.raises(RuntimeError, match="engine died"):
        async for o in outputs:
            seen.append(o.n)
    assert seen == [0, 1]

"""The load generator's request/record path against an in-process OpenAI-style streaming server."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.load import client as client_module
from controller.load.client import Answer, Target, parse_event, payload, post, run_open_loop
from controller.load.workload import RequestSpec
from controller.results.records import RequestRecord
from tests.helpers import settle

BODIES = web.AppKey("bodies", list[dict[str, Any]])
ALL_SENT = web.AppKey("all_sent", asyncio.Event)
"""Set when every request of the test has reached the server: the "ok" stream sends its tokens only
then, so the others leave while it is streaming, however slowly the box runs."""
REQUESTS = 4


def _chunk(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    if len(request.app[BODIES]) == REQUESTS:
        request.app[ALL_SENT].set()
    prompt = body["prompt"]
    if prompt.startswith("refuse"):
        return web.json_response({"error": "overloaded"}, status=429)
    if prompt.startswith("break"):
        return web.json_response({"error": "boom"}, status=500)
    resp = web.StreamResponse()
    await resp.prepare(request)
    if prompt.startswith("ok"):
        await request.app[ALL_SENT].wait()
    n = body["max_tokens"] - (1 if prompt.startswith("short") else 0)
    for i in range(n):
        await resp.write(_chunk({"choices": [{"index": 0, "text": f" t{i}"}]}))
    await resp.write(_chunk({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def server() -> Any:
    app = web.Application()
    app[BODIES] = []
    app[ALL_SENT] = asyncio.Event()
    app.router.add_post("/v1/completions", completions)
    async with TestServer(app) as srv:
        yield srv


def test_payload_forces_the_output_length_and_sends_priority_only_when_set() -> None:
    t = Target("http://x", "tiny")
    body = payload(t, RequestSpec(0, 0.0, 5, 12), "hi")
    assert body["max_tokens"] == body["min_tokens"] == 12
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "priority" not in body
    assert payload(t, RequestSpec(0, 0.0, 5, 12, priority=2), "hi")["priority"] == 2


def test_parse_event() -> None:
    assert parse_event(b'data: {"a": 1}\n') == {"a": 1}
    assert parse_event(b"data: [DONE]\n") is None
    assert parse_event(b"\n") is None
    assert parse_event(b": keep-alive\n") is None


async def test_records_of_ok_refused_failed_and_short(server: TestServer) -> None:
    target = Target(str(server.make_url("")).rstrip("/"), "tiny")
    specs = [RequestSpec(i, 0.01 * i, 7, 5) for i in range(REQUESTS)]
    prompts = {0: "ok", 1: "refuse", 2: "break", 3: "short"}
    start = time.monotonic()
    records = await run_open_loop(target, specs, lambda s: (prompts[s.index], 7), run_start=start)
    ok, refused, failed, short = records
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert ok.status == "ok" and ok.http_status == 200 and ok.output_tokens == 5 and ok.prompt_tokens == 7
    assert ok.ttft_s is not None and ok.e2e_s is not None
    assert ok.arrival_s + ok.ttft_s >= short.arrival_s  # its first token waited for the last request
    assert ok.ttft_s <= ok.e2e_s
    assert len(ok.itl_s) == 4  # 5 token chunks, 4 gaps
    assert ok.tpot_s == pytest.approx((ok.e2e_s - ok.ttft_s) / 4)
    assert refused.status == "refused" and refused.http_status == 429 and refused.ttft_s is None
    assert failed.status == "failed" and failed.http_status == 500 and "HTTP 500" in (failed.error or "")
    assert short.status == "failed" and "short output: 4 of 5" in (short.error or "")
    # open loop: each request left at (not before) its scheduled arrival, and the later ones left while
    # the first was still streaming, not after it finished; no wall-clock bound
    assert all(r.arrival_s >= 0.01 * r.index - 1e-3 for r in records)
    assert all(r.arrival_s < ok.arrival_s + ok.e2e_s for r in (refused, failed, short))


async def test_connection_error_is_a_failed_record() -> None:
    target = Target("http://127.0.0.1:9", "tiny")  # discard port: nothing listens
    [rec] = await run_open_loop(
        target, [RequestSpec(0, 0.0, 1, 1)], lambda s: ("x", 1), run_start=time.monotonic()
    )
    assert rec.status == "failed" and rec.http_status is None and rec.error


async def test_concurrency_caps_the_requests_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every arrival is due at once; a send holds its place for a few turns of the loop, in which
    every other arrival not held back by the cap would start its own."""
    in_flight, most = [0], [0]

    async def send(_session: Any, _target: Target, spec: RequestSpec, *_args: Any) -> RequestRecord:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await settle()
        in_flight[0] -= 1
        return RequestRecord(spec.index, 0, 1, 1, 1, 0.0, "ok")

    monkeypatch.setattr(client_module, "send", send)
    specs = [RequestSpec(i, 0.0, 1, 1) for i in range(6)]
    target = Target("http://127.0.0.1:9", "tiny")  # nothing is sent
    records = await run_open_loop(
        target, specs, lambda s: ("x", 1), run_start=time.monotonic(), concurrency=2
    )
    assert [r.index for r in records] == list(range(6))
    assert most == [2]


async def _answers(request: web.Request) -> web.StreamResponse:
    """How a server may answer, picked by the prompt; the request id comes back as a header."""
    body = await request.json()
    echo = {"X-Seen-Id": request.headers.get("X-Request-Id", "")}
    if body["prompt"] == "refuse":
        return web.json_response({"error": "full"}, status=429, headers={"Retry-After": "2", **echo})
    if not body.get("stream"):
        return web.json_response({"choices": [{"text": "whole"}]}, headers=echo)
    resp = web.StreamResponse(headers=echo)
    await resp.prepare(request)
    for i in range(4):
        await resp.write(_chunk({"choices": [{"index": 0, "text": f" t{i}"}]}))
        if body["prompt"] == "fail" and i == 1:
            await resp.write(_chunk({"error": {"message": "engine died", "code": 503}}))
        if body["prompt"] == "garble" and i == 1:
            await resp.write(b"data: {not json\n\n")
    await resp.write(_chunk({"choices": [{"index": 0, "finish_reason": "length"}]}))
    await resp.write(_chunk({"choices": [], "usage": {"completion_tokens": 4}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def answers() -> Any:
    app = web.Application()
    app.router.add_post("/v1/completions", _answers)
    async with TestServer(app) as srv, aiohttp.ClientSession() as session:
        yield session, str(srv.make_url("/v1/completions"))


async def test_post_records_a_stream_its_chunks_finish_and_usage(answers: Any) -> None:
    session, url = answers
    answer = await post(session, url, {"prompt": "ok", "stream": True}, headers={"X-Request-Id": "r1"})
    assert (answer.status, answer.headers["X-Seen-Id"], answer.failure) == (200, "r1", None)
    assert answer.chunks == 5 and answer.finished == {0} and answer.usage == {"completion_tokens": 4}
    assert answer.ttft_s == answer.chunk_mono[0] - answer.sent_mono
    assert answer.sent_mono <= answer.chunk_mono[0] <= answer.chunk_mono[-1] <= answer.ended_mono


async def test_post_keeps_the_body_of_a_refusal_and_of_an_answer_not_streamed(answers: Any) -> None:
    session, url = answers
    refused = await post(session, url, {"prompt": "refuse", "stream": True})
    assert (refused.status, refused.headers["Retry-After"], refused.chunks) == (429, "2", 0)
    assert json.loads(refused.body) == {"error": "full"}
    whole = await post(session, url, {"prompt": "ok", "stream": False})
    assert json.loads(whole.body) == {"choices": [{"text": "whole"}]} and whole.chunks == 0


async def test_post_stops_at_an_error_event_and_records_a_malformed_one(answers: Any) -> None:
    session, url = answers
    failed = await post(session, url, {"prompt": "fail", "stream": True})
    assert failed.error_event == {"error": {"message": "engine died", "code": 503}}
    assert failed.chunks == 2 and failed.usage is None and failed.failure is None
    garbled = await post(session, url, {"prompt": "garble", "stream": True})
    assert isinstance(garbled.failure, json.JSONDecodeError) and garbled.chunks == 2


async def test_post_hangs_up_when_the_chunk_callback_asks(answers: Any) -> None:
    session, url = answers
    seen: list[int] = []

    async def hang_up_at_three(answer: Answer) -> bool:
        seen.append(answer.chunks)
        return answer.chunks == 3

    answer = await post(session, url, {"prompt": "ok", "stream": True}, on_chunk=hang_up_at_three)
    assert seen == [1, 2, 3] and answer.hung_up and answer.chunks == 3 and answer.usage is None


async def test_post_records_a_refused_connection() -> None:
    async with aiohttp.ClientSession() as session:
        answer = await post(session, "http://127.0.0.1:9/v1/completions", {"stream": True})
    assert answer.status is None and isinstance(answer.failure, aiohttp.ClientConnectionError)

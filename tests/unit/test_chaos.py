"""``bench chaos``: how a request's ending is classified (against a small aiohttp server that misbehaves
on purpose) and the verdict over made-up runs."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.bench.chaos.faults import FaultRecord, inject_faults
from controller.bench.chaos.load import ChaosOutcome, LoadShape, Sender
from controller.bench.chaos.verdict import ChaosVerdictLimits, EndState, bad_ending, verdict
from controller.load.client import Target


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _completions(request: web.Request) -> web.StreamResponse:
    """The behaviour is picked by the request id: how a server may end a request."""
    rid = request.headers["X-Request-Id"]
    body = await request.json()
    if rid == "refused":
        return web.json_response(
            {"error": {"message": "queue full"}}, status=429, headers={"Retry-After": "2"}
        )
    if rid == "refused_bare":
        return web.Response(status=429, text="busy")
    if rid == "multi":
        return web.json_response({"choices": [{"text": "x"} for _ in body["prompt"]]})
    if rid in ("n", "n_short"):  # n choices (a beam search answers one per beam), or one fewer
        return web.json_response({"choices": [{"text": "x"}] * (body["n"] - (rid == "n_short"))})
    resp = web.StreamResponse()
    await resp.prepare(request)
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    for _ in range(3):
        await resp.write(_event({"choices": [{"index": i, "text": "a"} for i in range(len(prompts))]}))
    if rid == "error":
        await resp.write(_event({"error": {"message": "engine died"}}))
    elif rid == "cut":
        assert request.transport is not None
        request.transport.close()
        return resp
    elif rid == "slow":
        await asyncio.Event().wait()  # never ends: the client's deadline must
    finished = len(prompts) - (rid == "one_unfinished")
    await resp.write(_event({"choices": [{"index": i, "finish_reason": "length"} for i in range(finished)]}))
    await resp.write(_event({"choices": [], "usage": {"completion_tokens": 3}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _chat_batch(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"choices": [{"message": {"content": "x"}} for _ in body["messages"]]})


async def _state(request: web.Request) -> web.Response:
    return web.json_response({"admission_limit": 5})


async def _send(kind: Any, rid: str, deadline_s: float = 3.0, with_state: bool = False) -> ChaosOutcome:
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions/batch", _chat_batch)
    app.router.add_get("/state", _state)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        target = Target(str(server.make_url("")), "m")
        state_url = str(server.make_url("/state")) if with_state else None
        sender = Sender(session, target, LoadShape(stall_s=0.1), time.monotonic(), state_url)
        return await sender.send(kind, 1, "hello", deadline_s, rid)


@pytest.mark.parametrize(
    ("kind", "rid", "end", "clear"),
    [
        ("stream", "ok", "completed", True),
        ("stall", "ok", "completed", True),
        ("disconnect", "ok", "client_disconnect", True),
        ("stream", "error", "error_event", True),
        ("stream", "refused", "http_error", True),
        ("stream", "refused_bare", "http_error", False),
        ("stream", "cut", "cut", False),
        ("multi_prompt", "multi", "completed", True),
        ("stream_over_limit", "ok", "completed", True),
        ("stream_over_limit", "one_unfinished", "cut", False),
        ("chat_batch", "ok", "completed", True),
        ("beam_search", "n", "completed", True),
        ("n_choices", "n", "completed", True),
        ("n_over_limit", "n", "completed", True),
        ("n_choices", "n_short", "cut", False),
    ],
)
async def test_each_ending_is_told_apart(kind: Any, rid: str, end: str, clear: bool) -> None:
    out = await _send(kind, rid)
    assert (out.end, out.clear) == (end, clear), out.detail


@pytest.mark.parametrize("kind", ["stream_over_limit", "n_over_limit"])
async def test_an_over_limit_request_is_sized_from_the_limit_in_state(kind: Any) -> None:
    out = await _send(kind, "ok" if kind == "stream_over_limit" else "n", with_state=True)
    assert out.end == "completed", out.detail
    assert out.detail == "7 for a limit of 5"  # the daemon's limit plus LoadShape.over_limit_by


async def test_a_request_past_its_deadline_is_hung() -> None:
    out = await _send("stream", "slow", deadline_s=0.05)
    assert out.end == "hung"
    assert bad_ending(out) is not None


def _outcome(end: Any, kind: Any = "stream", clear: bool = True, status: int | None = 200) -> ChaosOutcome:
    return ChaosOutcome(kind, 0, 1.0, 2.0, 100.0, end, status, clear)


def test_only_clear_endings_keep_the_rule() -> None:
    assert bad_ending(_outcome("completed")) is None
    assert bad_ending(_outcome("error_event")) is None
    assert bad_ending(_outcome("http_error", status=503)) is None
    assert bad_ending(_outcome("http_error", status=429, clear=False)) is not None
    assert bad_ending(_outcome("cut", clear=False)) is not None
    assert (
        bad_ending(_outcome("cut", kind="stall", clear=False)) is None
    )  # the send timeout cut a stalled reader
    late = ChaosOutcome("stream", 0, 1.0, 120.0, 100.0, "completed", 200)
    assert bad_ending(late) is not None


def _good_end(**changes: Any) -> EndState:
    end = EndState(
        gate={"in_flight": 0, "queue_depth": 0, "pending": 0},
        served_at_end=True,
        rss=[(t, 1000 << 20) for t in range(0, 600, 10)],
        exit_code=0,
    )
    for key, value in changes.items():
        setattr(end, key, value)
    return end


def test_a_clean_run_passes() -> None:
    faults = [FaultRecord(10.0, "kill_engine", "back", "back after 40 s", True)]
    passed, reasons, figures = verdict([_outcome("completed")] * 5, faults, _good_end(), ChaosVerdictLimits())
    assert passed, reasons
    assert figures["endings"] == {"stream:completed": 5}
    assert figures["rss_growth"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"gate": {"in_flight": 2, "queue_depth": 0, "pending": 0}}, "did not return to zero"),
        ({"gate": {}}, "did not return to zero"),
        ({"served_at_end": False}, "did not serve"),
        ({"exit_code": -9}, "exited with -9"),
        ({"killed_leftovers": True}, "were left"),
        ({"engine_cores_alive": [123]}, "EngineCore"),
        ({"shm_orphans": ["/dev/shm/psm_1"]}, "/dev/shm"),
        ({"rss": [(t, (1000 + t) << 20) for t in range(0, 600, 10)]}, "resident memory grew"),
    ],
)
def test_each_broken_invariant_is_named(changes: dict[str, Any], says: str) -> None:
    passed, reasons, _ = verdict([_outcome("completed")], [], _good_end(**changes), ChaosVerdictLimits())
    assert not passed
    assert any(says in r for r in reasons), reasons


def test_a_failed_fault_and_a_hung_request_fail_the_run() -> None:
    faults = [FaultRecord(10.0, "reload_bad_engine", "refused", "NOT refused", False)]
    hung = ChaosOutcome("same_id", 1, 3.0, 100.0, 100.0, "hung", None, False, "no end within 100 s")
    passed, reasons, figures = verdict([hung], faults, _good_end(), ChaosVerdictLimits())
    assert not passed
    assert figures["faults_failed"] == 1 and figures["bad_endings"] == 1
    assert any("reload_bad_engine" in r for r in reasons) and any("same_id" in r for r in reasons)


def _at(kind: Any, start_s: float, elapsed_s: float, end: Any, status: int | None = 200) -> ChaosOutcome:
    return ChaosOutcome(kind, 0, start_s, elapsed_s, 100.0, end, status)


def test_plain_streams_all_refused_beside_a_stream_over_the_limit_fail_the_run() -> None:
    wide = _at("stream_over_limit", 10.0, 20.0, "completed")
    refused = [_at("stream", 12.0 + i, 5.0, "http_error", 429) for i in range(3)]
    after = _at("stream", 40.0, 1.0, "completed")  # sent once the wide stream had ended
    rebuild = _at("stream", 14.0, 0.1, "http_error", 503)  # an engine kill's, not the gate's
    passed, reasons, figures = verdict(
        [wide, *refused, after, rebuild], [], _good_end(), ChaosVerdictLimits()
    )
    assert not passed and any("held the gate" in r for r in reasons), reasons
    assert figures["beside_stream_over_limit"] == {"sent": 4, "served": 0, "refused_429": 3}
    served = _at("stream", 13.0, 6.0, "completed")  # waited behind it, then served
    passed, reasons, _ = verdict([wide, *refused, served, after], [], _good_end(), ChaosVerdictLimits())
    assert passed, reasons


async def test_no_fault_is_waited_for_past_the_duration() -> None:
    class Never:
        t0 = time.monotonic()

        async def inject(self, fault: str) -> None:
            raise AssertionError(f"{fault} injected past the duration")

    await asyncio.wait_for(inject_faults(Never(), 0.5, 1000.0), 1.0)  # type: ignore[arg-type]

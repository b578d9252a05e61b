"""``bench chaos``: how a request's ending is classified (against a small aiohttp server that misbehaves
on purpose), how a hostile client's connections end (against small servers that end them or not), and
the verdict over made-up runs: each invariant holds on a clean run and fails on a record that breaks
it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.bench.chaos.faults import FaultRecord, inject_faults, tick_count
from controller.bench.chaos.hostile import HostileRecord, _Conn, _endless
from controller.bench.chaos.load import TTFT_HEADERS, ChaosOutcome, LoadShape, Sender
from controller.bench.chaos.verdict import (
    ChaosVerdictLimits,
    EndState,
    bad_ending,
    longest_tick_gap,
    verdict,
)
from controller.load.client import Target


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _completions(request: web.Request) -> web.StreamResponse:
    """The behaviour is picked by the request id: how a server may end a request."""
    rid = request.headers["X-Request-Id"]
    body = await request.json()
    if rid == "ttft" and any(request.headers.get(k) != v for k, v in TTFT_HEADERS.items()):
        return web.Response(status=400, text="the TTFT headers are missing")
    if rid == "probe":  # a short completion, not streamed
        assert not body["stream"] and body["max_tokens"] == 4 and "min_tokens" not in body
        return web.json_response({"choices": [{"text": "x"}]})
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
        ("ttft_header", "ttft", "completed", True),
        ("reused_id", "ok", "completed", True),
        ("probe", "probe", "completed", True),
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
        fds=[(t, 120) for t in range(0, 600, 10)],
        threads=[(t, 40) for t in range(0, 600, 10)],
        ticks=[(t, t) for t in range(0, 600, 2)],
        fds_end=100,
        threads_end=40,
        engine_cores_end=1,
        demand_start=10,
        demand_end=30,
        exit_code=0,
    )
    for key, value in changes.items():
        setattr(end, key, value)
    return end


def _probes(n: int = 10, end: Any = "completed", status: int | None = 200) -> list[ChaosOutcome]:
    return [ChaosOutcome("probe", 0, 2.0 * i, 0.3, 100.0, end, status) for i in range(n)]


def _run(
    outcomes: list[ChaosOutcome] | None = None,
    faults: list[FaultRecord] | None = None,
    hostile_records: list[HostileRecord] | None = None,
    **end: Any,
) -> Any:
    load = [_outcome("completed")] * 5 if outcomes is None else outcomes
    return verdict(
        load + _probes(), faults or [], _good_end(**end), ChaosVerdictLimits(), hostile_records or []
    )


def test_a_clean_run_passes() -> None:
    faults = [FaultRecord(10.0, "kill_engine", "back", "back after 40 s", True, 50.0)]
    result = _run(faults=faults)
    assert result.passed, result.reasons
    assert all(i.held for i in result.invariants)
    assert len(result.table().splitlines()) == 2 + len(result.invariants)
    assert result.figures["endings"] == {"probe:completed": 10, "stream:completed": 5}
    assert result.figures["rss_growth"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("changes", "invariant"),
    [
        ({"gate": {"in_flight": 2, "queue_depth": 0, "pending": 0}}, "gate_zero"),
        ({"gate": {}}, "gate_zero"),
        ({"served_at_end": False}, "serves_at_end"),
        ({"exit_code": -9}, "clean_exit"),
        ({"killed_leftovers": True}, "clean_exit"),
        ({"engine_cores_alive": [123]}, "clean_exit"),
        ({"shm_orphans": ["/dev/shm/psm_1"]}, "clean_exit"),
        ({"rss": [(t, (1000 + t) << 20) for t in range(0, 600, 10)]}, "rss_flat"),
        ({"fds_end": 120 + 65}, "nothing_grows"),
        ({"threads_end": 40 + 17}, "nothing_grows"),
        ({"engine_cores_end": 2}, "nothing_grows"),  # a retired engine left beside the new one
        ({"fds_end": None}, "nothing_grows"),
        ({"ticks": [(t, min(t, 100)) for t in range(0, 600, 2)]}, "loop_ticks"),  # stuck at 100 s
        ({"ticks": [(t, None) for t in range(0, 600, 2)]}, "loop_ticks"),
        ({"demand_end": 12}, "demand_counted"),  # 16 served (with the last), 2 counted: retries hid them
        ({"demand_start": None}, "demand_counted"),
    ],
)
def test_each_broken_invariant_fails_alone(changes: dict[str, Any], invariant: str) -> None:
    result = _run(**changes)
    assert not result.passed
    assert [i.name for i in result.invariants if not i.held] == [invariant], result.reasons
    assert result.reasons


def test_a_failed_fault_and_a_hung_request_fail_the_run() -> None:
    faults = [FaultRecord(10.0, "reload_bad_engine", "refused", "NOT refused", False)]
    hung = ChaosOutcome("same_id", 1, 3.0, 100.0, 100.0, "hung", None, False, "no end within 100 s")
    result = _run([hung], faults)
    assert not result.passed
    assert result.figures["faults_failed"] == 1 and result.figures["bad_endings"] == 1
    assert {i.name for i in result.invariants if not i.held} == {"faults", "requests_end"}
    assert any("reload_bad_engine" in r for r in result.reasons) and any(
        "same_id" in r for r in result.reasons
    )


def _probe_verdict(probes: list[ChaosOutcome], faults: list[FaultRecord] | None = None) -> Any:
    result = verdict([_outcome("completed"), *probes], faults or [], _good_end(), ChaosVerdictLimits())
    return next(i for i in result.invariants if i.name == "ordinary_answered")


def test_the_probe_refused_outside_a_rebuild_fails_the_run() -> None:
    refused = [ChaosOutcome("probe", 0, 2.0 * i, 0.1, 100.0, "http_error", 503) for i in range(10)]
    assert not _probe_verdict(refused).held  # clear answers, none served: the data plane is taken
    served = [ChaosOutcome("probe", 0, 30.0 + i, 0.3, 100.0, "completed", 200) for i in range(3)]
    rebuild = [FaultRecord(0.0, "hang_engine", "back", "back", True, 20.0)]  # 0-25 s with the grace
    assert _probe_verdict(refused + served, rebuild).held  # refused only while no engine served


def test_a_probe_without_a_clear_answer_fails_the_run() -> None:
    cut = ChaosOutcome("probe", 0, 5.0, 0.1, 100.0, "cut", None, False, "ServerDisconnectedError")
    assert not _probe_verdict([*_probes(), cut]).held
    assert not _probe_verdict([]).held  # no probe sent: nothing shows it was answered


def test_the_tick_gap_leaves_out_the_rebuilds() -> None:
    ticks = [(float(t), t if t < 100 or t >= 160 else 100) for t in range(0, 200, 2)]
    assert longest_tick_gap(ticks, []) == pytest.approx(60.0)  # 100 -> 160
    assert longest_tick_gap(ticks, [(90.0, 155.0)]) == pytest.approx(5.0)
    stuck = [(float(t), 7) for t in range(0, 50, 2)]
    assert longest_tick_gap(stuck, []) == pytest.approx(48.0)  # the stretch to the end counts
    assert longest_tick_gap([(0.0, None)], []) is None
    assert tick_count({"loop": {"ticks_total": 12}}) == 12 and tick_count({}) is None


def test_a_hostile_client_the_daemon_did_not_end_fails_the_run() -> None:
    held = HostileRecord(5.0, "idle_sockets", 10, 4, 0.5, {"closed": 4, "held": 6}, 0, False)
    ended = HostileRecord(9.0, "stalled_body", 2, 2, 3.0, {"HTTP/1.1 408": 2}, 100, True)
    result = _run(hostile_records=[ended, held])
    assert [i.name for i in result.invariants if not i.held] == ["hostile"]
    assert _run(hostile_records=[ended]).passed


def _at(kind: Any, start_s: float, elapsed_s: float, end: Any, status: int | None = 200) -> ChaosOutcome:
    return ChaosOutcome(kind, 0, start_s, elapsed_s, 100.0, end, status)


def test_plain_streams_all_refused_beside_a_stream_over_the_limit_fail_the_run() -> None:
    wide = _at("stream_over_limit", 10.0, 20.0, "completed")
    refused = [_at("stream", 12.0 + i, 5.0, "http_error", 429) for i in range(3)]
    after = _at("stream", 40.0, 1.0, "completed")  # sent once the wide stream had ended
    rebuild = _at("stream", 14.0, 0.1, "http_error", 503)  # an engine kill's, not the gate's
    result = _run([wide, *refused, after, rebuild])
    assert [i.name for i in result.invariants if not i.held] == ["gate_not_held"], result.reasons
    assert result.figures["beside_stream_over_limit"] == {"sent": 4, "served": 0, "refused_429": 3}
    served = _at("stream", 13.0, 6.0, "completed")  # waited behind it, then served
    result = _run([wide, *refused, served, after])
    assert result.passed, result.reasons


async def test_no_fault_is_waited_for_past_the_duration() -> None:
    class Never:
        t0 = time.monotonic()

        async def inject(self, fault: str) -> None:
            raise AssertionError(f"{fault} injected past the duration")

    await asyncio.wait_for(inject_faults(Never(), 0.5, 1000.0), 1.0)  # type: ignore[arg-type]


class _KernelTakesAll:
    """A writer whose drain never waits: a loopback kernel that takes every byte (its buffers reach
    36 MiB), as asyncio's drain() returns without yielding while the transport is not paused."""

    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        pass


async def test_the_endless_header_stops_at_the_daemons_answer() -> None:
    # CI's soak counted 64 MiB "in" after the daemon's 431: the sender never yielded to the watcher
    conn = _Conn()

    async def answer() -> None:  # the watcher reads the 431 at its first turn
        conn.answered = True
        conn.ended.set()

    sender = asyncio.create_task(_endless(64 << 20)(_KernelTakesAll(), conn))  # type: ignore[arg-type]
    await asyncio.gather(answer(), sender)
    assert conn.sent <= 2 * (64 << 10), conn.sent

"""``bench overload``: its servers, how the mix records each answer (against a small aiohttp server),
the mix's per-class accounting and the table."""

from __future__ import annotations

import argparse

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.bench.cli import add_bench_commands
from controller.bench.experiments import overload
from controller.bench.experiments.mix import BATCH, INTERACTIVE, MixOutcome, one_request, summarize


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_commands(p.add_subparsers(dest="bench_command"))
    return p.parse_args(["overload", "--out", "/tmp/x", *argv])


def test_servers_daemon_per_poll_sleep_and_vllm_serve_with_priority_scheduling() -> None:
    engine = {"model": "/m", "max_num_seqs": 16}
    specs = overload.servers(engine, _args("--poll-sleep", "0", "0.0002", "--limit", "8"))
    assert [s.name for s in specs] == ["daemon:poll_sleep=0", "daemon:poll_sleep=0.0002", "vllm-serve"]
    assert specs[1].server == {"shutdown_timeout_s": 10.0, "engine_poll_sleep_s": 0.0002}
    assert specs[0].admission["limit"] == 8
    assert specs[0].admission["classes"]["interactive"]["reserved_share"] == 0.5
    assert specs[2].kind == "vllm-serve" and specs[2].engine["scheduling_policy"] == "priority"
    assert overload.servers(engine, _args())[0].admission["limit"] == 16  # default: max_num_seqs
    with pytest.raises(ValueError, match="use daemon or vllm-serve"):
        overload.servers(engine, _args("--targets", "nginx"))


def test_summarize_counts_refusals_errors_and_goodput_per_class() -> None:
    outcomes = [
        MixOutcome(INTERACTIVE, 200, 0.0, 0.1, ttft_s=0.1),
        MixOutcome(INTERACTIVE, 200, 0.0, 2.0, ttft_s=2.0),  # served, over the SLO
        MixOutcome(INTERACTIVE, 429, 0.0, 0.0, retry_after="1"),
        MixOutcome(BATCH, 429, 0.0, 0.0, detail="stream error event: deadline"),
        MixOutcome(BATCH, 0, 0.0, 60.0, detail="TimeoutError"),
        MixOutcome(BATCH, 503, 0.0, 0.0),
    ]
    s = summarize(outcomes, {INTERACTIVE: 1.0, BATCH: 20.0}, 10.0)
    inter, batch = s[INTERACTIVE], s[BATCH]
    assert (inter["sent"], inter["served"], inter["refused_429"], inter["refused_with_retry_after"]) == (
        3,
        2,
        1,
        1,
    )
    assert inter["within_slo"] == 1 and inter["goodput_per_s"] == pytest.approx(0.1)
    assert inter["ttft_p50_ms"] == pytest.approx(1050.0)
    assert (batch["refused_in_stream"], batch["no_answer"], batch["server_errors_5xx"]) == (1, 1, 1)
    assert batch["ttft_p99_ms"] is None and batch["goodput_per_s"] == 0.0
    table = overload.format_table({"daemon": s})
    assert "| daemon | interactive | 3 | 2 | 1 (1) | 0 | 0 | 1050 | 1981 | 33.3% | 0.10 |" in table
    assert "| daemon | batch | 3 | 0 | 1 (0) | 1 | 1 | - | - | 0.0% | 0.00 |" in table


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"] == "refuse":
        return web.json_response({"error": "full"}, status=429, headers={"Retry-After": "2"})
    if not body["stream"]:
        return web.json_response({"choices": [{"text": "whole"}]})
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
    if body["prompt"] == "fail":
        await resp.write(b'data: {"error": {"message": "deadline", "code": 429}}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.mark.parametrize(
    ("prompt", "stream", "status", "served", "retry_after", "detail"),
    [
        ("ok", True, 200, True, None, ""),
        ("ok", False, 200, True, None, ""),
        ("refuse", True, 429, False, "2", '{"error": "full"}'),
        ("fail", True, 429, False, None, "stream error event: {'message': 'deadline', 'code': 429}"),
    ],
)
async def test_each_answer_of_the_mix_keeps_its_status_retry_after_and_ttft(
    prompt: str, stream: bool, status: int, served: bool, retry_after: str | None, detail: str
) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        base = str(server.make_url("")).rstrip("/")
        out = await one_request(session, base, "m", INTERACTIVE, 4, 0, prompt, stream)
    assert (out.status, out.served, out.retry_after, out.detail) == (status, served, retry_after, detail)
    assert out.sent_mono <= out.ended_mono
    if served:
        assert out.ttft_s is not None and out.ttft_s <= out.ended_mono - out.sent_mono


async def test_a_mix_request_nobody_answers_is_status_0() -> None:
    async with aiohttp.ClientSession() as session:
        out = await one_request(session, "http://127.0.0.1:9", "m", BATCH, 4, 5, "ok")
    assert out.status == 0 and out.detail.startswith("ClientConnectorError")

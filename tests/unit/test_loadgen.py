"""The closed-loop workload and the throughput math that replaced bench/loadgen.py (no servers).

Moved from the tests of bench/loadgen.py: its percentile tests are test_bench_records.py's
(the one percentile; an empty sequence gives None, not NaN); its SSE test is test_bench_client.py's
``test_parse_event``; its deterministic prompts are test_bench_prompts.py's. What stays here: the phase
summary (now ``records.summarize``) and the closed loop (``--workload closed --concurrency N``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.bench.client import Target, run_open_loop
from controller.bench.options import add_slo_args, add_workload_args, build_specs, run_config
from controller.bench.records import RequestRecord, summarize
from controller.bench.workload import RequestSpec


def _rec(index: int, ttft: float | None, tokens: int, status: str = "ok") -> RequestRecord:
    return RequestRecord(index, 0, 40 + index, tokens, tokens if status == "ok" else 0, 0.0, status,  # type: ignore[arg-type]
                         ttft_s=ttft, e2e_s=None if ttft is None else ttft + 1.0,
                         error=None if status == "ok" else "HTTP 500: boom")  # fmt: skip


def test_tokens_per_second() -> None:
    assert summarize([_rec(0, 0.01, 1000)], 2.0, None, None)["throughput_tok_s"] == 500.0
    assert summarize([_rec(0, 0.01, 1000)], 0.0, None, None)["throughput_tok_s"] == 0.0


def test_summarize_counts_only_successful_requests() -> None:
    records = [_rec(0, 0.010, 100), _rec(1, 0.030, 100), _rec(2, None, 100, status="failed")]
    stats = summarize(records, 4.0, None, None)
    assert stats["requests"] == 3
    assert stats["failed"] == 1
    assert stats["output_tokens"] == 200
    assert stats["throughput_tok_s"] == pytest.approx(50.0)
    assert stats["ttft_p50"] == pytest.approx(0.020)
    assert stats["ttft_p99"] == pytest.approx(0.0298)


def test_summarize_empty_phase() -> None:
    stats = summarize([], 1.0, None, None)
    assert stats["requests"] == 0
    assert stats["throughput_tok_s"] == 0.0
    assert stats["ttft_p99"] is None


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p)
    add_slo_args(p)
    return p.parse_args(list(argv))


def test_closed_workload_sends_n_requests_at_once_with_a_concurrency_cap() -> None:
    args = _args("--workload", "closed", "--requests", "5", "--output-tokens", "16", "--concurrency", "2")
    specs = build_specs(args, None, 2048)  # type: ignore[arg-type]  # closed needs no tokenizer
    assert [(s.arrival_s, s.prompt_tokens, s.output_tokens) for s in specs] == [(0.0, 128, 16)] * 5
    assert run_config(args, None).concurrency == 2  # type: ignore[arg-type]


async def test_concurrency_caps_requests_in_flight() -> None:
    state = {"now": 0, "max": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        resp = web.StreamResponse()
        await resp.prepare(request)
        await asyncio.sleep(0.02)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n')
        state["now"] -= 1
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with TestServer(app) as srv:
        target = Target(str(srv.make_url("")).rstrip("/"), "tiny")
        specs = [RequestSpec(i, 0.0, 1, 1) for i in range(6)]
        records: list[Any] = await run_open_loop(
            target, specs, lambda s: ("x", 1), run_start=time.monotonic(), concurrency=2
        )
    assert [r.status for r in records] == ["ok"] * 6
    assert state["max"] == 2

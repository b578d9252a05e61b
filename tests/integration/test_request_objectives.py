"""On the real engine (the tiny model): a gateway's TTFT header reaches the gate. With the gate's one
slot held, a request of the batch class (60 s queue deadline) waits, while the same request with
``x-llm-d-slo-ttft-ms: 300`` is refused once its own bound passes, and the answer names why; a
malformed header is answered 400 by vLLM's own handler. A class header moves a request into that
class (the batch body with llm-d's ``x-llm-d-inference-objective: interactive`` queues as
interactive and runs at priority 0), and a class of ours the daemon does not hold is answered 400.

The slot is held by the test itself, so what queues and what is refused does not hang on the
engine's speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, url, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

BATCH = {"model": "tiny", "prompt": "the engine serves", "max_tokens": 4, "priority": 1}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("objectives") / "config.toml",
        admission={"limit": 1, "max_queue": 8},
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


async def post(d: Daemon, headers: dict[str, str]) -> tuple[int, dict[str, str], Any, float]:
    started = time.monotonic()
    async with http_session() as s, s.post(url(d, "/v1/completions"), json=BATCH, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(), time.monotonic() - started


async def test_a_tight_ttft_header_refuses_a_request_its_class_would_queue(daemon: Daemon) -> None:
    gate = daemon.parts.gate
    held = await gate.acquire(0)
    try:
        queued = asyncio.create_task(post(daemon, {}))
        await wait_for(lambda: gate.stats().queued == 1, 30.0, "the header-less request to queue")
        status, headers, body, took = await post(daemon, {"x-llm-d-slo-ttft-ms": "300"})
        assert status == 429, body
        assert "its own TTFT bound of 0.3s" in body["error"]["message"]
        assert headers["x-autopilot-refusal"] == "deadline"
        assert headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
        assert 0.3 <= took < 10.0
        assert not queued.done() and gate.stats().queued == 1  # its class's 60 s still run
    finally:
        gate.release(held)
    status, headers, body, _ = await queued
    assert status == 200 and "x-autopilot-refusal" not in headers, body


async def test_a_malformed_ttft_header_is_answered_400_by_vllm(daemon: Daemon) -> None:
    arrivals = daemon.parts.gate.stats().arrivals_total
    status, _, body, _ = await post(daemon, {"x-slo-ttft-ms": "soon"})
    assert status == 400 and body["error"]["param"] == "x-slo-ttft-ms", body
    assert daemon.parts.gate.stats().arrivals_total == arrivals  # answered before the gate


async def test_llm_ds_objective_header_moves_a_request_into_that_class(daemon: Daemon) -> None:
    gate = daemon.parts.gate
    held = await gate.acquire(0)
    try:
        named = asyncio.create_task(post(daemon, {"x-llm-d-inference-objective": "interactive"}))
        await wait_for(
            lambda: gate.queued_by_class() == {"interactive": 1, "batch": 0},
            30.0,
            "it to queue as interactive",
        )
    finally:
        gate.release(held)
    status, _, body, _ = await named
    assert status == 200, body


async def test_a_class_of_ours_the_daemon_does_not_hold_is_answered_400_by_vllm(daemon: Daemon) -> None:
    arrivals = daemon.parts.gate.stats().arrivals_total
    status, _, body, _ = await post(daemon, {"x-autopilot-class": "gold"})
    assert status == 400 and body["error"]["param"] == "x-autopilot-class", body
    assert "send one of: interactive, batch" in body["error"]["message"]
    assert daemon.parts.gate.stats().arrivals_total == arrivals

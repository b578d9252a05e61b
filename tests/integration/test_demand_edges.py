"""On the real engine (the tiny model), what the gate counts as demand (``autopilot_saturation``'s
offered load): a prompt past ``max_model_len``, which vLLM refuses after the gate's preflight, is no
arrival; an ``n`` that no idle gate admits is answered 400 naming the bound, with no Retry-After and
no arrival; requests that reuse a refused ``X-Request-Id`` and are admitted each count.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller.admission.gate import GateRejected
from controller.control.capacity import new_arrivals
from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, url, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LIMIT, MAX_QUEUE = 2, 4
SHORT = {"model": "tiny", "prompt": "the engine serves", "max_tokens": 2}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("demand") / "config.toml",
        admission={"limit": LIMIT, "max_queue": MAX_QUEUE},
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


async def post(
    d: Daemon, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, Any]:
    async with http_session() as s, s.post(url(d, "/v1/completions"), json=body, headers=headers or {}) as r:
        return r.status, r.headers, await r.json()


async def test_a_prompt_past_max_model_len_is_no_arrival(daemon: Daemon) -> None:
    gate = daemon.parts.gate
    before = gate.stats().arrivals_total
    status, _, body = await post(daemon, {**SHORT, "prompt": [1] * 3000})  # past max_model_len 2048
    assert status == 400, body
    assert gate.stats().arrivals_total == before
    status, _, body = await post(daemon, SHORT)
    assert status == 200, body
    assert gate.stats().arrivals_total == before + 1


async def test_an_n_no_idle_gate_admits_is_answered_400_naming_the_bound(daemon: Daemon) -> None:
    gate = daemon.parts.gate
    before = gate.stats().arrivals_total
    status, headers, body = await post(daemon, {**SHORT, "n": LIMIT + MAX_QUEUE + 1})
    assert status == 400, body
    assert f"at most {LIMIT + MAX_QUEUE} sequences" in body["error"]["message"]
    assert "Retry-After" not in headers
    assert gate.stats().arrivals_total == before
    status, _, body = await post(daemon, {**SHORT, "n": LIMIT + MAX_QUEUE})
    assert status == 200, body


async def test_admitted_requests_reusing_a_refused_id_each_count_as_demand(daemon: Daemon) -> None:
    gate = daemon.parts.gate
    gate.refuse_new(GateRejected("no engine", 503, 5, "engine_unavailable"))
    try:
        status, _, body = await post(daemon, SHORT, {"X-Request-Id": "fixed-id"})
        assert status == 503, body
    finally:
        gate.refuse_new(None)
    before = new_arrivals(gate.stats())
    for _ in range(3):
        status, _, body = await post(daemon, SHORT, {"X-Request-Id": "fixed-id"})
        assert status == 200, body
    assert new_arrivals(gate.stats()) == before + 3

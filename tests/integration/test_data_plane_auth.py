"""The API key on the routes vLLM's own check leaves open, on the real engine: ``/invocations``
(chat and completion bodies) generated without the key; every route needs it now but the probes.
tests/unit/test_data_plane_auth.py tries every route vLLM registers without an engine.

One daemon for the module, in the test's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, running_daemon, url, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

API_KEY = "secret-key-42"
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("auth") / "config.toml",
        server={"api_key": API_KEY},
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


@pytest.mark.parametrize("path", ["/invocations", "/generative_scoring", "/tokenize", "/v1/completions"])
async def test_a_generation_route_without_the_key_is_refused_and_generates_nothing(
    daemon: Daemon, path: str
) -> None:
    admitted = daemon.parts.gate.admitted_total
    async with http_session() as s, s.post(url(daemon, path), json=COMPLETION) as r:
        assert r.status == 401
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert daemon.parts.gate.admitted_total == admitted


async def test_invocations_with_the_key_completes(daemon: Daemon) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with http_session() as s, s.post(url(daemon, "/invocations"), json=COMPLETION, headers=auth) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/health", "/ping", "/version", "/metrics", "/load", "/get_load"])
async def test_the_probes_answer_without_the_key(daemon: Daemon, path: str) -> None:
    async with http_session() as s, s.get(url(daemon, path)) as r:
        assert r.status == 200, (path, r.status)

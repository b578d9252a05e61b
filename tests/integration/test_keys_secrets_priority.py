"""On the real engine: the data-plane API key works both ways, /state shows no
secret, and a priority out of the operator's bounds is answered 400.

One daemon for the module, in the test's event loop (the engine takes ~15 s to start on the CPU).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from tests.helpers import admin_url, http_session, running_daemon, url, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

API_KEY, TOKEN = "secret-key-42", "admin-token-7"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("cfg") / "config.toml",
        server={"api_key": API_KEY},
        admin={"token": TOKEN},
        admission={"most_urgent_priority": 0, "default_priority": 1},
        control={"tick_s": 3600.0, "policy": "static"},
    )
    async with running_daemon(path) as d:
        yield d


@pytest.mark.parametrize(("key", "status"), [(API_KEY, 200), ("s", 401), ("4", 401), (None, 401)])
async def test_only_the_whole_api_key_is_accepted(daemon: Daemon, key: str | None, status: int) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http_session() as s, s.get(url(daemon, "/v1/models"), headers=headers) as r:
        assert r.status == status


async def test_state_shows_no_secret(daemon: Daemon) -> None:
    async with http_session() as s:
        async with s.get(admin_url(daemon, "/state")) as r:
            assert r.status == 401
        async with s.get(admin_url(daemon, "/state"), headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200
            text = await r.text()
    assert API_KEY not in text and TOKEN not in text
    assert '"api_key": "<redacted>"' in text and '"token": "<redacted>"' in text


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        ({"priority": -1}, {}, 400),
        ({"priority": 2**63}, {}, 400),
        ({}, {"X-Vllm-Priority": str(2**64)}, 400),
        ({}, {"X-Vllm-Priority": "urgent"}, 400),
        ({"priority": 0}, {}, 200),
        ({}, {}, 200),
    ],
)
async def test_priority_out_of_bounds_gets_400(
    daemon: Daemon, body: dict[str, object], headers: dict[str, str], status: int
) -> None:
    request = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **body}
    auth = {"Authorization": f"Bearer {API_KEY}", **headers}
    async with http_session() as s, s.post(url(daemon, "/v1/completions"), json=request, headers=auth) as r:
        assert r.status == status, await r.text()
    stats = daemon.parts.gate.stats()
    assert stats.pending == 0 and stats.in_flight == 0

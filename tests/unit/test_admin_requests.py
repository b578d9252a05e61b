"""The control plane answers only requests a web page cannot forge: a ``Host`` that is an IP address
or one of the server's own names on every route (no DNS rebinding), and a reload that a cross-site
form could not have sent."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from controller.admin.server import RELOAD_HEADER, make_admin_app

ROUTES = [
    ("GET", "/"),
    ("GET", "/metrics"),
    ("GET", "/state"),
    ("GET", "/healthz"),
    ("GET", "/livez"),
    ("POST", "/reload"),
]
JSON = {"Content-Type": "application/json"}


class Calls:
    def __init__(self) -> None:
        self.reloads = 0

    async def reload(self) -> dict[str, Any]:
        self.reloads += 1
        return {"ok": True, "changed": {}}


@pytest.fixture
def calls() -> Calls:
    return Calls()


@pytest_asyncio.fixture
async def client(calls: Calls) -> AsyncIterator[TestClient[Any, Any]]:
    state, health = (lambda: {"healthy": True}), (lambda: (True, "serving"))
    app = make_admin_app(
        CollectorRegistry(), state, health, calls.reload, "", CollectorRegistry(), host="autopilot.internal"
    )
    async with TestClient(TestServer(app)) as c:
        yield c


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:9400", "127.0.0.1.nip.io:9400"])
async def test_a_host_that_is_not_ours_is_refused_on_every_route(
    client: TestClient[Any, Any], calls: Calls, method: str, path: str, host: str
) -> None:
    response = await client.request(method, path, headers={"Host": host, **JSON})
    assert response.status == 421
    assert "error" in await response.json()
    assert calls.reloads == 0


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:9400",
        "localhost:9400",
        "LOCALHOST",
        "[::1]:9400",
        "10.1.2.3:9400",  # a pod IP: Prometheus and the kubelet's probes
        "autopilot.internal:9400",  # [admin] host
        socket.gethostname(),
    ],
)
@pytest.mark.parametrize(("method", "path"), ROUTES)
async def test_ip_addresses_and_our_own_names_are_served(
    client: TestClient[Any, Any], method: str, path: str, host: str
) -> None:
    response = await client.request(method, path, headers={"Host": host, **JSON})
    assert response.status == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "multipart/form-data; boundary=x"},
        {"Content-Type": "text/plain"},
    ],
)
async def test_a_reload_a_cross_site_form_could_send_is_refused(
    client: TestClient[Any, Any], calls: Calls, headers: dict[str, str]
) -> None:
    response = await client.post("/reload", data=b"a=b", headers=headers)
    assert response.status == 415
    assert RELOAD_HEADER in (await response.json())["error"]
    assert calls.reloads == 0


@pytest.mark.parametrize(
    "headers",
    [JSON, {"Content-Type": "application/json; charset=utf-8"}, {RELOAD_HEADER: "1"}],
)
async def test_a_reload_with_a_json_content_type_or_the_reload_header_runs(
    client: TestClient[Any, Any], calls: Calls, headers: dict[str, str]
) -> None:
    response = await client.post("/reload", headers=headers)
    assert response.status == 200 and (await response.json())["ok"] is True
    assert calls.reloads == 1

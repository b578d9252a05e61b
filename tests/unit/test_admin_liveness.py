"""GET /livez: liveness for a supervisor. It stays 200 through everything the daemon recovers from
by itself (an engine build, a restart, a drain) and turns 503 only once the memory guard has spent
its restart budget, so the kubelet restarts a pod that would otherwise stay unready for good."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from controller.admin.server import BEYOND_RECOVERY, make_admin_app
from tests.unit.test_lifecycle_faults import FakeEngine, guard_with


class Health:
    """What /healthz would say, set by each test."""

    def __init__(self) -> None:
        self.now: tuple[bool, str] = (True, "serving")

    def __call__(self) -> tuple[bool, str]:
        return self.now


async def _no_reload() -> dict[str, Any]:
    raise AssertionError("/livez must not reload")


@pytest.fixture
def health() -> Health:
    return Health()


@pytest_asyncio.fixture
async def client(health: Health) -> AsyncIterator[TestClient[Any, Any]]:
    app = make_admin_app(
        CollectorRegistry(), dict, health, _no_reload, token="secret", vllm_registry=CollectorRegistry()
    )
    async with TestClient(TestServer(app)) as c:
        yield c


@pytest.mark.parametrize(
    "reason",
    ["serving", "engine_not_ready", "engine_restarting", "engine_dead", "draining", "data_plane_starting"],
)
async def test_livez_is_200_while_the_daemon_can_still_recover(
    client: TestClient[Any, Any], health: Health, reason: str
) -> None:
    health.now = (reason == "serving", reason)
    response = await client.get("/livez")
    assert response.status == 200
    assert await response.json() == {"ok": True, "reason": reason}


async def test_livez_is_503_once_the_restart_budget_is_spent(
    client: TestClient[Any, Any], health: Health
) -> None:
    health.now = (False, "restart_budget_spent")
    response = await client.get("/livez")
    assert response.status == 503
    assert await response.json() == {"ok": False, "reason": "restart_budget_spent"}
    healthz = await client.get("/healthz")
    assert healthz.status == 503  # readiness fails too: the pod is out of the Service and restarted


async def test_livez_needs_no_token(client: TestClient[Any, Any]) -> None:
    """The kubelet sends no credentials; /state on the same server does need them."""
    assert (await client.get("/livez")).status == 200
    assert (await client.get("/state")).status == 401


async def test_livez_is_503_when_the_control_loop_stalled(
    client: TestClient[Any, Any], health: Health
) -> None:
    """A loop that no longer ticks serves on with its knobs and memory guard frozen: a new process
    helps, as systemd's watchdog decides on the same signal."""
    health.now = (False, "control_loop_stalled")
    response = await client.get("/livez")
    assert response.status == 503
    assert await response.json() == {"ok": False, "reason": "control_loop_stalled"}


async def test_the_guard_gives_up_with_a_reason_livez_fails_on() -> None:
    """The reason string is the contract between the guard and /livez: the guard's own give-up reason,
    after max_restarts_per_hour crashes, is one /livez treats as beyond recovery."""
    engine = FakeEngine()
    guard = guard_with(engine, max_restarts_per_hour=1)
    engine.dead = True
    await guard.recover()  # the one restart of the hour
    assert guard.unavailable_reason is None
    engine.dead = True
    await guard.recover()
    assert guard.unavailable_reason in BEYOND_RECOVERY

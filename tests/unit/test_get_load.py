"""``GET /get_load`` on the data plane, as vllm-router's ``power_of_two`` polls it: ``{"load": n}`` with
n the gate's requests in flight plus queued, open without the API key, never through the gate.

The route is served by the daemon's own ASGI stack (``make_server``: key check, client limits, the
admission middleware) over a bare FastAPI app; the gate is real, on a fake clock."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI

from controller.admission.classes import PriorityClass
from controller.admission.errors import shutting_down
from controller.admission.gate import AdmissionGate, GateRejected
from controller.clock import FakeClock
from controller.engine.frontend.app import make_server
from controller.engine.frontend.load import LOAD_PATH, UNAVAILABLE_LOAD, add_load_route
from controller.engine.runtime.args import serve_namespace
from tests.helpers import settle

API_KEY = "fleet-key"


def gate() -> AdmissionGate:
    return AdmissionGate(2, 8, (PriorityClass("all", queue_deadline_s=1e6),), clock=FakeClock())


def stack(g: AdmissionGate) -> Any:
    """The data plane's served stack with a key set, over an app holding only the load route."""
    app = FastAPI()
    add_load_route(app, g)
    args = serve_namespace({"model": "/models/tiny"}, {"host": "127.0.0.1", "port": 0, "api_key": API_KEY})
    return make_server(app, args, 5.0, g).config.app


async def get_load(served: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=served)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.get(LOAD_PATH)  # no Authorization header: the router sends none


async def test_load_is_in_flight_plus_queued_without_the_key() -> None:
    g = gate()
    served = stack(g)
    first = await get_load(served)
    assert (first.status_code, first.json()) == (200, {"load": 0})

    slots = [await g.acquire(), await g.acquire()]  # the limit, 2
    waiters = [asyncio.create_task(g.acquire()) for _ in range(3)]
    await settle()
    assert (g.stats().in_flight, g.stats().queued) == (2, 3)
    assert (await get_load(served)).json() == {"load": 5}

    g.release(slots[0])  # the head of the queue takes the slot: still 4 in all
    await settle()
    assert (await get_load(served)).json() == {"load": 4}
    for task in waiters:  # the two still queued leave; the one granted keeps its slot
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert (await get_load(served)).json() == {"load": 2}


async def test_a_weighted_slot_counts_its_sequences() -> None:
    g = gate()
    await g.acquire(weight=2)  # a request with n=2 holds two of the limit
    assert (await get_load(stack(g))).json() == {"load": 2}


async def test_the_poll_never_passes_the_gate() -> None:
    g = gate()
    served = stack(g)
    for _ in range(5):
        await get_load(served)
    stats = g.stats()
    assert (stats.arrivals_total, stats.admitted_total, stats.rejected_total, stats.pending) == (0, 0, 0, 0)


async def test_a_replica_that_serves_no_new_request_reports_the_highest_load() -> None:
    """Refusing every request (shutdown, the restart budget spent, no engine while it rebuilds) or
    holding every slot (an engine restart), an idle replica must not look the least loaded to the
    router: it answers, with a load above any serving replica's."""
    g = gate()
    served = stack(g)
    states = {
        "paused": (g.pause, g.resume),
        "refuse_all": (lambda: g.refuse_all(shutting_down()), g.reopen),
        "refuse_new": (
            lambda: g.refuse_new(GateRejected("no engine", 503, 5, "engine_unavailable")),
            lambda: g.refuse_new(None),
        ),
    }
    for name, (enter, leave) in states.items():
        enter()
        r = await get_load(served)
        assert (r.status_code, r.json()) == (200, {"load": UNAVAILABLE_LOAD}), name
        leave()
        assert (await get_load(served)).json() == {"load": 0}, name
    assert UNAVAILABLE_LOAD > 1_000_000 + 1_000_000  # limit_max and max_queue at their ceilings

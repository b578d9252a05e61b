"""``GET /get_load`` on the data plane: this replica's load as vllm-router's ``power_of_two`` reads it.

vllm-router (0.1.17) polls ``GET {worker}/get_load`` every ``--worker-startup-check-interval`` seconds
and reads ``{"load": <int>}``; ``power_of_two`` sends each request to the less loaded of two workers
drawn at random (docs/fleet.md). The load is the gate's requests in flight plus those queued for a
slot: what this replica's engine runs and what waits for it. A replica that serves no new request now
(its gate refuses every one: shutdown, the restart budget spent, no engine during a rebuild; or it
holds every slot for an engine restart) reports ``UNAVAILABLE_LOAD`` instead, more than any serving
replica reports, so ``power_of_two`` sends a request there only when the other replica drawn cannot
serve either (its true figure, often 0, would make it the least loaded of all). The route is open
without the API key, like ``/health`` (``auth.OPEN_PATHS``: the router sends no key of its own), and
calls no engine, so it never passes the admission gate and answers while the engine restarts.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from controller.admission.gate import AdmissionGate

LOAD_PATH = "/get_load"
UNAVAILABLE_LOAD = 2**31 - 1
"""The load of a replica that serves no new request now: above any serving gate's (its limit and its
queue are each at most 10^6: ``[control] limit_max``, ``[admission] max_queue``), and within a signed
32-bit integer for a router that reads it as one."""


def gate_load(gate: AdmissionGate) -> int:
    """Slots held (each by its weight) plus requests waiting in the gate's queues; ``UNAVAILABLE_LOAD``
    while the gate refuses every new request or holds every slot (``closed``, ``paused``)."""
    stats = gate.stats()
    if stats.closed or gate.paused:
        return UNAVAILABLE_LOAD
    return stats.in_flight + stats.queued


def add_load_route(app: FastAPI, gate: AdmissionGate) -> None:
    async def get_load() -> JSONResponse:
        return JSONResponse({"load": gate_load(gate)})

    app.add_api_route(LOAD_PATH, get_load, methods=["GET"], include_in_schema=False)

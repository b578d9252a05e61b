"""The data plane: vLLM's own OpenAI-compatible app over the governed client, served by uvicorn in
the daemon's event loop. vLLM's handlers are used unchanged."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from vllm import envs
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app

from controller.admission.classes import PriorityBounds
from controller.admission.gate import AdmissionGate
from controller.engine.frontend import tickets
from controller.engine.frontend.auth import with_api_key
from controller.engine.frontend.client import GateRefusal, GovernedEngineClient
from controller.engine.frontend.limits import DEFAULT_LIMITS, ClientLimits, Limits

ASGIApp = Callable[..., Any]

GRACEFUL_MARGIN_S = 10.0
"""uvicorn cuts connections this long after ``shutdown_timeout_s``: the daemon's drain answers the
requests left at its deadline first (lifecycle/daemon.py ``END_GRACE_S`` is shorter)."""


class AdmissionMiddleware:
    """Gives each request an admission ticket (tickets.py) and adds ``Retry-After`` to 429/503
    answers (vLLM's error responses carry none): the gate's own figure for the request's class when
    the gate refused it, else the gate's estimate for the whole queue."""

    def __init__(
        self, app: ASGIApp, gate: AdmissionGate, bounds: Callable[[], PriorityBounds] = PriorityBounds
    ) -> None:
        self.app = app
        self.gate = gate
        self.bounds = bounds
        """The [admission] priority bounds in force (read per request: a reload changes them)."""

    async def __call__(self, scope: dict[str, Any], receive: ASGIApp, send: ASGIApp) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        bounds = self.bounds()  # the header's priority until an entry point resolves the body's
        ticket = tickets.Ticket(
            bounds.clamp(tickets.header_priority(scope.get("headers", []))), bounds=bounds
        )

        async def send_with_retry_after(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] in (429, 503):
                retry = ticket.retry_after_s or self.gate.retry_after_s()
                headers = [*message.get("headers", []), (b"retry-after", str(retry).encode())]
                message = {**message, "headers": headers}
            await send(message)

        token = tickets.current.set(ticket)
        try:
            await self.app(scope, receive, send_with_retry_after)
        finally:
            tickets.current.reset(token)
            if ticket.pending:  # vLLM answered without generating them all (4xx)
                self.gate.cancel_pending(ticket.priority, ticket.pending)
            for claim in ticket.claims:
                if claim.slot is not None:  # acquired ahead for a stream the client left before
                    slot, claim.slot = claim.slot, None
                    self.gate.release(slot)
                if claim.from_pending and not claim.started:  # a generator never iterated
                    claim.from_pending = False
                    self.gate.cancel_pending(
                        claim.priority if claim.admitted_as is None else claim.admitted_as
                    )


async def build_data_plane(client: GovernedEngineClient, args: argparse.Namespace) -> FastAPI:
    supported_tasks = await client.get_supported_tasks()
    app = build_app(args, supported_tasks, client.model_config)
    await init_app_state(client, app.state, args, supported_tasks)
    tickets.capture_priorities(app.state, GateRefusal)
    return app


async def refresh_app_state(app: FastAPI, client: GovernedEngineClient, args: argparse.Namespace) -> None:
    """After an engine swap: vLLM's serving objects hold the old engine's renderer and input
    processor, so build them again over the (same) governed client."""
    supported_tasks = await client.get_supported_tasks()
    server = app.state.server
    await init_app_state(client, app.state, args, supported_tasks)
    tickets.capture_priorities(app.state, GateRefusal)
    app.state.server = server


class DataPlaneServer(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns SIGTERM/SIGINT/SIGHUP."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_server(
    app: FastAPI,
    args: argparse.Namespace,
    shutdown_timeout_s: float,
    gate: AdmissionGate,
    bounds: Callable[[], PriorityBounds] = PriorityBounds,
    limits: Limits = DEFAULT_LIMITS,
) -> DataPlaneServer:
    # Wrapped outside the app: vLLM's app has built its middleware stack by now. The key check is
    # outermost: a request without the key is answered before its body is read or counted.
    config = uvicorn.Config(
        with_api_key(ClientLimits(AdmissionMiddleware(app, gate, bounds), limits), args),
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,  # as `vllm serve` (default 5 s)
        # Past the daemon's own drain deadline, which ends what is left with an answer (daemon.py).
        timeout_graceful_shutdown=int(max(1, shutdown_timeout_s)) + int(GRACEFUL_MARGIN_S),
        log_config=None,
        limit_concurrency=limits.max_connections,
    )
    server = DataPlaneServer(config)
    app.state.server = server  # vLLM's error handler reads it
    return server

"""The data plane: vLLM's own OpenAI-compatible app over the governed client, served by uvicorn in
the daemon's event loop. vLLM's handlers are used unchanged."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI
from vllm import envs
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.launcher import create_server_socket

from controller.admission.classes import PriorityBounds
from controller.admission.gate import AdmissionGate
from controller.engine.frontend import context
from controller.engine.frontend.auth import with_api_key
from controller.engine.frontend.client import GateRefusal, GovernedEngineClient
from controller.engine.frontend.limits import DEFAULT_SERVER_LIMITS, ClientLimits, ServerLimits
from controller.engine.frontend.load import add_load_route
from controller.engine.frontend.objectives import refusal_headers
from controller.engine.frontend.priority import resolve_priorities
from controller.engine.frontend.wire import DataPlaneConfig

ASGIApp = Callable[..., Any]

GRACEFUL_MARGIN_S = 10.0
"""uvicorn cuts connections this long after ``shutdown_timeout_s``: the daemon's drain answers the
requests left at its deadline first (lifecycle/daemon.py ``END_GRACE_S`` is shorter)."""


class AdmissionMiddleware:
    """Gives each request its ``RequestContext`` and its ``Admission``, the gate entered once for it
    and closed however it ends (``context.entered``), holds every response's status line
    until its first body chunk, and adds ``Retry-After`` to 429/503 answers (vLLM's carry none), with
    the gate's reason where the gate refused (``objectives.refusal_headers``).

    Holding the status line is what lets a stream be refused with a status: vLLM's routes return a
    stream's 200 before it runs, and its calls wait for their slots when it is first read. A stream
    whose call the gate refused before any call was served (a queue deadline, a shed) has produced
    only vLLM's error event: that is answered as the refusal's own status (429/503, vLLM's error
    body) instead, and the rest of the stream is dropped. A stream's first chunk follows its first
    token, so the client sees its headers when it would have seen that token anyway (with vLLM's
    ``sse_keep_alive_interval`` set, a keep-alive comment can come first and the 200 with it)."""

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
        bounds = self.bounds()  # the header's priority until priority.py resolves the body's
        # the class its headers name is looked up in the gate's class table in force now (a reload
        # changes it), and gives it its priority
        request = context.for_request(scope.get("headers", []), bounds, self.gate.classes)
        request.priority = request.objectives.within_class(request.priority, bounds.most_urgent)
        held: dict[str, Any] | None = None
        answered = False  # the refusal went out in place of the stream: drop what vLLM sends

        # the request enters the gate once; its handle closes however it ends (context.entered)
        with context.entered(request, self.gate) as admission:

            async def sending(message: dict[str, Any]) -> None:
                nonlocal held, answered
                if answered:
                    return
                if message["type"] == "http.response.start":
                    held = message
                    return
                if held is not None:
                    start, held = held, None
                    refusal = request.refusal
                    if start["status"] == 200 and refusal is not None and not admission.served:
                        answered = True
                        await self._refuse(send, request, refusal.status, refusal.message)
                        return
                    await send(self._with_retry_after(start, request))
                await send(message)

            await self.app(scope, receive, sending)
            if held is not None:  # a start without a body (not ASGI): sent as it is
                await send(self._with_retry_after(held, request))

    def _with_retry_after(self, start: dict[str, Any], request: context.RequestContext) -> dict[str, Any]:
        """The gate's own figure for the request's class when the gate refused it, else the gate's
        estimate for the whole queue; and the gate's reason, where it refused."""
        if start["status"] not in (429, 503):
            return start
        refusal = request.refusal
        retry = (refusal.retry_after_s if refusal is not None else 0) or self.gate.retry_after_s()
        reason = refusal.reason if refusal is not None else None
        added = [(b"retry-after", str(retry).encode()), *refusal_headers(reason)]
        return {**start, "headers": [*start.get("headers", []), *added]}

    async def _refuse(
        self, send: ASGIApp, request: context.RequestContext, status: int, message: str
    ) -> None:
        """The gate's refusal as vLLM answers an error (its ``ErrorResponse`` body)."""
        error = {"message": message, "type": HTTPStatus(status).phrase, "param": None, "code": status}
        body = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        start = {"type": "http.response.start", "status": status, "headers": headers}
        await send(self._with_retry_after(start, request))
        await send({"type": "http.response.body", "body": body, "more_body": False})


def bind_data_plane(args: argparse.Namespace) -> socket.socket:
    """The data plane's listening socket, bound before the engine is built, as `vllm serve` binds
    its own (vLLM issue 8204): a port the EngineCore opens while it starts (torch.distributed, ZMQ)
    cannot be this one, and a port in use fails at once rather than after a build of minutes."""
    return create_server_socket((args.host or "", args.port), reuse_port=False)


async def build_data_plane(client: GovernedEngineClient, args: argparse.Namespace) -> FastAPI:
    supported_tasks = await client.get_supported_tasks()
    app = build_app(args, supported_tasks, client.model_config)
    await init_app_state(client, app.state, args, supported_tasks)
    resolve_priorities(app.state, GateRefusal)
    add_load_route(app, client.gate)  # vllm-router's power_of_two polls it
    return app


async def refresh_app_state(app: FastAPI, client: GovernedEngineClient, args: argparse.Namespace) -> None:
    """After an engine swap: vLLM's serving objects hold the old engine's renderer and input
    processor, so build them again over the (same) governed client."""
    supported_tasks = await client.get_supported_tasks()
    server = app.state.server
    await init_app_state(client, app.state, args, supported_tasks)
    resolve_priorities(app.state, GateRefusal)
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
    limits: ServerLimits = DEFAULT_SERVER_LIMITS,
) -> DataPlaneServer:
    # Wrapped outside the app: vLLM's app has built its middleware stack by now. The key check is
    # outermost: a request without the key is answered before its body is read or counted; what a
    # connection may cost before that (its first byte, its head, its peer's count) is bounded in
    # uvicorn's protocol (wire.py).
    config = DataPlaneConfig(
        with_api_key(ClientLimits(AdmissionMiddleware(app, gate, bounds), limits), args),
        limits,
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

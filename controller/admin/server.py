"""The control plane (aiohttp): /metrics, /state, /healthz, /livez, /reload, and the status page at /.

The gauges need no refresh here: the registry holds a Collector that reads the live values at
each scrape (``controller.admin.metrics.LiveGauges``). An optional bearer token (``[admin] token``)
guards /state and /reload; /metrics, /healthz and /livez stay open for scrapers and probes, and so
does the status page (``controller.admin.page``: a static file, its data fetched from /state with the token).

Without a token (on loopback only: ``config/load.py`` refuses it elsewhere) a web page the operator
visits must not drive the control plane, so:

* every request's ``Host`` must be an IP address, ``localhost``, this machine's name or ``[admin]
  host``; anything else is answered 421 (DNS rebinding: a name of the attacker's that resolves to
  127.0.0.1 would otherwise let its page read /state);
* ``POST /reload`` needs ``Content-Type: application/json`` or an ``X-Autopilot-Reload`` header, which
  a cross-site HTML form cannot send (and a cross-site script cannot without a CORS preflight, which
  this server never grants); else 415.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from controller.admin.page import favicon, status_page
from controller.peers import Peers, peer_key

log = structlog.get_logger(__name__)

StateFn = Callable[[], dict[str, Any]]
HealthFn = Callable[[], tuple[bool, str]]
ReloadFn = Callable[[], Awaitable[dict[str, Any]]]

RELOAD_RETRY_AFTER_S = 5
"""Retry-After of a /reload refused while the daemon starts or drains (503)."""

STATE: web.AppKey[StateFn] = web.AppKey("state")
HEALTH: web.AppKey[HealthFn] = web.AppKey("health")
RELOAD: web.AppKey[ReloadFn] = web.AppKey("reload")
TOKEN: web.AppKey[str] = web.AppKey("token")
HOSTS: web.AppKey[frozenset[str]] = web.AppKey("hosts")
OUR_REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("registry")
VLLM_REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("vllm_registry")


def _authorized(request: web.Request) -> bool:
    token = request.app[TOKEN]
    if not token:
        return True
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


RELOAD_HEADER = "X-Autopilot-Reload"
"""A header a client may send on ``POST /reload`` instead of a JSON content type."""


def host_names(admin_host: str) -> frozenset[str]:
    """The names (besides IP addresses) a request's ``Host`` may carry: localhost, this machine's
    name and the configured ``[admin] host``."""
    names = {"localhost", admin_host, socket.gethostname(), socket.getfqdn()}
    return frozenset(n.lower().rstrip(".") for n in names if n)


def _host_of(header: str) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:9400`` -> ``::1``)."""
    if header.startswith("["):
        return header[1 : header.find("]")]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _host_allowed(header: str | None, names: frozenset[str]) -> bool:
    if header is None:  # HTTP/1.0 without Host: no browser sends that
        return True
    host = _host_of(header.strip()).lower().rstrip(".")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host in names
    return True


@web.middleware
async def check_host(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    header, names = request.headers.get("Host"), request.app[HOSTS]
    if _host_allowed(header, names):
        return await handler(request)
    message = (
        f"Host {header!r} is not a name of this control plane; use an IP address or one of: "
        f"{', '.join(sorted(names))} "
        "(other names are refused: a page could reach this server through them by DNS rebinding)"
    )
    return web.json_response({"error": message}, status=421)


def _reload_asked_for(request: web.Request) -> bool:
    """A JSON content type or the reload header: what a cross-site form cannot send."""
    return request.content_type == "application/json" or RELOAD_HEADER in request.headers


def _unauthorized() -> web.Response:
    return web.json_response(
        {"error": "missing or wrong bearer token; send 'Authorization: Bearer <[admin] token>'"},
        status=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[OUR_REGISTRY]) + generate_latest(request.app[VLLM_REGISTRY])
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def state(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _unauthorized()
    return web.json_response(request.app[STATE]())


async def healthz(request: web.Request) -> web.Response:
    ok, reason = request.app[HEALTH]()
    return web.json_response({"ok": ok, "reason": reason}, status=200 if ok else 503)


BEYOND_RECOVERY = frozenset({"restart_budget_spent", "control_loop_stalled"})
"""/healthz reasons after which the daemon no longer recovers by itself (``lifecycle.guard`` gives
up restarting the engine; the control loop no longer ticks, whose every wait on the engine has a
deadline, so only a fault of the process itself stalls it): only a new process helps, so /livez
fails on them, as systemd's watchdog does on a stalled loop."""


async def livez(request: web.Request) -> web.Response:
    """Liveness for a supervisor (the kubelet): 200 while the daemon can still serve again by itself
    (an engine restart or a drain is the daemon doing its job), 503 once it cannot. /healthz is
    readiness: failing liveness on it would kill a pod in the middle of its own recovery."""
    _, reason = request.app[HEALTH]()
    alive = reason not in BEYOND_RECOVERY
    return web.json_response({"ok": alive, "reason": reason}, status=200 if alive else 503)


async def reload(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _unauthorized()
    if not _reload_asked_for(request):
        message = (
            f"POST /reload needs 'Content-Type: application/json' or an '{RELOAD_HEADER}: 1' header "
            "(which a cross-site form cannot send): curl -X POST -H 'Content-Type: application/json' "
            "http://127.0.0.1:9400/reload"
        )
        return web.json_response({"error": message}, status=415)
    result = await request.app[RELOAD]()
    if result.get("unavailable"):  # the daemon starts or drains: not the file's fault, retry later
        return web.json_response(result, status=503, headers={"Retry-After": str(RELOAD_RETRY_AFTER_S)})
    return web.json_response(result, status=200 if result["ok"] else 400)


def make_admin_app(
    registry: CollectorRegistry,
    state_fn: StateFn,
    health_fn: HealthFn,
    reload_fn: ReloadFn,
    token: str = "",
    vllm_registry: CollectorRegistry = REGISTRY,
    host: str = "127.0.0.1",
) -> web.Application:
    """`vllm_registry` is where vLLM's stat logger registers its vllm:* metrics (prometheus_client's
    process-wide default); /metrics serves it after ours. `host` is ``[admin] host``: a name the
    ``Host`` header may carry."""
    app = web.Application(middlewares=[check_host])
    app[HOSTS] = host_names(host)
    app[OUR_REGISTRY] = registry
    app[VLLM_REGISTRY] = vllm_registry
    app[STATE] = state_fn
    app[HEALTH] = health_fn
    app[RELOAD] = reload_fn
    app[TOKEN] = token
    app.router.add_get("/", status_page)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/state", state)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    app.router.add_post("/reload", reload)
    return app


ADMIN_KEEPALIVE_S = 30.0
"""A control-plane connection idle this long is closed (aiohttp's default is an hour). aiohttp arms
this timer when a connection opens and moves it only after a response, so it is also the deadline of
a new connection's first request head. Above Prometheus' usual 15 s scrape interval, so a scraper
keeps its connection."""
ADMIN_MAX_CONNECTIONS = 256
"""Open control-plane connections at most; a new one beyond is closed at once. aiohttp has no cap of
its own, and the daemon's file descriptors are the data plane's too."""
ADMIN_MAX_CONNECTIONS_PER_PEER = 32
"""Open control-plane connections one address may hold (``controller/peers.py``): a scraper, the
kubelet's probes and a browser's status page need a few each, and one host cannot fill the cap and
fail everyone's /healthz and /livez."""
ADMIN_MAX_LINE_BYTES = 8190
"""Longest request line or header line (aiohttp's ``max_line_size`` and ``max_field_size``, named
here so the bound is ours whatever aiohttp's default becomes); a longer one gets 400."""
ADMIN_MAX_HEADERS = 64
"""Most header lines in one request (aiohttp's ``max_headers``)."""


async def start_admin(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        keepalive_timeout=ADMIN_KEEPALIVE_S,
        max_line_size=ADMIN_MAX_LINE_BYTES,
        max_field_size=ADMIN_MAX_LINE_BYTES,
        max_headers=ADMIN_MAX_HEADERS,
    )
    await runner.setup()
    await CappedSite(runner, host, port, ADMIN_MAX_CONNECTIONS, ADMIN_MAX_CONNECTIONS_PER_PEER).start()
    return runner


class CappedSite(web.BaseSite):
    """``web.TCPSite`` with caps on open connections, in all and per peer: each connection is a
    ``_Counted`` that passes to the runner's handler when it is within both, and is closed at once
    otherwise. Counted in ``connection_made``, as they open, so a burst of accepts cannot pass them."""

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, max_connections: int, per_peer: int
    ) -> None:
        super().__init__(runner)
        self.host, self.port, self.max_connections = host, port, max_connections
        self.peers = Peers(per_peer, "control_plane")
        self.open = 0

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        handlers = self._runner.server
        assert handlers is not None, "the runner is set up"
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Counted(self, handlers), self.host, self.port)


class _Counted(asyncio.Protocol):
    """One connection of a ``CappedSite``: aiohttp's handler once it is admitted, every call passed on."""

    def __init__(self, site: CappedSite, handlers: Callable[[], asyncio.Protocol]) -> None:
        self.site, self.handlers = site, handlers
        self.handler: asyncio.Protocol | None = None

        self.peer: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        site, address = self.site, transport.get_extra_info("peername")
        peer = peer_key(str(address[0])) if isinstance(address, tuple) else None
        if site.open >= site.max_connections:
            site.peers.note_full()
            transport.close()
            return
        if peer is not None and not site.peers.admit(peer):
            transport.close()
            return
        site.open, self.peer = site.open + 1, peer
        self.handler = self.handlers()
        self.handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handler is not None:
            self.site.open -= 1
            if self.peer is not None:
                self.site.peers.release(self.peer)
            self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

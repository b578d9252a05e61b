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

import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from controller.admin.page import favicon, status_page

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


BEYOND_RECOVERY = frozenset({"restart_budget_spent"})
"""/healthz reasons after which the daemon no longer recovers by itself (``lifecycle.guard`` gives
up restarting the engine): only a new process helps, so /livez fails on them."""


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


async def start_admin(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

"""The control plane (aiohttp): /metrics, /state, /healthz, /reload, and the status page at /.

The gauges need no refresh here: the registry holds a Collector that reads the live values at
each scrape (``controller.admin.metrics.LiveGauges``). An optional bearer token (``[admin] token``)
guards /state and /reload; /metrics and /healthz stay open for scrapers and probes, and so does the
status page (``controller.admin.page``: a static file, its data fetched from /state with the token).
"""

from __future__ import annotations

import hmac
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
OUR_REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("registry")
VLLM_REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("vllm_registry")


def _authorized(request: web.Request) -> bool:
    token = request.app[TOKEN]
    if not token:
        return True
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


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


async def reload(request: web.Request) -> web.Response:
    if not _authorized(request):
        return _unauthorized()
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
) -> web.Application:
    """`vllm_registry` is where vLLM's stat logger registers its vllm:* metrics (prometheus_client's
    process-wide default); /metrics serves it after ours."""
    app = web.Application()
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
    app.router.add_post("/reload", reload)
    return app


async def start_admin(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

"""The control plane (aiohttp): /metrics, /state, /healthz."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

StateFn = Callable[[], dict[str, Any]]
HealthFn = Callable[[], tuple[bool, str]]
RefreshFn = Callable[[], None]

STATE: web.AppKey[StateFn] = web.AppKey("state")
HEALTH: web.AppKey[HealthFn] = web.AppKey("health")
REFRESH: web.AppKey[RefreshFn] = web.AppKey("refresh")
OUR_REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("registry", CollectorRegistry)


async def metrics(request: web.Request) -> web.Response:
    request.app[REFRESH]()
    body = generate_latest(request.app[OUR_REGISTRY]) + generate_latest(REGISTRY)  # ours + vllm:*
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def state(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE]())


async def healthz(request: web.Request) -> web.Response:
    ok, reason = request.app[HEALTH]()
    return web.json_response({"ok": ok, "reason": reason}, status=200 if ok else 503)


def make_admin_app(
    registry: CollectorRegistry,
    refresh: Callable[[], None],
    state_fn: Callable[[], dict[str, Any]],
    health_fn: Callable[[], tuple[bool, str]],
) -> web.Application:
    app = web.Application()
    app[OUR_REGISTRY] = registry
    app[REFRESH] = refresh
    app[STATE] = state_fn
    app[HEALTH] = health_fn
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/state", state)
    app.router.add_get("/healthz", healthz)
    return app


async def start_admin(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner

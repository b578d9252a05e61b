"""The data plane's API key on every route vLLM registers.

vLLM's own key check guards only the paths under /v1, /v2, /inference and /cohere, so /invocations
(chat and completion bodies), /generative_scoring, /tokenize and the dev-mode routes answered without
the key. These tests build vLLM's real app (``build_app``: every task, the dev-mode and fault-tolerance
routes, the pooling routes over a fake model config; no engine), serve it as the daemon does
(``make_server``) and try every route it registers, without the key, with a wrong one and with the
key. The probes (health, ping, load, version, metrics) and CORS preflights stay open.
"""

from __future__ import annotations

import argparse
import re
import typing
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.routing import Mount, Route, WebSocketRoute

from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.engine.frontend.app import make_server
from controller.engine.frontend.auth import ApiKeyCheck, api_keys
from controller.engine.runtime.args import serve_namespace

API_KEY = "secret-key-42"
OPEN_PATHS = {"/health", "/ping", "/load", "/version", "/metrics", "/metrics/"}


def served_args(**server: Any) -> argparse.Namespace:
    args = serve_namespace({"model": "/models/tiny"}, {"host": "127.0.0.1", "port": 0, **server})
    args.enable_fault_tolerance = True  # its routes too
    return args


@pytest.fixture(scope="module")
def vllm_app() -> Iterator[FastAPI]:
    """vLLM's app with every route it can register: every task, dev mode, fault tolerance, and the
    pooling routes (they need a model config that names a pooling task)."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.tasks import SupportedTask

    pooling_model = SimpleNamespace(get_pooling_task=lambda tasks: "embed", hf_config=SimpleNamespace())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")
        mp.delenv("VLLM_API_KEY", raising=False)
        args = served_args(api_key=API_KEY, allowed_origins=["http://a"])
        yield build_app(args, typing.get_args(SupportedTask), pooling_model)  # type: ignore[arg-type]


def served(app: FastAPI, args: argparse.Namespace) -> Any:
    """The ASGI stack the daemon's uvicorn serves."""
    gate = AdmissionGate(2, 16, (PriorityClass("all", queue_deadline_s=1e6),), clock=FakeClock())
    return make_server(app, args, 5.0, gate).config.app


def http_requests(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) for every HTTP route and method vLLM registered, path parameters filled in."""
    found = []
    for route in app.routes:
        if isinstance(route, Mount):
            found.append(("GET", route.path + "/"))
        elif isinstance(route, Route):
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            found += [(m, path) for m in sorted(route.methods or ()) if m != "HEAD"]
    return found


async def call(stack: Any, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    transport = httpx.ASGITransport(app=stack, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await c.request(method, path, headers=headers, json={} if method == "POST" else None)


def test_the_enumeration_covers_the_generation_routes_and_no_route_takes_options(vllm_app: FastAPI) -> None:
    paths = {path for _, path in http_requests(vllm_app)}
    assert {"/invocations", "/generative_scoring", "/v1/completions", "/collective_rpc"} <= paths
    assert {"/v1/embeddings", "/pooling"} <= paths  # the pooling routes are in
    assert len(paths) > 60
    # OPTIONS passes without a key (CORS preflight, as vLLM): no route may serve it.
    assert all(m != "OPTIONS" for m, _ in http_requests(vllm_app))


async def test_every_route_but_the_probes_answers_401_without_the_key(vllm_app: FastAPI) -> None:
    stack = served(vllm_app, served_args(api_key=API_KEY))
    unguarded, probes = [], []
    for method, path in http_requests(vllm_app):
        for key in (None, "secret-key-4", API_KEY + "2", ""):
            r = await call(stack, method, path, key)
            if path in OPEN_PATHS:
                probes.append((path, r.status_code))
            elif r.status_code != 401 or r.headers.get("www-authenticate") != "Bearer":
                unguarded.append((method, path, key, r.status_code))  # or vLLM's own check answered
    assert unguarded == []
    assert {p for p, _ in probes} == OPEN_PATHS and all(status != 401 for _, status in probes)


async def test_every_websocket_route_is_denied_without_the_key(vllm_app: FastAPI) -> None:
    stack = served(vllm_app, served_args(api_key=API_KEY))
    paths = [r.path for r in vllm_app.routes if isinstance(r, WebSocketRoute)]
    assert "/v1/realtime" in paths
    for path in paths:
        rec = Recorder()
        ws = {**scope(path), "type": "websocket", "extensions": {"websocket.http.response": {}}}
        await stack(ws, rec.receive, rec.send)
        assert rec.sent[0]["type"] == "websocket.http.response.start" and rec.sent[0]["status"] == 401
        assert any((k, v) == (b"www-authenticate", b"Bearer") for k, v in rec.sent[0]["headers"])


async def test_every_route_passes_the_check_with_the_key(vllm_app: FastAPI) -> None:
    stack = served(vllm_app, served_args(api_key=API_KEY))
    for method, path in http_requests(vllm_app):
        r = await call(stack, method, path, API_KEY)  # vLLM's handlers fail without an engine: not 401
        assert r.status_code != 401, (method, path)


async def test_the_refusal_says_what_is_missing_in_vllms_error_shape(vllm_app: FastAPI) -> None:
    r = await call(served(vllm_app, served_args(api_key=API_KEY)), "POST", "/invocations", None)
    error = r.json()["error"]
    assert r.status_code == 401 and error["code"] == 401 and error["type"] == "Unauthorized"
    assert "Authorization: Bearer" in error["message"] and API_KEY not in r.text


async def test_unknown_paths_need_the_key_too(vllm_app: FastAPI) -> None:
    stack = served(vllm_app, served_args(api_key=API_KEY))
    for path in ("/nope", "/health/", "/healthz", "/metricsx", "/invocations/", "/docs", "/openapi.json"):
        assert (await call(stack, "GET", path, None)).status_code == 401, path


async def test_a_cors_preflight_passes_without_the_key(vllm_app: FastAPI) -> None:
    stack = served(vllm_app, served_args(api_key=API_KEY))
    transport = httpx.ASGITransport(app=stack)
    headers = {"Origin": "http://a", "Access-Control-Request-Method": "POST"}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.options("/invocations", headers=headers)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a"


# -- the check itself, on a fake app ----------------------------------------------------------------


class Recorder:
    """An app that records what reached it; a receive that must not be called before the key."""

    def __init__(self) -> None:
        self.reached: list[str] = []
        self.sent: list[dict[str, Any]] = []

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.reached.append(scope["path"])

    async def receive(self) -> dict[str, Any]:
        raise AssertionError("the body was read before the key was checked")

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def scope(path: str, authorization: bytes | None = None, **extra: Any) -> dict[str, Any]:
    headers = [(b"authorization", authorization)] if authorization is not None else []
    return {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers, **extra}


async def test_a_refusal_reads_no_body_and_never_reaches_the_app() -> None:
    rec = Recorder()
    await ApiKeyCheck(rec.app, ["k1"])(scope("/invocations"), rec.receive, rec.send)
    assert rec.reached == [] and rec.sent[0]["status"] == 401


@pytest.mark.parametrize(
    ("authorization", "passes"),
    [
        (b"Bearer k1", True),
        (b"bearer k2", True),  # the scheme in any case, and any of the keys, as vLLM
        (b"BEARER k1", True),
        (b"Bearer  k1", False),
        (b"Basic k1", False),
        (b"k1", False),
        (b"Bearer k", False),
        (b"Bearer k1 ", False),
        (b"Bearer ", False),
    ],
)
async def test_the_key_is_compared_whole_as_vllm_does(authorization: bytes, passes: bool) -> None:
    rec = Recorder()
    await ApiKeyCheck(rec.app, ["k1", "k2"])(scope("/v1/completions", authorization), rec.receive, rec.send)
    assert (rec.reached == ["/v1/completions"]) is passes


async def test_the_probes_are_open_under_a_root_path() -> None:
    rec = Recorder()
    check = ApiKeyCheck(rec.app, ["k1"])
    await check(scope("/api/health", root_path="/api"), rec.receive, rec.send)
    await check(scope("/api/invocations", root_path="/api"), rec.receive, rec.send)
    assert rec.reached == ["/api/health"] and rec.sent[0]["status"] == 401


async def test_a_websocket_without_the_key_is_denied_before_it_is_accepted() -> None:
    rec = Recorder()
    check = ApiKeyCheck(rec.app, ["k1"])
    ws = {**scope("/v1/realtime"), "type": "websocket", "extensions": {"websocket.http.response": {}}}
    await check(ws, rec.receive, rec.send)
    await check({**ws, "extensions": {}}, rec.receive, rec.send)
    assert rec.reached == []
    denial = ["websocket.http.response.start", "websocket.http.response.body", "websocket.close"]
    assert [m["type"] for m in rec.sent] == denial
    assert rec.sent[0]["status"] == 401


def test_the_keys_are_read_as_vllm_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys(served_args(api_key=["a", "b"])) == ["a", "b"]  # the option wins over the env
    assert api_keys(served_args()) == ["from-env"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert api_keys(served_args()) == []


def test_without_a_key_the_data_plane_is_served_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    app = FastAPI()
    assert not isinstance(served(app, served_args()), ApiKeyCheck)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert isinstance(served(app, served_args()), ApiKeyCheck)

"""The data plane's API key: every route but the probes needs ``Authorization: Bearer KEY``.

vLLM's own check (``AuthenticationMiddleware``, added by ``build_app`` when a key is set) guards only
the paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``: ``/invocations`` (it dispatches chat
and completion bodies), ``/generative_scoring``, ``/tokenize`` and the dev-mode routes
(``/collective_rpc``, ``/sleep``, ...) answer without it. This check inverts the list: a key is needed
everywhere, unknown paths and the API docs included, except

* the probes a load balancer or scraper calls without credentials: ``/health``, ``/ping``
  (SageMaker's), ``/load``, ``/get_load`` (vllm-router's load poll, ``load.py``), ``/version``,
  ``/metrics`` (and its mount, ``/metrics/...``);
* ``OPTIONS``, as in vLLM, so a CORS preflight (which carries no credentials) is answered by vLLM's
  CORS middleware; no route of vLLM's takes OPTIONS, so it reaches no handler.

It is the outermost layer of the served app: a request without the key is answered before its body
is read or counted. The keys and their comparison are vLLM's: ``--api-key`` (``[server] api_key``),
else ``VLLM_API_KEY``; the scheme ``Bearer`` in any case; the rest of the header compared whole, as
SHA-256 digests with ``secrets.compare_digest`` against every key (constant time, whatever matches).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from vllm import envs

ASGIApp = Callable[..., Any]

OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/get_load", "/version", "/metrics"})
"""Paths served without a key (compared whole, after the root path)."""
OPEN_PREFIXES = ("/metrics/",)
"""vLLM mounts its Prometheus app under ``/metrics``."""

REFUSAL = (
    "missing or wrong API key: send the header 'Authorization: Bearer <key>' with one of the keys "
    "the data plane was started with ([server] api_key / --api-key, or VLLM_API_KEY)"
)


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys vLLM's ``build_app`` accepts: ``--api-key`` wins over ``VLLM_API_KEY``."""
    return [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]


def with_api_key(app: ASGIApp, args: argparse.Namespace) -> ASGIApp:
    """``app`` behind the key check, or ``app`` itself when no key is set (an open server, as vLLM)."""
    keys = api_keys(args)
    return ApiKeyCheck(app, keys) if keys else app


def is_open(scope: dict[str, Any]) -> bool:
    if scope.get("method") == "OPTIONS":
        return True
    path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class ApiKeyCheck:
    """ASGI middleware: 401 (vLLM's error shape, ``WWW-Authenticate: Bearer``) for a request or
    websocket without one of ``keys``, before the app or its body is touched."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeyCheck needs at least one key (with_api_key serves an open app)")
        self.app = app
        self._digests = [_digest(key) for key in keys]

    async def __call__(self, scope: dict[str, Any], receive: ASGIApp, send: ASGIApp) -> None:
        if scope["type"] not in ("http", "websocket") or is_open(scope) or self.accepts(scope):
            await self.app(scope, receive, send)
            return
        await _refuse(scope, send)

    def accepts(self, scope: dict[str, Any]) -> bool:
        value = _header(scope, b"authorization")
        if value is None:
            return False
        scheme, _, key = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given, match = _digest(key), False
        for digest in self._digests:  # every key compared: the time does not say which matched
            match |= secrets.compare_digest(given, digest)
        return match


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")  # as Starlette's Headers, which vLLM reads
    return None


async def _refuse(scope: dict[str, Any], send: ASGIApp) -> None:
    body = json.dumps(
        {"error": {"message": REFUSAL, "type": "Unauthorized", "param": None, "code": 401}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif "websocket.http.response" in scope.get("extensions", {}):  # a 401 instead of the handshake
        await send({"type": "websocket.http.response.start", "status": 401, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:  # the server cannot answer a handshake with a response: closed before accepting (403)
        await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})

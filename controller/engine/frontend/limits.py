"""What one client may cost the data plane: the size of its request body and how long a response
write may wait for it to read.

* ``max_body_bytes``: a body larger than this gets 413 before the app reads it (by its
  Content-Length, or counted as it arrives when it is sent chunked), so one request cannot make the
  daemon buffer without bound.
* ``send_timeout_s``: a write that a client does not take within this long ends the request: the
  connection is closed and vLLM's generator is closed with it (the engine aborts the request). Its
  admission slot came back when the engine finished it (pump.py); this frees the handler and the
  outputs queued for the client.
* ``max_connections``: open connections the server holds at once (uvicorn's ``limit_concurrency``;
  beyond it uvicorn answers 503).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)

ASGIApp = Callable[..., Any]


@dataclass(frozen=True)
class Limits:
    """The [server] limits (controller/config/load.py documents them)."""

    send_timeout_s: float = 30.0
    max_connections: int = 4096
    max_body_bytes: int = 64 << 20


DEFAULT_LIMITS = Limits()


class SendStalled(Exception):
    """The client read nothing for ``send_timeout_s``: the response is abandoned."""


class ClientLimits:
    """ASGI middleware: the body limit and the send timeout."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict[str, Any], receive: ASGIApp, send: ASGIApp) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            await self._too_large(send, int(length))
            return
        if length is None and headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            replay = await self._buffered(receive, send)
            if replay is None:
                return
            receive = replay
        await self.app(scope, receive, self._timed(send, scope.get("path", "")))

    async def _buffered(self, receive: ASGIApp, send: ASGIApp) -> ASGIApp | None:
        """Read a chunked body up to the limit and replay it; None when it was answered (413) or
        the client left."""
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            if len(body) > self.limits.max_body_bytes:
                await self._too_large(send, len(body))
                return None
            more = bool(message.get("more_body", False))
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return dict(await receive())  # later calls wait for the disconnect, as before
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return replay

    def _timed(self, send: ASGIApp, path: str) -> ASGIApp:
        timeout = self.limits.send_timeout_s

        async def timed_send(message: dict[str, Any]) -> None:
            try:
                async with asyncio.timeout(timeout):
                    await send(message)
            except TimeoutError:
                log.warning("client_send_stalled", path=path, send_timeout_s=timeout)
                raise SendStalled(f"the client read nothing for {timeout:g}s (send_timeout_s)") from None

        return timed_send

    async def _too_large(self, send: ASGIApp, size: int) -> None:
        limit = self.limits.max_body_bytes
        message = f"request body of {size} bytes exceeds max_body_bytes = {limit}"
        body = json.dumps(
            {"error": {"message": message, "type": "RequestEntityTooLarge", "param": None, "code": 413}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

"""What one client may cost the data plane once its request reaches the app: the size of its
request body, how long the app waits for the body's next bytes, and how long a response write may
wait for it to read. (Before that, the connection and its headers: ``wire.py``.)

* ``max_body_bytes``: a body larger than this gets 413: at once when its Content-Length says so;
  otherwise its bytes are counted as the app reads them, whatever the framing (chunked, any coding
  list ending in chunked, which httptools decodes as chunked, a Content-Length the bytes exceed), and
  once the count passes the limit the client is answered 413 (if no answer has started) and the app
  is told the client left. Nothing is buffered here: vLLM reads the body itself, so one request
  cannot make the daemon hold more than the limit.
* ``body_timeout_s``: a read of the body that the client leaves without bytes this long (the app
  waits, nothing arrives) ends the request: 408 (if no answer has started) with the connection
  closed, and the app is told the client left, so the body read so far is freed. The gap between two
  reads, as nginx's ``client_body_timeout``: a large body on a slow link passes, a body that stops
  short does not. Only the body is watched: a read after its end is the app listening for a
  disconnect, which lasts as long as the response.
* ``send_timeout_s``: a write that a client does not take within this long ends the request: the
  connection is closed and vLLM's generator is closed with it (the engine aborts the request). Its
  admission slot came back when the engine finished it (pump.py); this frees the handler and the
  outputs queued for the client. One timer per response watches its writes (``StallWatch``), not a
  timeout context per write: a stream writes a message per token, and the context's timer handle,
  made and cancelled per message, was the largest per-request cost of ours in the front end's
  profile (docs/results/frontend.md).
* ``max_connections``: open connections the server holds at once (uvicorn's ``limit_concurrency``;
  beyond it uvicorn answers 503); ``max_connections_per_peer``, ``header_timeout_s`` and
  ``max_header_bytes`` bound a connection before its request reaches the app (``wire.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)

ASGIApp = Callable[..., Any]


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the API server: the [server] keys of the same names
    (controller/config/load.py documents them)."""

    send_timeout_s: float = 30.0
    max_connections: int = 4096
    max_body_bytes: int = 64 << 20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 << 10
    max_connections_per_peer: int = 1024


DEFAULT_SERVER_LIMITS = ServerLimits()


class SendStalled(Exception):
    """The client read nothing for ``send_timeout_s``: the response is abandoned."""


class Timer(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """What ``StallWatch`` needs of an event loop: its clock and a timer (a fake in tests)."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object], /) -> Timer: ...


class Cancellable(Protocol):
    """What ``StallWatch`` needs of the task that writes: ``asyncio.Task``'s cancel count."""

    def cancel(self, msg: Any = None) -> bool: ...

    def cancelling(self) -> int: ...

    def uncancel(self) -> int: ...


class StallWatch:
    """The send timeout of one response (or the body timeout of its request: a read for a write): a
    write in progress for ``timeout_s`` cancels the task that writes, and ``owns`` tells that
    cancellation from any other (``_Exchange`` turns it into ``SendStalled``, or a 408, as
    ``asyncio.timeout`` turns its own into ``TimeoutError``).

    A write records when it began (``begin``) and that it ended (``end``): no timer of its own. One
    timer is armed at the first write for its start + ``timeout_s``; when it fires, the write then in
    progress is the one it was armed for (the same start): stalled; a later one: armed again for
    that write's start + ``timeout_s``; none: disarmed until the next write. So a response that
    writes one message per token makes one timer per ``timeout_s`` of its life, and a write is
    cancelled when it has lasted ``timeout_s``, by the loop's own timer."""

    __slots__ = ("_armed_for", "_begun", "_cancelling", "_fired", "_task", "_timer", "_timers", "timeout_s")

    def __init__(self, timeout_s: float, timers: Timers) -> None:
        self.timeout_s = timeout_s
        self._fired = False
        """The watch cancelled a write that lasted ``timeout_s``, and ``owns`` has not yet said so."""
        self._timers = timers
        self._begun: float | None = None
        """When the write in progress began (the loop's clock); None between writes."""
        self._armed_for: float | None = None
        self._task: Cancellable | None = None
        self._cancelling = 0
        self._timer: Timer | None = None

    def begin(self, task: Cancellable) -> None:
        """A write by ``task`` begins."""
        self._begun = now = self._timers.time()
        self._task, self._cancelling = task, task.cancelling()
        if self._timer is None:
            self._arm(now)

    def end(self) -> None:
        """The write in progress ended (written, failed or cancelled)."""
        self._begun = self._task = None

    def owns(self, task: Cancellable) -> bool:
        """Whether the cancellation ``task`` is handling is the watch's own (then it is taken back,
        and a cancellation from elsewhere at the same time still stands: ``asyncio.timeout``'s rule)."""
        if not self._fired:
            return False
        self._fired = False
        return task.uncancel() <= self._cancelling

    def close(self) -> None:
        """The response is over: its timer goes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, begun: float) -> None:
        self._armed_for = begun
        self._timer = self._timers.call_at(begun + self.timeout_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
        begun, task = self._begun, self._task
        if begun is None or task is None:
            return
        if begun != self._armed_for:
            self._arm(begun)
            return
        self._fired = True
        task.cancel()


class ClientLimits:
    """ASGI middleware: the body limit, the body timeout and the send timeout."""

    def __init__(self, app: ASGIApp, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict[str, Any], receive: ASGIApp, send: ASGIApp) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(receive, send, self.limits, scope.get("path", ""))
        try:
            declared = _declared_length(scope.get("headers", []))
            if declared is not None and declared > self.limits.max_body_bytes:
                await exchange.too_large(declared)
                return
            await self.app(scope, exchange.receive, exchange.send)
        except Exception as e:
            if not exchange.answered:
                raise
            # The app read a disconnect where its body went on (Starlette raises ClientDisconnect)
            # after the client had its 413: nothing is left to answer.
            log.debug("body_cut_app_ended", path=exchange.path, error=type(e).__name__)
        finally:
            exchange.watch.close()
            if exchange.body_watch is not None:
                exchange.body_watch.close()


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The Content-Length when it frames the body (no Transfer-Encoding beside it), else None."""
    fields = {name.lower(): value for name, value in headers}
    length = fields.get(b"content-length")
    if b"transfer-encoding" in fields or length is None or not length.isdigit():
        return None
    return int(length)


class _Exchange:
    """One request seen through the limits: the body bytes the app has read so far, whether an
    answer has started (the app's or ours), and every write bounded by the send timeout."""

    def __init__(self, receive: ASGIApp, send: ASGIApp, limits: ServerLimits, path: str) -> None:
        self._receive, self._send, self.limits, self.path = receive, send, limits, path
        self._loop = asyncio.get_running_loop()
        self.watch = StallWatch(limits.send_timeout_s, self._loop)
        self.body_watch: StallWatch | None = None
        """The body's reads, watched from the first read until the body ends."""
        self.body_done = False
        self.counted = 0
        self.started = False
        self.cut = False
        """Past the limit: the app's reads see a disconnect from now on."""
        self.answered = False
        """Our 413 or 408 went out: the app's own answer is dropped."""

    async def receive(self) -> dict[str, Any]:
        if self.cut:
            return {"type": "http.disconnect"}
        message = await (self._receive() if self.body_done else self._read_body())
        if message["type"] == "http.request":
            if not message.get("more_body", False):
                self.body_done = True
            self.counted += len(message.get("body", b""))
            if self.counted > self.limits.max_body_bytes:
                self.cut = True
                if not self.started:
                    await self.too_large(self.counted)
                return {"type": "http.disconnect"}
        return message

    async def _read_body(self) -> dict[str, Any]:
        """The next message of the body; after ``body_timeout_s`` with nothing read, a 408 and a
        disconnect (the client is gone, to the app)."""
        if self.body_watch is None:
            self.body_watch = StallWatch(self.limits.body_timeout_s, self._loop)
        task = asyncio.current_task(self._loop)
        assert task is not None  # an ASGI app runs in a task
        self.body_watch.begin(task)
        try:
            message: dict[str, Any] = await self._receive()
            return message
        except asyncio.CancelledError:
            if not self.body_watch.owns(task):
                raise
        finally:
            self.body_watch.end()
        await self._body_timed_out()
        return {"type": "http.disconnect"}

    async def _body_timed_out(self) -> None:
        timeout = self.limits.body_timeout_s
        log.info("request_body_timed_out", path=self.path, bytes=self.counted, body_timeout_s=timeout)
        self.cut = True
        if not self.started:
            message = f"no request body bytes for {timeout:g}s (body_timeout_s) after {self.counted} bytes"
            await self._error(408, "RequestTimeout", message, close=True)

    async def send(self, message: dict[str, Any]) -> None:
        """The app's write (dropped once our 413 went out), bounded by the send timeout."""
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
        task = asyncio.current_task(self._loop)
        assert task is not None  # an ASGI app runs in a task
        self.watch.begin(task)
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if not self.watch.owns(task):
                raise
            timeout = self.limits.send_timeout_s
            log.warning("client_send_stalled", path=self.path, send_timeout_s=timeout)
            raise SendStalled(f"the client read nothing for {timeout:g}s (send_timeout_s)") from None
        finally:
            self.watch.end()

    async def too_large(self, size: int) -> None:
        """413 in vLLM's error shape; ``size`` is the declared length or the bytes counted so far."""
        limit = self.limits.max_body_bytes
        log.info("request_body_too_large", reason="max_body_bytes", path=self.path, bytes=size, limit=limit)
        message = f"request body of {size} bytes or more exceeds max_body_bytes = {limit}"
        await self._error(413, "RequestEntityTooLarge", message)

    async def _error(self, status: int, kind: str, message: str, close: bool = False) -> None:
        """Our answer in vLLM's error shape; the app's own is dropped from now on. ``close``: the
        connection ends with it (a body left unfinished cannot be skipped to the next request)."""
        body = json.dumps(
            {"error": {"message": message, "type": kind, "param": None, "code": status}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})
        self.answered = True

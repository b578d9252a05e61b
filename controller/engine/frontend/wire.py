"""What a connection may cost the data plane before its request reaches the app (and the key check).

uvicorn's httptools protocol bounds none of it: it arms its keep-alive timer only after a response,
so a connection that sends nothing, or half a request line, is held for ever and counts against
``limit_concurrency`` (every other client gets 503 once they fill it); and httptools keeps a header
that never ends in memory, however long. ``GuardedHttpTools`` is that protocol with:

* the first byte: a new connection is idle as a kept-alive one is, so uvicorn's own keep-alive timer
  (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, as ``vllm serve``) is armed when it opens: it closes a
  connection that has sent nothing by then;
* the head: a request's line and headers must all arrive within ``header_timeout_s`` of its first
  byte, else 408 and the connection closes;
* its size: a head past ``max_header_bytes`` gets 431 and the connection closes. The bytes are
  counted as they arrive, before httptools holds them; a check follows each read, so a head holds at
  most the cap and one read (the event loop reads 256 KiB at most);
* the peer: at most ``max_connections_per_peer`` open connections from one address
  (``controller/peers.py``); a connection beyond it is closed at once, before it is read, so one
  host cannot fill ``max_connections`` for everyone else.

h11 has a head limit of its own (``h11_max_incomplete_event_size``) but parses in Python: the data
plane keeps httptools, whose parser is the one ``vllm serve`` runs, and bounds it here. A request's
body is bounded in ``limits.py`` (its size, and ``body_timeout_s`` between its reads), where the app
reads it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from controller.engine.frontend.limits import ServerLimits
from controller.peers import Peers, peer_key

log = structlog.get_logger(__name__)

LINGER_S = 2.0
"""How long a connection refused with 408 or 431 discards what its client still sends before it
closes (``GuardedHttpTools._refuse``)."""


class DataPlaneConfig(uvicorn.Config):
    """uvicorn's config with the limits its protocol (``GuardedHttpTools``) reads, and the server's
    per-peer counts."""

    def __init__(self, app: Any, limits: ServerLimits, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedHttpTools, **kwargs)
        self.limits = limits
        self.peers = Peers(limits.max_connections_per_peer, "data_plane")


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module's docstring."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        assert isinstance(config, DataPlaneConfig), "GuardedHttpTools is built by DataPlaneConfig"
        self.limits = config.limits
        self.peers = config.peers
        self.peer: str | None = None
        """The key this connection is counted under; None when it is not counted."""
        self.head_bytes: int | None = 0
        """Bytes of the request head in progress (0: none begun); None while a body is read."""
        self.head_began = 0.0
        self.head_timer: asyncio.TimerHandle | None = None
        self.lingering = False
        """Refused with a status: what the client still sends is discarded until the close."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.client is not None:
            peer = peer_key(self.client[0])
            if not self.peers.admit(peer):
                transport.close()
                return
            self.peer = peer
        # what uvicorn arms only after a response: a connection that sends nothing is closed
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.peers.release(self.peer)
            self.peer = None
        self._disarm_head()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering or self.transport.is_closing():
            return
        if self.head_bytes is not None:
            if self.head_bytes == 0:
                self.head_began = self.loop.time()
            self.head_bytes += len(data)
        super().data_received(data)
        if not self.head_bytes or self.transport.is_closing():
            return  # no head in progress: none begun, or a body is read
        if self.head_bytes > self.limits.max_header_bytes:
            log.info(
                "request_head_too_large",
                client=self.peer,
                bytes=self.head_bytes,
                limit=self.limits.max_header_bytes,
            )
            self._refuse(
                431, f"request line and headers exceed max_header_bytes = {self.limits.max_header_bytes}"
            )
        elif self.head_timer is None:  # a head that did not arrive in one read: its deadline
            deadline = self.head_began + self.limits.header_timeout_s
            self.head_timer = self.loop.call_at(deadline, self._head_timed_out)

    def handle_websocket_upgrade(self) -> None:
        # the connection passes to the websocket protocol, whose end this one never sees
        if self.peer is not None:
            self.peers.release(self.peer)
            self.peer = None
        super().handle_websocket_upgrade()

    def on_headers_complete(self) -> None:
        self._disarm_head()
        self.head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.head_bytes = 0  # the next request's head begins with its first byte

    def _disarm_head(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.lingering or self.transport.is_closing() or not self.head_bytes:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # a pipelined head behind a response still running: looked at again a deadline later
            self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
            return
        log.info("request_head_timed_out", client=self.peer, header_timeout_s=self.limits.header_timeout_s)
        self._refuse(
            408, f"request headers not complete within header_timeout_s = {self.limits.header_timeout_s:g}"
        )

    def _refuse(self, status: int, message: str) -> None:
        """``status`` with ``message``, then the connection closes; a response of this connection in
        progress (a pipelined head behind it) is cut instead, as a status would corrupt it.

        The close lingers (as nginx's ``lingering_close``): our side ends its writes and discards
        what the client still sends for up to ``LINGER_S``. Closed at once, a socket with unread
        bytes resets the connection, and the client's kernel drops the status unread."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        body = message.encode("ascii")
        head = b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self.transport.write(STATUS_LINE[status] + head % len(body) + body)
        self.lingering = True
        self._disarm_head()
        self._unset_keepalive_if_required()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

"""What one client may cost, and shutdown, on the real engine.

A daemon with admission limit 2, ``send_timeout_s`` 2, ``max_connections`` 24 (8 per peer),
``max_body_bytes`` 64 KiB, ``max_header_bytes`` 16 KiB, ``body_timeout_s`` 2, ``header_timeout_s`` 2
and ``shutdown_timeout_s`` 1: a real socket client that stops reading gets its slot back when
the engine finishes, and the stalled send is cut after ``send_timeout_s``; connections past
``max_connections`` get 503; idle sockets up to a peer's cap deny no other client and are closed
after the first-byte deadline; a header that never ends is cut at ``max_header_bytes`` (431) with the
daemon's memory bounded; a body that stops short gets 408; the control plane closes connections that
send no request; a body past ``max_body_bytes`` gets 413, sent whole or chunked; a
shutdown with requests running and queued past the drain deadline answers every one of them (503 or
an error event), none dropped. The tests share one daemon while it serves; the shutdown test ends it,
and a test after it gets a new one (``Daemons``), so no test depends on the order they run in.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio

from controller.admin import server as admin_server
from controller.config.load import load_config
from controller.lifecycle.daemon import Daemon
from tests.helpers import admin_url, http_session, stream_completion, url, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SEND_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 24
PER_PEER = 8
BODY_TIMEOUT_S = 2.0
MAX_HEADER_BYTES = 16384
ADMIN_KEEPALIVE_S = 2.0
PEERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
"""Loopback addresses to connect from besides 127.0.0.1: other peers to the daemon."""


class Daemons:
    """The module's daemon, started when a test first needs one and again after a test shut it down."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.current: Daemon | None = None

    async def serving(self) -> Daemon:
        if self.current is None or self.current.parts.draining:
            self.current = Daemon(load_config(self.config), install_signals=False)
            await self.current.startup()
        return self.current

    async def close(self) -> None:
        if self.current is not None and not self.current.parts.draining:
            await self.current.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemons(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemons]:
    path = write_config(
        tmp_path_factory.mktemp("clients") / "config.toml",
        server={
            "send_timeout_s": SEND_TIMEOUT_S,
            "max_connections": MAX_CONNECTIONS,
            "max_connections_per_peer": PER_PEER,
            "max_body_bytes": 65536,
            "max_header_bytes": MAX_HEADER_BYTES,
            "body_timeout_s": BODY_TIMEOUT_S,
            "header_timeout_s": 2.0,
            "shutdown_timeout_s": 1.0,
        },
        admission={"limit": 2, "max_queue": 64},
    )
    daemons = Daemons(path)
    with pytest.MonkeyPatch.context() as patch:  # the control plane's idle deadline, shortened
        patch.setattr(admin_server, "ADMIN_KEEPALIVE_S", ADMIN_KEEPALIVE_S)
        try:
            yield daemons
        finally:
            await daemons.close()


@pytest_asyncio.fixture(loop_scope="module")
async def daemon(daemons: Daemons) -> Daemon:
    return await daemons.serving()


def raw_request(d: Daemon, body: dict[str, Any], rcvbuf: int = 4096) -> socket.socket:
    """A streamed completion sent on a plain socket with a small receive buffer, never read."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((d.config.server.host, d.config.server.port))
    data = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def read_all(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    s.settimeout(timeout_s)
    out = bytearray()
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    s.close()
    return bytes(out)


async def test_client_that_stops_reading_frees_its_slot_and_its_send_is_cut(daemon: Daemon) -> None:
    gate, requests = daemon.parts.gate, daemon.parts.server.server_state.tasks
    done_before = gate.completed_total
    body = {
        "model": "tiny", "prompt": "a reader that stalls", "max_tokens": 1500, "ignore_eos": True,
        "stream": True, "logprobs": 20, "n": 4,
    }  # fmt: skip  # ~8 MB of events: more than the kernel's socket buffers take (tcp_wmem max 4 MB)
    s = raw_request(daemon, body)
    # its slot weighs its 4 sequences (n = 4), capped at the admission limit of 2: it runs alone
    await wait_for(lambda: gate.stats().in_flight == 2, 30, "the request inside the engine")
    await wait_for(lambda: gate.completed_total > done_before, 60, "the engine to finish the request")
    assert gate.stats().in_flight == 0  # its slot is back though the client has read nothing
    # the client can take none of it: its answer ends only when the stalled send is given up
    await wait_for(lambda: not requests, SEND_TIMEOUT_S + 30, "the stalled send to be given up")
    data = await asyncio.to_thread(read_all, s)
    assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data  # cut, not completed
    async with http_session() as session:  # the daemon serves on
        r = await stream_completion(session, url(daemon, ""), 8)
    assert r["status"] == 200 and r["tokens"] == 8


def connect_from(d: Daemon, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection((d.config.server.host, d.config.server.port), source_address=(source, 0))


def get_models(d: Daemon, source: str = "127.0.0.1") -> bytes:
    """The status line of ``GET /v1/models`` sent from ``source``."""
    s = connect_from(d, source)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    return read_all(s).split(b"\r\n", 1)[0]


async def test_connections_past_max_connections_get_503(daemon: Daemon) -> None:
    connections = daemon.parts.server.server_state.connections
    idle = [connect_from(daemon, peer) for peer in PEERS for _ in range(PER_PEER)]  # 3 peers at their cap
    await wait_for(lambda: len(connections) == MAX_CONNECTIONS, 30, "the server to accept every connection")
    try:
        refused = await asyncio.to_thread(get_models, daemon)
    finally:
        for c in idle:
            c.close()
    await wait_for(lambda: not connections, 30, "the server to close every connection")
    served = await asyncio.to_thread(get_models, daemon)
    assert (refused, served) == (b"HTTP/1.1 503 Service Unavailable", b"HTTP/1.1 200 OK")


async def test_idle_sockets_up_to_a_peer_s_cap_deny_no_one_and_are_closed(daemon: Daemon) -> None:
    connections = daemon.parts.server.server_state.connections
    idle = [connect_from(daemon) for _ in range(PER_PEER + 4)]  # they send nothing, ever
    await wait_for(lambda: len(connections) == PER_PEER, 30, "the peer's cap of connections held")
    try:
        other = await asyncio.to_thread(get_models, daemon, PEERS[0])  # another client is served
        # the first-byte deadline (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) closes every idle socket
        await wait_for(lambda: not connections, 60, "the idle sockets to be closed")
        closed = [await asyncio.to_thread(closed_by_server, c, 10.0) for c in idle]
    finally:
        for c in idle:
            c.close()
    assert other == b"HTTP/1.1 200 OK" and all(closed)
    assert await asyncio.to_thread(get_models, daemon) == b"HTTP/1.1 200 OK"


def closed_by_server(s: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes ``s`` within ``timeout_s`` having sent nothing (False: still open)."""
    s.settimeout(timeout_s)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.close()


def send_endless_header(d: Daemon, mib: int) -> tuple[int, bytes]:
    """Up to ``mib`` MiB of one header that never ends: the bytes the daemon took, and its answer."""
    s = connect_from(d)
    sent, chunk = 0, b"a" * (1 << 20)
    try:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        for _ in range(mib):
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass  # the daemon closed the connection
    s.shutdown(socket.SHUT_WR)
    return sent, read_all(s)


async def test_an_endless_header_is_cut_at_max_header_bytes_with_memory_bounded(daemon: Daemon) -> None:
    process = psutil.Process()  # the daemon serves in this process
    before = process.memory_info().rss
    sent, answer = await asyncio.to_thread(send_endless_header, daemon, 200)
    grown = process.memory_info().rss - before
    # cut at the cap: what the client sent after the 431 was read and dropped, never held
    assert answer.startswith(b"HTTP/1.1 431 ") and grown < 64 << 20, (answer[:80], sent, grown)


async def test_a_body_that_stops_short_gets_408_within_the_body_timeout(daemon: Daemon) -> None:
    data = json.dumps({"model": "tiny", "prompt": "a stalled body", "max_tokens": 1}).encode()
    s = connect_from(daemon)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    s.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data[:-1])  # one byte short
    start = asyncio.get_running_loop().time()
    answer = await asyncio.to_thread(read_all, s, BODY_TIMEOUT_S + 30)
    took = asyncio.get_running_loop().time() - start
    assert answer.startswith(b"HTTP/1.1 408 ") and b"body_timeout_s" in answer, answer[:200]
    assert BODY_TIMEOUT_S - 0.5 < took < BODY_TIMEOUT_S + 30
    await wait_for(lambda: not daemon.parts.server.server_state.tasks, 30, "the request to end")


async def test_the_control_plane_closes_connections_that_send_no_request(daemon: Daemon) -> None:
    admin = daemon.config.admin
    idle = socket.create_connection((admin.host, admin.port))
    partial = socket.create_connection((admin.host, admin.port))
    partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # a head that never ends
    closed = [await asyncio.to_thread(closed_by_server, c, ADMIN_KEEPALIVE_S + 30) for c in (idle, partial)]
    assert closed == [True, True]
    async with http_session() as session, session.get(admin_url(daemon, "/healthz")) as r:
        assert r.status == 200


async def test_body_past_max_body_bytes_gets_413_whole_or_chunked(daemon: Daemon) -> None:
    big = json.dumps({"model": "tiny", "prompt": "x" * 70_000, "max_tokens": 1}).encode()

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    async with http_session() as session:
        headers = {"Content-Type": "application/json"}
        async with session.post(url(daemon, "/v1/completions"), data=big, headers=headers) as r:
            whole = (r.status, await r.text())
        async with session.post(url(daemon, "/v1/completions"), data=chunked(), headers=headers) as r:
            in_chunks = r.status
    assert whole[0] == 413 and "max_body_bytes" in whole[1]
    assert in_chunks == 413


async def test_shutdown_past_its_deadline_answers_running_and_queued_requests(daemon: Daemon) -> None:
    gate = daemon.parts.gate
    body = {"model": "tiny", "prompt": "queued at shutdown", "max_tokens": 2000, "ignore_eos": True}

    async def plain(session: Any) -> dict[str, Any]:
        async with session.post(url(daemon, "/v1/completions"), json=body) as r:
            return {"status": r.status, "body": await r.text(), "headers": dict(r.headers)}

    async with http_session() as session:
        streams = [asyncio.create_task(stream_completion(session, url(daemon, ""), 2000)) for _ in range(2)]
        await wait_for(lambda: gate.stats().in_flight == 2, 30, "2 streams running")
        queued = [asyncio.create_task(plain(session)) for _ in range(2)]
        await wait_for(lambda: gate.stats().queued == 2, 30, "2 requests queued")
        await asyncio.wait_for(daemon.shutdown(), 30)
        ran = await asyncio.wait_for(asyncio.gather(*streams), 10)  # none hangs, none is dropped
        waited = await asyncio.wait_for(asyncio.gather(*queued), 10)
    # A stream whose 200 went out ends with an error event; a queued request gets a 503.
    assert all(r["status"] == 500 and "shutting down" in json.dumps(r["error"]) for r in ran), ran
    assert all(r["status"] == 503 and "shutting down" in r["body"] for r in waited), waited
    assert all("retry-after" in {k.lower() for k in r["headers"]} for r in waited), waited

"""What a connection may cost before its request reaches the app, on the data plane's real server
stack (uvicorn and httptools, ``make_server``) and the control plane's (aiohttp, ``start_admin``),
over real loopback sockets: a connection that sends nothing is closed after the first-byte deadline,
a head that never ends is cut at ``max_header_bytes`` (431) or at ``header_timeout_s`` (408), a body
that stops short gets 408 after ``body_timeout_s``, one address holds at most
``max_connections_per_peer``; the control plane closes idle connections and caps them. Deadlines
are short and every wait is on a condition with a generous bound."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from controller.admin import server as admin
from controller.admission.classes import PriorityClass
from controller.admission.gate import AdmissionGate
from controller.clock import FakeClock
from controller.engine.frontend.app import DataPlaneServer, make_server
from controller.engine.frontend.limits import ServerLimits
from controller.engine.frontend.wire import DataPlaneConfig
from controller.peers import Peers, peer_key
from tests.helpers import wait_for

LIMITS = ServerLimits(
    max_connections=64,
    max_connections_per_peer=4,
    header_timeout_s=0.5,
    max_header_bytes=8192,
    body_timeout_s=0.5,
)
FIRST_BYTE_S = 0.3
"""uvicorn's keep-alive timeout in these servers: the first-byte deadline of a new connection."""
OTHER_PEER = "127.0.0.2"
"""Another loopback address to connect from: another peer to the server on 127.0.0.1."""


def stub_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True})

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return JSONResponse({"bytes": len(await request.body())})  # as FastAPI reads vLLM's body

    return app


@dataclass
class Plane:
    server: DataPlaneServer
    port: int

    @property
    def connections(self) -> set[Any]:
        return self.server.server_state.connections  # type: ignore[return-value]

    @property
    def peers(self) -> Peers:
        config = self.server.config
        assert isinstance(config, DataPlaneConfig)
        return config.peers


@pytest_asyncio.fixture
async def data_plane() -> AsyncIterator[Plane]:
    args = argparse.Namespace(
        host="127.0.0.1", port=0, uvicorn_log_level="warning", disable_uvicorn_access_log=True, api_key=["k"]
    )
    gate = AdmissionGate(2, 16, (PriorityClass("all", queue_deadline_s=1e6),), clock=FakeClock())
    server = make_server(stub_app(), args, 1.0, gate, limits=LIMITS)
    server.config.timeout_keep_alive = FIRST_BYTE_S  # type: ignore[assignment]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_for(lambda: server.started, 10, "the server to start")
    try:
        yield Plane(server, sock.getsockname()[1])
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


async def connect(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def answer(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout_s)


async def get_health(port: int, source: str = "127.0.0.1") -> bytes:
    reader, writer = await connect(port, source)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    status = await answer(reader)
    writer.close()
    return status.split(b"\r\n", 1)[0]


async def test_a_connection_that_sends_nothing_is_closed_after_the_first_byte_deadline(
    data_plane: Plane,
) -> None:
    reader, _ = await connect(data_plane.port)
    assert await answer(reader) == b""  # closed by the server, with nothing said
    await wait_for(lambda: not data_plane.connections, 10, "the connection to be gone")


async def test_a_head_past_max_header_bytes_gets_431_before_it_ends(data_plane: Plane) -> None:
    reader, writer = await connect(data_plane.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
    reply = asyncio.create_task(answer(reader))
    with contextlib.suppress(ConnectionError):  # the server closes the endless header
        for _ in range(64):
            writer.write(b"a" * 65536)
            await writer.drain()
    assert (await reply).startswith(b"HTTP/1.1 431 ")


async def test_a_head_that_trickles_gets_408_at_the_header_deadline(data_plane: Plane) -> None:
    reader, writer = await connect(data_plane.port)
    writer.write(b"GET /health HTTP/1.1\r\n")  # a first byte in time; the rest never comes
    reply = await answer(reader)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"header_timeout_s" in reply


async def test_a_body_that_stops_short_gets_408_after_the_body_timeout(data_plane: Plane) -> None:
    reader, writer = await connect(data_plane.port)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
    writer.write(head.encode() + b"Content-Length: 1000\r\n\r\n" + b"a" * 999)  # one byte short
    reply = await answer(reader)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"body_timeout_s" in reply
    await wait_for(lambda: not data_plane.server.server_state.tasks, 10, "the request to end")


async def test_a_body_that_arrives_in_pieces_within_the_timeout_is_read_whole(data_plane: Plane) -> None:
    reader, writer = await connect(data_plane.port)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Length: 30\r\n"
    writer.write(head.encode() + b"Connection: close\r\n\r\n")
    for _ in range(3):  # 0.3 s each: the whole body takes longer than body_timeout_s, no gap does
        writer.write(b"a" * 10)
        await asyncio.sleep(0.3)
    reply = await answer(reader)
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b'{"bytes":30}')


async def test_one_peer_holds_at_most_its_cap_and_another_is_served(data_plane: Plane) -> None:
    port = data_plane.port
    idle = [await connect(port) for _ in range(LIMITS.max_connections_per_peer)]
    cap = LIMITS.max_connections_per_peer
    await wait_for(lambda: len(data_plane.connections) == cap, 10, "the peer's cap")
    over, _ = await connect(port)
    assert await answer(over) == b""  # closed at once
    assert await get_health(port, OTHER_PEER) == b"HTTP/1.1 200 OK"
    for _, writer in idle:
        writer.close()
    await wait_for(lambda: not data_plane.peers.open, 10, "the peer's connections to be released")
    # type: ignore[attr-defined]
    assert await get_health(port) == b"HTTP/1.1 200 OK"


def test_a_peer_is_its_address_and_an_ipv6_peer_its_64() -> None:
    assert peer_key("10.0.0.7") == "10.0.0.7"
    assert peer_key("::ffff:10.0.0.7") == "10.0.0.7"
    assert peer_key("2001:db8:1:2:aaaa::1") == peer_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert peer_key("2001:db8:1:3::1") != peer_key("2001:db8:1:2::1")


def test_peers_admit_up_to_the_cap_and_again_after_a_release() -> None:
    peers = Peers(2, "test", clock=FakeClock())
    admitted = [peers.admit("a"), peers.admit("a"), peers.admit("a"), peers.admit("b")]
    assert admitted == [True, True, False, True]
    peers.release("a")
    assert peers.admit("a") and dict(peers.open) == {"a": 2, "b": 1}


# -- the control plane --------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def admin_plane(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[web.AppRunner, int]]:
    monkeypatch.setattr(admin, "ADMIN_KEEPALIVE_S", 0.3)
    monkeypatch.setattr(admin, "ADMIN_MAX_CONNECTIONS", 6)
    monkeypatch.setattr(admin, "ADMIN_MAX_CONNECTIONS_PER_PEER", 4)

    async def reload() -> dict[str, Any]:
        return {"ok": True}

    app = admin.make_admin_app(CollectorRegistry(), dict, lambda: (True, "serving"), reload)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    runner = await admin.start_admin(app, "127.0.0.1", port)
    try:
        yield runner, port
    finally:
        await runner.cleanup()


async def test_the_control_plane_closes_a_connection_that_sends_no_request(
    admin_plane: tuple[web.AppRunner, int],
) -> None:
    reader, writer = await connect(admin_plane[1])
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends
    assert await answer(reader) == b""


async def test_the_control_plane_caps_its_connections_per_peer_and_in_all(
    admin_plane: tuple[web.AppRunner, int],
) -> None:
    port = admin_plane[1]
    held = [await connect(port) for _ in range(4)]
    refused, _ = await connect(port)
    assert await answer(refused) == b""  # the peer's fifth
    held += [await connect(port, OTHER_PEER) for _ in range(2)]
    full, _ = await connect(port, "127.0.0.3")
    assert await answer(full) == b""  # the server's seventh
    for _, writer in held:
        writer.close()
    site = next(iter(admin_plane[0].sites))
    await wait_for(lambda: site.open == 0, 10, "the connections to be released")  # type: ignore[attr-defined]
    reader, writer = await connect(port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert (await answer(reader)).startswith(b"HTTP/1.1 200 ")


def test_the_control_plane_bounds_its_request_lines_and_headers() -> None:
    assert admin.ADMIN_MAX_LINE_BYTES <= 8190 and admin.ADMIN_MAX_HEADERS <= 128
    assert admin.ADMIN_KEEPALIVE_S <= 60

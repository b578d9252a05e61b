"""What one client may cost, and shutdown, on the real engine.

A daemon with admission limit 2, ``send_timeout_s`` 2, ``max_connections`` 24, ``max_body_bytes``
64 KiB and ``shutdown_timeout_s`` 1: a real socket client that stops reading gets its slot back when
the engine finishes, and the stalled send is cut after ``send_timeout_s``; connections past
``max_connections`` get 503; a body past ``max_body_bytes`` gets 413, sent whole or chunked; a
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

import pytest
import pytest_asyncio

from controller.config.load import load_config
from controller.lifecycle.daemon import Daemon
from tests.helpers import http_session, stream_completion, url, wait_for, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SEND_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 24


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
            "max_body_bytes": 65536,
            "shutdown_timeout_s": 1.0,
        },
        admission={"limit": 2, "max_queue": 64},
    )
    daemons = Daemons(path)
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


async def test_connections_past_max_connections_get_503(daemon: Daemon) -> None:
    connections = daemon.parts.server.server_state.connections
    idle = []
    for _ in range(MAX_CONNECTIONS):
        c = socket.create_connection((daemon.config.server.host, daemon.config.server.port))
        idle.append(c)
    await wait_for(lambda: len(connections) == MAX_CONNECTIONS, 30, "the server to accept every connection")
    try:
        async with http_session() as session, session.get(url(daemon, "/v1/models")) as r:
            refused = r.status
    finally:
        for c in idle:
            c.close()
    await wait_for(lambda: not connections, 30, "the server to close every connection")
    async with http_session() as session, session.get(url(daemon, "/v1/models")) as r:
        served = r.status
    assert (refused, served) == (503, 200)


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

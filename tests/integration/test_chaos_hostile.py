"""The chaos soak's hostile clients (``controller/bench/chaos/hostile.py``) against a real socket
server on loopback: one the daemon ends (a 408 after a deadline) passes, one the server keeps fails.
They wait on the wall clock (the server's deadline), so they live here, beside the other socket
tests, not among the unit tests; no engine starts."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from controller.bench.chaos.hostile import CLIENTS, HostileRecord, HostileShape, hostile


async def _hostile_against(close_after_s: float | None, client: Any, **shape: Any) -> HostileRecord:
    """One hostile client against a server that closes each connection after ``close_after_s``
    (answering 408 first), or never (None)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if close_after_s is None:
            with contextlib.suppress(ConnectionError):
                while await reader.read(65536):
                    pass
            return
        await asyncio.sleep(close_after_s)
        writer.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await hostile(client, "127.0.0.1", port, HostileShape(**shape), time.monotonic(), 3)
    finally:
        server.close()


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_hostile_client_sees_the_daemon_end_it(client: Any) -> None:
    record = await _hostile_against(0.2, client, hold_s=5.0, trickle_s=0.05, endless_mib=1024)
    assert record.ok, record
    assert record.ended == record.connections
    # a server that closes with bytes it has not read unread resets the connection (TCP's RST)
    assert set(record.answers) <= {"HTTP/1.1 408", "reset"}, record.answers
    if client in ("idle_sockets", "slow_headers"):
        assert record.answers == {"HTTP/1.1 408": record.connections}
    assert record.longest_s is not None and record.longest_s < 5.0


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_hostile_client_the_server_keeps_fails(client: Any) -> None:
    record = await _hostile_against(None, client, hold_s=0.5, trickle_s=0.05, endless_mib=1)
    assert not record.ok
    assert record.ended == 0 and record.answers == {"held": record.connections}
    if client == "idle_sockets":
        assert record.connections == 3 + HostileShape().idle_over  # max_connections and more
    if client == "endless_header":
        assert record.sent_bytes >= 1 << 20  # the whole megabyte went in

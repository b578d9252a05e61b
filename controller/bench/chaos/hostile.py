"""The hostile connections of ``bench chaos``: clients that attack the data plane below HTTP, before
any key check, while the load and the faults run.

- ``idle_sockets``: as many connections as the data plane accepts (``[server] max_connections``) and a
  few more, that never send a byte.
- ``slow_headers``: connections that send a request line, then one byte of a header a second, never
  ending it.
- ``endless_header``: one header that never ends, sent as fast as the daemon reads it, up to
  :attr:`HostileShape.endless_mib`.
- ``stalled_body``: POSTs whose body stops one byte short of its ``Content-Length``.

Each must be ended by the daemon (it closes the connection, or answers with an error) within
``hold_s`` (for the endless header, also before ``endless_mib`` went in); the client never gives up
first, except at ``hold_s``. Each comes from a loopback address of its own (``127.0.0.2`` and up),
never the load's ``127.0.0.1``: a per-peer connection cap that an attack fills is not the one the
ordinary clients count against, as on a real network. While they are open the verdict watches the
ordinary clients (the probe) and the daemon's memory and file descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

Client = Literal["idle_sockets", "slow_headers", "endless_header", "stalled_body"]
CLIENTS: tuple[Client, ...] = get_args(Client)
SOURCES: dict[Client, str] = {
    "idle_sockets": "127.0.0.2",
    "slow_headers": "127.0.0.3",
    "endless_header": "127.0.0.4",
    "stalled_body": "127.0.0.5",
}
"""The peer address each client connects from."""
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HostileShape:
    """What the hostile clients send."""

    hold_s: float = 120.0
    """How long a client keeps a connection the daemon has not ended; past it the client fails."""
    idle_over: int = 16
    """An ``idle_sockets`` client opens the daemon's ``[server] max_connections`` and this many more."""
    idle_max: int = 8192
    """... but never more than this many (the client's own file descriptors)."""
    slow_connections: int = 8
    trickle_s: float = 1.0
    """A ``slow_headers`` connection sends one byte this often."""
    endless_mib: int = 64
    """The endless header must be refused before this many MiB went in."""
    stalled_bodies: int = 4
    body_bytes: int = 256 << 10
    """The ``Content-Length`` a stalled body announces (it sends one byte less)."""


@dataclass(frozen=True)
class HostileRecord:
    """One hostile client: its connections and how the daemon ended them."""

    at_s: float
    client: Client
    connections: int
    ended: int
    """Connections the daemon ended (closed, reset, refused, or answered) within ``hold_s``."""
    longest_s: float | None
    """The longest a connection lasted before the daemon ended it (None: it ended none)."""
    answers: dict[str, int]
    """What the daemon did, counted: ``HTTP 408`` (the status line it answered), ``closed``,
    ``reset``, ``refused`` (at connect), ``held`` (still open at ``hold_s``)."""
    sent_bytes: int
    """The most bytes one connection got in before it ended (the endless header's size)."""
    ok: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Conn:
    """One hostile connection's end, as the client saw it."""

    how: str = "held"
    after_s: float | None = None
    sent: int = 0
    answered: bool = False
    """The daemon's status line arrived: the client stops writing (what it wrote after is not what
    the daemon let in)."""
    ended: asyncio.Event = field(default_factory=asyncio.Event)


Send = Callable[[asyncio.StreamWriter, "_Conn"], Coroutine[Any, Any, None]]
"""What one hostile connection writes, until the daemon ends it."""


async def _watch(reader: asyncio.StreamReader, conn: _Conn, start: float) -> None:
    """Read until the daemon ends the connection: its first line (an answer) or EOF or a reset."""
    how = "closed"
    try:
        first = await reader.readline()
        if first.startswith(b"HTTP/"):
            conn.answered = True
            how = " ".join(first.decode(errors="replace").split()[:2])
            with contextlib.suppress(ConnectionError, OSError):  # a reset after the answer is its end
                while await reader.read(65536):  # the rest, until it closes
                    pass
    except (ConnectionError, OSError):
        how = "reset"
    conn.how, conn.after_s = how, time.monotonic() - start
    conn.ended.set()


async def _one(
    host: str,
    port: int,
    source: str,
    hold_s: float,
    send: Send,
) -> _Conn:
    """One connection from ``source``: ``send`` writes what the client writes; ends when the daemon
    ends it or at ``hold_s``."""
    conn = _Conn()
    start = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, local_addr=(source, 0)), CONNECT_TIMEOUT_S
        )
    except (OSError, TimeoutError):
        conn.how, conn.after_s = "refused", time.monotonic() - start
        return conn
    watcher = asyncio.create_task(_watch(reader, conn, start))
    sender = asyncio.create_task(send(writer, conn))
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(conn.ended.wait(), hold_s)
    finally:
        for task in (sender, watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await task
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return conn


async def _nothing(writer: asyncio.StreamWriter, conn: _Conn) -> None:
    await conn.ended.wait()


def _trickle(every_s: float) -> Send:
    async def send(writer: asyncio.StreamWriter, conn: _Conn) -> None:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: chaos\r\nX-Slow: ")
        while not conn.ended.is_set():
            await writer.drain()
            await asyncio.sleep(every_s)
            writer.write(b"a")
            conn.sent += 1

    return send


def _endless(limit_bytes: int) -> Send:
    async def send(writer: asyncio.StreamWriter, conn: _Conn) -> None:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: chaos\r\nX-Endless: ")
        chunk = b"a" * (64 << 10)
        while not (conn.ended.is_set() or conn.answered) and conn.sent < limit_bytes:
            writer.write(chunk)
            await writer.drain()
            conn.sent += len(chunk)
            # drain() returns without yielding while the kernel takes the bytes (loopback buffers
            # reach 36 MiB): without a yield the watcher never read the 431, and 64 MiB were counted
            await asyncio.sleep(0)
        await conn.ended.wait()  # the daemon must still end it

    return send


def _stalled(size: int) -> Send:
    async def send(writer: asyncio.StreamWriter, conn: _Conn) -> None:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n"
        )
        body = b'{"prompt": "' + b"a" * (size - 13)  # one byte short of the length announced
        writer.write(head.encode() + body)
        await writer.drain()
        conn.sent = len(body)
        await conn.ended.wait()

    return send


async def hostile(
    client: Client, host: str, port: int, shape: HostileShape, t0: float, max_connections: int
) -> HostileRecord:
    """Runs one hostile client against ``host:port`` until the daemon ended each of its connections
    or ``shape.hold_s`` passed."""
    at = time.monotonic() - t0
    source = SOURCES[client]
    send: Send
    if client == "idle_sockets":
        count, send = min(max_connections + shape.idle_over, shape.idle_max), _nothing
    elif client == "slow_headers":
        count, send = shape.slow_connections, _trickle(shape.trickle_s)
    elif client == "endless_header":
        count, send = 1, _endless(shape.endless_mib << 20)
    else:
        count, send = shape.stalled_bodies, _stalled(shape.body_bytes)
    conns = await asyncio.gather(*(_one(host, port, source, shape.hold_s, send) for _ in range(count)))
    ended = [c for c in conns if c.how != "held"]
    sent = max(c.sent for c in conns)
    ok = len(ended) == count
    detail = ""
    if client == "endless_header" and sent >= shape.endless_mib << 20:
        ok, detail = False, f"{shape.endless_mib} MiB of one header went in"
    record = HostileRecord(
        round(at, 1),
        client,
        count,
        len(ended),
        max((c.after_s for c in ended if c.after_s is not None), default=None),
        dict(Counter(c.how for c in conns)),
        sent,
        ok,
        detail,
    )
    print(
        f"chaos {at:7.1f}s {client}: {'ok' if ok else 'FAILED'} ({record.ended}/{count} ended by the "
        f"daemon, longest {record.longest_s or 0:.1f} s, {record.answers}{'; ' + detail if detail else ''})",
        flush=True,
    )
    return record


async def run_hostile(
    host: str,
    port: int,
    shape: HostileShape,
    duration_s: float,
    every_s: float,
    t0: float,
    max_connections: int,
) -> list[HostileRecord]:
    """The hostile clients in turn, each starting ``every_s`` seconds after the one before ended
    (so that no two floods of idle sockets add up past what one client may hold), until the next would
    start after ``duration_s``; returns once the last has ended (at most ``hold_s`` after it started)."""
    records: list[HostileRecord] = []
    while time.monotonic() - t0 + every_s <= duration_s:
        await asyncio.sleep(every_s)
        client = CLIENTS[len(records) % len(CLIENTS)]
        records.append(await hostile(client, host, port, shape, t0, max_connections))
    return records

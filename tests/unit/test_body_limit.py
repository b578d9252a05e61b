"""The request body limit (``max_body_bytes``): every body is counted as the app reads it, whatever its
framing, and answered 413 once the count passes the limit; nothing is buffered on the way.

Only ``Transfer-Encoding: chunked`` exactly was counted, so ``gzip, chunked`` (which httptools, the
parser uvicorn picks when it is installed, decodes as chunked) passed any size; and a counted body was
held whole in memory before the app saw any of it. The ASGI tests drive the middleware with a fake
upload; the last ones go through a real uvicorn server with each HTTP parser.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn

from controller.engine.frontend.limits import ClientLimits, ServerLimits

LIMIT = 1024


class Upload:
    """A client's body as uvicorn hands it over: one ``http.request`` message per chunk; after the
    last, a disconnect."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.pulled = 0

    async def receive(self) -> dict[str, Any]:
        if self.pulled == len(self.chunks):
            return {"type": "http.disconnect"}
        self.pulled += 1
        more = self.pulled < len(self.chunks)
        return {"type": "http.request", "body": self.chunks[self.pulled - 1], "more_body": more}


class ReadingApp:
    """Reads the body to its end (as Starlette's ``request.body()``), then answers 200; records what
    it read and whether its answer went out."""

    def __init__(self) -> None:
        self.read: list[dict[str, Any]] = []
        self.sent: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            self.read.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.read if m["type"] == "http.request")


async def through_limits(
    headers: dict[bytes, bytes], chunks: list[bytes]
) -> tuple[ReadingApp, Upload, list[dict[str, Any]]]:
    app, upload, sent = ReadingApp(), Upload(chunks), []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers.items())}
    await ClientLimits(app, ServerLimits(max_body_bytes=LIMIT))(scope, upload.receive, send)
    return app, upload, sent


def statuses(sent: list[dict[str, Any]]) -> list[int]:
    return [m["status"] for m in sent if m["type"] == "http.response.start"]


FRAMINGS = {
    "chunked": {b"transfer-encoding": b"chunked"},
    "gzip, chunked": {b"transfer-encoding": b"gzip, chunked"},
    "Chunked in capitals": {b"transfer-encoding": b"Chunked"},
    "no length at all": {},
    "a Content-Length that lies": {b"content-length": b"10"},
    "both framings": {b"content-length": b"10", b"transfer-encoding": b"chunked"},
}


@pytest.mark.parametrize("framing", FRAMINGS)
async def test_a_body_past_the_limit_gets_413_before_the_app_has_read_it_all(framing: str) -> None:
    chunks = [b"y" * 300] * 20  # 6000 bytes against 1024
    app, upload, sent = await through_limits(FRAMINGS[framing], chunks)
    assert statuses(sent) == [413]  # the app's own answer after it is dropped
    assert upload.pulled == 4  # the 4th chunk passed the limit: nothing read past it
    assert len(app.body()) <= LIMIT and app.read[-1]["type"] == "http.disconnect"


@pytest.mark.parametrize("framing", FRAMINGS)
async def test_a_body_under_the_limit_reaches_the_app_unchanged_as_it_arrives(framing: str) -> None:
    chunks = [b"a" * 300, b"b" * 300, b"c" * 424]  # exactly the limit
    app, _, sent = await through_limits(FRAMINGS[framing], chunks)
    assert statuses(sent) == [200]
    assert [m["body"] for m in app.read] == chunks  # message by message: nothing held back
    assert [m["more_body"] for m in app.read] == [True, True, False]


async def test_a_declared_length_past_the_limit_gets_413_without_reading_the_body() -> None:
    app, upload, sent = await through_limits({b"content-length": b"1025"}, [b"x" * 1025])
    assert statuses(sent) == [413] and upload.pulled == 0 and app.read == []


async def test_the_413_names_the_limit_in_vllms_error_shape() -> None:
    _, _, sent = await through_limits(FRAMINGS["gzip, chunked"], [b"y" * 600] * 2)
    body = next(m["body"] for m in sent if m["type"] == "http.response.body")
    assert b'"code": 413' in body and b"max_body_bytes = 1024" in body


async def test_a_body_past_the_limit_after_the_answer_started_is_cut_without_a_second_answer() -> None:
    sent: list[dict[str, Any]] = []
    read: list[dict[str, Any]] = []

    async def answers_first(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while (message := await receive())["type"] == "http.request":
            read.append(message)
        read.append(message)
        await send({"type": "http.response.body", "body": b"done"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    upload = Upload([b"y" * 600] * 5)
    scope = {"type": "http", "method": "POST", "path": "/x", "headers": [(b"transfer-encoding", b"chunked")]}
    await ClientLimits(answers_first, ServerLimits(max_body_bytes=LIMIT))(scope, upload.receive, send)
    assert statuses(sent) == [200] and upload.pulled == 2
    assert read[-1]["type"] == "http.disconnect"  # the app is told the client is gone
    assert sent[-1]["body"] == b"done"  # and may end its answer


# -- through a real server ------------------------------------------------------------------------


async def echo_length(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    headers = [(b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def post_chunked(port: int, encoding: bytes, size: int) -> bytes:
    """A raw chunked POST in 500-byte chunks; the status line of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: " + encoding + b"\r\n\r\n")
        for start in range(0, size, 500):
            chunk = b"z" * min(500, size - start)
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        return head.split(b"\r\n")[0]
    finally:
        writer.close()


@pytest.mark.parametrize("parser", ["httptools", "h11"])
async def test_a_real_server_answers_413_to_a_chunked_body_past_the_limit(parser: str) -> None:
    listening = socket.create_server(("127.0.0.1", 0))  # connections wait in its backlog until served
    port = listening.getsockname()[1]
    app = ClientLimits(echo_length, ServerLimits(max_body_bytes=LIMIT))
    server = uvicorn.Server(
        uvicorn.Config(app, http=parser, log_level="warning", lifespan="off", log_config=None)
    )
    task = asyncio.create_task(server.serve(sockets=[listening]))
    try:
        answers = {
            (encoding, size): await post_chunked(port, encoding, size)
            for encoding in (b"chunked", b"gzip, chunked")
            for size in (1000, 100_000)
        }
    finally:
        server.should_exit = True
        await task
    assert answers[b"chunked", 1000].startswith(b"HTTP/1.1 200")
    assert answers[b"chunked", 100_000].startswith(b"HTTP/1.1 413")
    if parser == "httptools":  # it decodes any coding list that ends in chunked
        assert answers[b"gzip, chunked", 1000].startswith(b"HTTP/1.1 200")
        assert answers[b"gzip, chunked", 100_000].startswith(b"HTTP/1.1 413")
    else:  # h11 takes only "chunked" itself
        assert answers[b"gzip, chunked", 100_000].startswith(b"HTTP/1.1 400")

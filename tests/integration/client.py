"""A streaming OpenAI client for the integration tests."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

KEEPALIVE_S = 2.0
"""Client-side idle limit of a pooled connection, below the server's 5 s keep-alive: a connection the
server is closing for idleness is never reused (that race showed as ServerDisconnectedError or
"Connection reset by peer" under load)."""


def http_session(**kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session for the tests (no connection limit, see ``KEEPALIVE_S``)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S), **kwargs
    )


async def stream_completion(
    session: aiohttp.ClientSession, base_url: str, max_tokens: int, priority: int = 0, prompt: str = ""
) -> dict[str, Any]:
    """One streamed /v1/completions request: status, generated tokens (from the usage chunk; a chunk
    may carry several tokens), content chunks, TTFT and when it ended."""
    body = {
        "model": "tiny",
        "prompt": prompt or "the engine serves requests",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "priority": priority,
    }
    chunks = tokens = 0
    t0 = time.monotonic()
    first: float | None = None
    async with session.post(base_url + "/v1/completions", json=body) as resp:
        status = resp.status
        if status != 200:
            return {"status": status, "chunks": 0, "headers": dict(resp.headers), "body": await resp.text()}
        async for line in resp.content:
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                payload = json.loads(text[6:])
                if "error" in payload:
                    return {"status": 500, "chunks": chunks, "tokens": tokens, "error": payload}
                if payload.get("usage"):
                    tokens = payload["usage"]["completion_tokens"]
                if not payload.get("choices"):
                    continue  # the usage-only chunk at the end
                if first is None:
                    first = time.monotonic()
                chunks += 1
    done = time.monotonic()
    return {
        "status": status,
        "chunks": chunks,
        "tokens": tokens,
        "start_mono": t0,
        "first_token_mono": first,
        "done_mono": done,
        "ttft_s": (first or done) - t0,
    }

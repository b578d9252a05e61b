"""One engine request's outputs, read as the engine makes them, whatever the client reads.

The admission limit is about engine concurrency, so a request's slot returns when the engine has
finished it. Read lazily, the engine's final output would only be seen once vLLM's handler pulled
it, and a client that stops reading blocks the handler in its socket write: the slot would stay
pinned as long as the connection lives. ``EngineStream`` pulls the first output inline (the request
enters vLLM when the handler first asks, as before) and every later one in a task of its own, queued
for the reader; ``on_finished`` runs when the engine's stream ends. Outputs are vLLM's deltas, so
the queue holds at most the request's own tokens, and a stalled send is bounded by the data plane's
``[server] send_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

_END = object()


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class EngineStream:
    def __init__(self, stream: AsyncGenerator[Any, None], on_finished: Callable[[], None]) -> None:
        self._stream = stream
        self._on_finished = on_finished
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def outputs(self) -> AsyncGenerator[Any, None]:
        """The engine's outputs in order; its error is raised here. Closing this (a client gone)
        cancels the engine request."""
        try:
            first = await anext(self._stream, _END)
            if first is _END:
                self._on_finished()
                return
            self._task = asyncio.create_task(self._pump())
            yield first
            while (item := await self._queue.get()) is not _END:
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            await self._close()

    async def _pump(self) -> None:
        try:
            async for output in self._stream:
                self._queue.put_nowait(output)
                if getattr(output, "finished", False):
                    self._on_finished()
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine's error (EngineDeadError, ...) is the reader's to handle
            self._queue.put_nowait(_Failed(exc))
        finally:
            self._on_finished()  # the engine is done with the request either way
            await self._stream.aclose()

    async def _close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})
        # Closed here too where the pump never ran: vLLM's generator aborts the engine request.
        await self._stream.aclose()

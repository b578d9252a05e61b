"""One engine request's outputs, read as the engine makes them, whatever the client reads.

The admission limit is about engine concurrency, so a request's slot returns when the engine has
finished it. Read lazily, the engine's final output would only be seen once vLLM's handler pulled
it, and a client that stops reading blocks the handler in its socket write: the slot would stay
pinned as long as the connection lives. ``EngineStream`` pulls the first output inline (the request
enters vLLM when the handler first asks) and every later one in a task of its own; ``on_finished``
runs when the engine's stream ends. A stalled send is bounded by the data plane's
``[server] send_timeout_s``.

Outputs the reader has not taken yet are merged into one, as vLLM's own per-request collector
(``RequestOutputCollector``) merges them for ``vllm serve``'s handler: a handler that falls behind
the engine (a busy API server, a slow client) then writes one chunk for the tokens of several
steps, not one chunk per step, and the buffer holds one output however far behind it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from vllm.outputs import RequestOutput

_END = object()


def hold(held: list[Any], later: Any, aggregate: bool) -> None:
    """Add ``later`` to the outputs not yet read: folded into the last as vLLM's
    ``RequestOutputCollector.put`` folds two ``RequestOutput``s (the later one's tokens appended for
    delta outputs, ``aggregate``; its completions taking their places for cumulative ones), else kept
    after it."""
    if held and isinstance(later, RequestOutput) and isinstance(last := held[-1], RequestOutput):
        last.add(later, aggregate=aggregate)
    else:
        held.append(later)


class EngineStream:
    """The outputs of ``stream``, pumped by a task of its own after the first; ``aggregate`` says the
    outputs are deltas (vLLM's ``RequestOutputKind.DELTA``), whose merge concatenates them.
    ``on_failed``, where given, runs in place of ``on_finished`` when the engine's stream ends in an
    error (the engine died): the caller tells a death from a finish before its reader meets it."""

    def __init__(
        self,
        stream: AsyncGenerator[Any, None],
        on_finished: Callable[[], None],
        aggregate: bool = False,
        on_failed: Callable[[], None] | None = None,
    ) -> None:
        self._stream = stream
        self._on_finished = on_finished
        self._on_failed = on_failed or on_finished
        self._aggregate = aggregate
        self._held: list[Any] = []
        """The outputs the pump read and the reader has not taken (merged where ``hold`` can)."""
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        """The reader's wait for the pump, while it waits."""
        self._task: asyncio.Task[None] | None = None

    async def outputs(self) -> AsyncGenerator[Any, None]:
        """The engine's outputs in order (those the reader was slow to take merged); its error is
        raised here. Closing this (a client gone) cancels the engine request."""
        try:
            first = await anext(self._stream, _END)
            if first is _END:
                self._on_finished()
                return
            self._task = asyncio.create_task(self._pump())
            loop = asyncio.get_running_loop()
            yield first
            while True:
                while not (items := self._held):
                    if self._ended:
                        if self._error is not None:
                            raise self._error
                        return
                    self._waiter = loop.create_future()
                    await self._waiter
                self._held = []
                for item in items:
                    yield item
        finally:
            await self._close()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _pump(self) -> None:
        try:
            async for output in self._stream:
                hold(self._held, output, self._aggregate)
                if getattr(output, "finished", False):
                    self._on_finished()
                self._wake()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine's error (EngineDeadError, ...) is the reader's to handle
            self._error = exc
        finally:
            self._ended = True
            self._wake()
            # the engine is done with the request either way
            (self._on_finished if self._error is None else self._on_failed)()
            await self._stream.aclose()

    async def _close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})
        # Closed here too where the pump never ran: vLLM's generator aborts the engine request.
        await self._stream.aclose()

"""The daemon's background tasks, kept in one place so that shutdown cancels and awaits every one
(STYLE.md 9): the reload-on-SIGHUP loop, the guard's watcher, the watchdog, and the restarts that a
tick or a reload starts. A task that fails is logged when it ends and forgotten, so one failure can
neither be lost silently nor stop shutdown from closing everything else."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def add(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self.add(task)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background_task_failed", task=task.get_name(), error=f"{type(exc).__name__}: {exc}")

    async def cancel_all(self) -> None:
        """Cancel and await every task; none of their errors stops the others' cancelling."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

"""An engine build in a thread of its own, which shutdown never waits for.

A build takes seconds on the CPU and minutes on a GPU (weights, torch.compile, CUDA graphs). Run in
the event loop's default executor, a build in progress at SIGTERM would hold the process at exit
(``asyncio.run`` and the interpreter join that executor's threads) past systemd's
``TimeoutStopSec``, and the engine it finally built would be left running. Here the build runs in a
daemon thread: the daemon's shutdown cancels the wait and exits on time, and an engine that finishes
building after its wait was cancelled, or after the host stopped, is shut down by the build thread
itself (an EngineCore started for nobody is not left behind; multiprocessing's exit handler ends one
still being started when the process exits).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def _discard(llm: Any, why: str) -> None:
    log.warning("engine_built_for_nobody", why=why)
    try:
        llm.shutdown(timeout=5.0)
    except Exception as exc:  # best effort: the process is on its way out
        log.error("engine_discard_failed", error=f"{type(exc).__name__}: {exc}")


async def build_in_thread(
    builder: Callable[[argparse.Namespace], Any], args: argparse.Namespace, stopped: Callable[[], bool]
) -> Any:
    """``builder(args)`` in a daemon thread; its error is raised here. ``stopped``: the host no
    longer wants an engine (its stop ran)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(llm: Any, error: BaseException | None) -> None:
        if done.cancelled():  # shutdown cancelled the wait meanwhile
            if llm is not None:
                threading.Thread(target=_discard, args=(llm, "wait cancelled"), daemon=True).start()
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(llm)

    def run() -> None:
        try:
            llm = builder(args)
        except BaseException as exc:
            _call(loop, settle, None, exc)
            return
        if stopped() or done.cancelled() or not _call(loop, settle, llm, None):
            _discard(llm, "host stopped")

    threading.Thread(target=run, name="engine-build", daemon=True).start()
    return await done


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """Run ``fn`` on the loop; False when the loop is closed (the daemon has exited its loop)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True

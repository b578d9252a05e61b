"""The renderer grace of a swap: a retired engine's renderer stays up until
``RENDERER_GRACE_S`` after the swap has finished, not after the old engine was retired. A GPU build
takes minutes; requests arriving meanwhile still preprocess with the retired renderer (the app's
serving objects are rebuilt only when the new engine is in), so a grace that ran out during the build
shut a renderer that was still in use ("cannot schedule new futures after shutdown"). The engine
builder is a fake that takes as long as the test says; the host is real."""

from __future__ import annotations

import argparse
import asyncio
import threading
from typing import Any

import pytest

from controller.control.steps import StepFeed
from controller.engine.runtime import host as host_module
from controller.engine.runtime.host import EngineHost
from tests.helpers import FakeBuiltEngine, settle


async def test_the_renderer_grace_starts_when_the_swap_finishes_not_when_the_old_engine_retires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A grace of zero ends on the loop's next turn, so when it starts shows without waiting it out:
    one started at the retirement would have shut the renderer while the build still runs."""
    monkeypatch.setattr(host_module, "RENDERER_GRACE_S", 0.0)
    old, new = FakeBuiltEngine(), FakeBuiltEngine()
    build_started, build_may_end = threading.Event(), threading.Event()

    def slow_build(_args: argparse.Namespace) -> Any:
        build_started.set()
        build_may_end.wait(10.0)  # a GPU build: minutes
        return new

    host = EngineHost(argparse.Namespace(max_num_seqs=4), StepFeed(), builder=slow_build)
    host._llm = old  # type: ignore[assignment]
    swapped: list[bool] = []

    async def rebuild_serving_state() -> None:
        swapped.append(old.renderer_shut)

    host.on_new_engine = rebuild_serving_state
    restart = asyncio.create_task(host.restart({"kv_cache_memory_bytes": 1 << 20}))  # old engine first
    assert await asyncio.to_thread(build_started.wait, 10.0)  # the old engine is retired
    await settle()
    assert not old.renderer_shut  # during the build, requests still tokenize with ``old``
    build_may_end.set()
    await asyncio.wait_for(restart, 10.0)
    assert swapped == [False] and host.llm is new  # the serving objects moved with the renderer up
    await settle()
    assert old.renderer_shut  # released when the grace after the swap ended

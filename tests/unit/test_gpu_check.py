"""``gpu-check``'s verdict and what it reads: an engine process forked from the daemon is told from
a spawned one by the kernel's auxiliary vector (vLLM's process titles overwrite the command line and
the environment); the checks that need a GPU are skipped with the reason, and any failure fails the
command."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import psutil
import pytest

from controller.bench.gpucheck import FAIL, PASS, SKIP, Check, not_built, spawned, table, verdict


def wait_until_released(started: MpEvent, release: MpEvent) -> None:
    started.set()
    release.wait(60.0)


@pytest.mark.parametrize(("method", "expected"), [("fork", False), ("spawn", True)])
def test_a_forked_engine_process_is_told_from_a_spawned_one(method: str, expected: bool) -> None:
    ctx: Any = multiprocessing.get_context(method)
    started, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=wait_until_released, args=(started, release))
    child.start()
    try:
        assert started.wait(60.0)
        assert child.pid is not None
        assert spawned(psutil.Process(child.pid), os.getpid()) is expected
    finally:
        release.set()
        child.join(60.0)


def test_the_gpu_only_checks_are_skipped_with_the_reason() -> None:
    on_cpu, on_gpu = not_built(on_gpu=False), not_built(on_gpu=True)
    assert {c.status for c in on_cpu + on_gpu} == {SKIP}
    assert all(c.detail.endswith("needs a GPU") for c in on_cpu)
    assert all(c.detail.endswith("not built yet (issue 42)") for c in on_gpu)


def test_any_failed_check_fails_the_command() -> None:
    passed = [Check("engine_path", PASS, "spawned"), *not_built(on_gpu=False)]
    assert verdict(passed) == 0
    assert verdict([*passed, Check("restart_survived", FAIL, "the daemon exited")]) == 1
    assert table(passed).splitlines()[2] == "| engine_path | pass | spawned |"

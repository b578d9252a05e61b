"""A process forked from the daemon never reaches the daemon's signal handlers (engine/runtime/procs.py).

The daemon's own signal set-up on uvloop, as ``vllm-autopilot serve`` runs it; then a child forked
from a worker thread (as vLLM forks its EngineCore from the daemon's build thread on a GPU) that
installs its own SIGTERM handler, as the EngineCore does, and is retired with SIGTERM, as vLLM retires
it: the daemon records no signal. A forked child that installs no handler (vLLM's data-parallel
coordinator) dies of SIGTERM instead of keeping the daemon's no-op handler. And every engine build
asks vLLM to spawn its processes."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import pytest
import uvloop

from controller.config.load import load_config
from controller.control.steps import StepFeed
from controller.engine.runtime import host as host_module
from controller.engine.runtime.procs import START_METHOD_ENV, spawn_engine_processes
from controller.lifecycle.daemon import Daemon
from tests.helpers import write_config

FORK = multiprocessing.get_context("fork")


def engine_core_like(ready: MpEvent) -> None:
    """What vLLM's EngineCore does first in its process: its own SIGTERM and SIGINT handlers."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    ready.set()
    while True:
        signal.pause()


def coordinator_like(ready: MpEvent) -> None:
    """A forked process that installs no handler of its own."""
    ready.set()
    while True:
        signal.pause()


async def retire_forked_child(
    tmp_path: Path, target: Callable[[MpEvent], None]
) -> tuple[list[int], int | None]:
    """The signals the daemon recorded, and the child's exit code, after a child forked from a build
    thread was sent SIGTERM (None: it still ran 5 s later and was killed)."""
    daemon = Daemon(load_config(write_config(tmp_path / "config.toml")), install_signals=True)
    daemon._install_signal_handlers()
    loop = asyncio.get_running_loop()
    ready = FORK.Event()
    child = FORK.Process(target=target, args=(ready,))
    build = threading.Thread(target=child.start)  # the daemon builds its engine in a thread
    build.start()
    build.join()
    try:
        assert await loop.run_in_executor(None, ready.wait, 30.0)
        child.terminate()
        await loop.run_in_executor(None, child.join, 5.0)
        exitcode = child.exitcode
    finally:
        if child.exitcode is None:
            child.kill()
            child.join()
    # The daemon's own SIGHUP, sent after the child's byte (if any) went into the same pipe: once its
    # handler ran, any byte before it has been read and handled too.
    os.kill(os.getpid(), signal.SIGHUP)
    await asyncio.wait_for(daemon._hup.wait(), 5.0)
    recorded = []
    while not daemon._signals.empty():
        recorded.append(daemon._signals.get_nowait())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.remove_signal_handler(sig)
    return recorded, exitcode


def test_a_forked_engine_core_retired_with_sigterm_leaves_the_daemon_serving(tmp_path: Path) -> None:
    recorded, exitcode = uvloop.run(retire_forked_child(tmp_path, engine_core_like))
    assert recorded == []
    assert exitcode == 0  # its own handler ran


def test_a_forked_process_without_handlers_dies_of_sigterm(tmp_path: Path) -> None:
    recorded, exitcode = uvloop.run(retire_forked_child(tmp_path, coordinator_like))
    assert recorded == []
    assert exitcode == -signal.SIGTERM


def test_engine_processes_are_spawned_whatever_the_operator_set() -> None:
    for asked in ({}, {START_METHOD_ENV: "fork"}, {START_METHOD_ENV: "spawn"}):
        environ = dict(asked)
        spawn_engine_processes(environ)
        assert environ == {START_METHOD_ENV: "spawn"}


class BuildStarted(Exception):
    """The fake engine arguments stop the build where vLLM would read the start method first."""


def test_each_engine_build_asks_for_spawn_before_vllm_reads_its_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str | None] = []

    class FakeEngineArgs:
        def create_engine_config(self, usage_context: Any = None) -> None:
            seen.append(os.environ.get(START_METHOD_ENV))
            raise BuildStarted

    monkeypatch.setenv(START_METHOD_ENV, "fork")
    monkeypatch.setattr(host_module, "engine_args", lambda args: FakeEngineArgs())
    engine_host = host_module.EngineHost(argparse.Namespace(max_num_seqs=4), StepFeed())
    with pytest.raises(BuildStarted):
        engine_host._build(argparse.Namespace(max_num_seqs=4))
    assert seen == ["spawn"]

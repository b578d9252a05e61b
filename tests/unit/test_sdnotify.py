"""The systemd notify client against a real unix datagram socket standing in for systemd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controller.lifecycle import notify as notify_module
from controller.lifecycle.notify import (
    Notifier,
    monotonic_usec,
    start_watchdog,
    watchdog_interval_s,
    watchdog_loop,
)
from tests.helpers import settle


@pytest.fixture
def systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound datagram socket named by NOTIFY_SOCKET, as systemd sets it up."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(1.0)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def drain(sock: socket.socket) -> list[str]:
    sock.setblocking(False)
    out = []
    with contextlib.suppress(BlockingIOError):
        while True:
            out.append(recv(sock))
    return out


def test_exact_datagrams(systemd: socket.socket) -> None:
    n = Notifier()
    assert n.enabled
    assert n.ready()
    assert recv(systemd) == "READY=1"
    assert n.stopping()
    assert recv(systemd) == "STOPPING=1"
    assert n.watchdog()
    assert recv(systemd) == "WATCHDOG=1"
    assert n.status("engine starting")
    assert recv(systemd) == "STATUS=engine starting"
    n.close()


def test_reloading_carries_monotonic_usec(systemd: socket.socket) -> None:
    before = monotonic_usec()
    Notifier().reloading()
    first, second = recv(systemd).split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= monotonic_usec()
    # systemd compares it with CLOCK_MONOTONIC, which Python's monotonic clock is on Linux.
    assert abs(int(value) - time.monotonic() * 1e6) < 5e6


def test_status_fields_stay_on_one_line(systemd: socket.socket) -> None:
    n = Notifier()
    n.ready(status="serving\nlimit=32")
    assert recv(systemd) == "READY=1\nSTATUS=serving limit=32"
    n.stopping(status="draining")
    assert recv(systemd) == "STOPPING=1\nSTATUS=draining"


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"vllm-autopilot-test-{os.getpid()}-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(1.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert Notifier().ready()
        assert recv(sock) == "READY=1"


def test_no_op_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    assert not n.ready()
    assert not n.reloading()
    assert not n.stopping()
    assert not n.watchdog()
    assert not n.status("x")


def test_send_errors_are_swallowed(tmp_path: Path) -> None:
    n = Notifier(str(tmp_path / "nobody-listens"))
    assert n.enabled
    assert not n.ready()
    assert not n.ready()


def test_unsupported_socket_kind_is_a_no_op() -> None:
    assert not Notifier("vsock:2:1234").enabled


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "1000"}, 0.0005),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "me"}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval_s(env) == expected


class Ticks:
    """The watchdog's sleep, on the test's command: each ``sleep`` records the interval it was asked
    for and returns when the test gives it a tick."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self._ticks: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        await self._ticks.get()

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self._ticks.put_nowait(None)


async def test_watchdog_loop_pings_at_once_then_once_per_interval_until_cancelled(
    systemd: socket.socket,
) -> None:
    ticks = Ticks()
    task = asyncio.create_task(watchdog_loop(Notifier(), 0.02, sleep=ticks.sleep))
    await settle()
    assert drain(systemd) == ["WATCHDOG=1"] and ticks.asked == [0.02]  # one at once
    ticks.tick(5)
    await settle()
    assert drain(systemd) == ["WATCHDOG=1"] * 5 and ticks.asked == [0.02] * 6  # one per interval
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ticks.tick()
    await settle()
    assert drain(systemd) == []  # cancelled: no more pings


async def test_every_ping_is_sent_by_the_task_on_the_event_loop_so_a_stuck_loop_stops_them(
    systemd: socket.socket,
) -> None:
    """No thread of its own pings systemd: a loop that stops turning stops the pings, and systemd's
    watchdog restarts the daemon."""
    senders: list[tuple[int, asyncio.Task[Any] | None]] = []

    class Recording(Notifier):
        def watchdog(self) -> bool:
            senders.append((threading.get_ident(), asyncio.current_task()))
            return super().watchdog()

    ticks = Ticks()
    task = asyncio.create_task(watchdog_loop(Recording(), 0.02, sleep=ticks.sleep))
    await settle()
    ticks.tick(2)
    await settle()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert senders == [(threading.get_ident(), task)] * 3
    assert drain(systemd) == ["WATCHDOG=1"] * 3


async def test_the_watchdog_withholds_its_ping_while_the_control_loop_is_stalled(
    systemd: socket.socket,
) -> None:
    """A daemon whose control loop no longer ticks is not alive to systemd: the ping stops (systemd
    restarts the service after WatchdogSec), the status says why, and the pings come back with the
    ticks."""
    why: list[str | None] = [None]
    ticks = Ticks()
    task = asyncio.create_task(watchdog_loop(Notifier(), 0.02, lambda: why[0], sleep=ticks.sleep))
    await settle()
    assert drain(systemd) == ["WATCHDOG=1"]
    why[0] = "no control tick ended for 40s (tick_s = 1)"
    ticks.tick(3)
    await settle()
    assert drain(systemd) == ["STATUS=control loop stalled: no control tick ended for 40s (tick_s = 1)"]
    why[0] = None
    ticks.tick()
    await settle()
    assert drain(systemd) == ["STATUS=serving", "WATCHDOG=1"]
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_start_watchdog_pings_every_half_of_watchdog_usec(
    systemd: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[float] = []

    async def loop(_notifier: Notifier, interval_s: float, _stalled: Any) -> None:
        started.append(interval_s)

    monkeypatch.setattr(notify_module, "watchdog_loop", loop)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert start_watchdog(Notifier()) is None
    monkeypatch.setenv("WATCHDOG_USEC", "40000")
    task = start_watchdog(Notifier())
    assert task is not None and task.get_name() == "sd_watchdog"
    await task
    assert started == [0.02]  # half of WatchdogSec=40ms, as sd_watchdog_enabled(3) advises


async def test_start_watchdog_needs_a_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "40000")
    assert start_watchdog(Notifier()) is None

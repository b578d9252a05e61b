"""systemd notify client (``sd_notify(3)``) for ``Type=notify-reload`` / ``Type=notify`` units.

One datagram per message on the AF_UNIX socket named by ``NOTIFY_SOCKET`` (a path, or ``@name`` for
an abstract socket). Without ``NOTIFY_SOCKET`` (not under systemd, tests) every call is a no-op, so
the daemon calls the notifier unconditionally.

The watchdog is pinged by a coroutine on the daemon's own event loop (``watchdog_loop``), never by
a thread, and only while the control loop's ticks end (``stalled`` says why not): when the event loop
is stuck, or the control loop no longer ticks (its knobs, the memory guard and the saturation frozen
while requests are still served), the pings stop and systemd kills and restarts the service, which is
exactly what ``WatchdogSec=`` is for.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping

import structlog

log = structlog.get_logger(__name__)


def _socket_address(name: str) -> str | None:
    """``NOTIFY_SOCKET`` -> the address for ``sendto``; None for kinds we do not speak (vsock:)."""
    if name.startswith("@"):
        return "\0" + name[1:]  # Linux abstract namespace
    if name.startswith("/"):
        return name
    return None


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, the clock systemd compares ``MONOTONIC_USEC`` against."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends ``sd_notify`` messages; silently does nothing when not started by systemd.

    Send errors are logged once and otherwise ignored: losing a notification must never take the
    daemon down (systemd then times out on its own, which is the visible failure).
    """

    def __init__(self, notify_socket: str | None = None) -> None:
        name = os.environ.get("NOTIFY_SOCKET", "") if notify_socket is None else notify_socket
        self._address = _socket_address(name) if name else None
        if name and self._address is None:
            log.warning("sd_notify_unsupported_socket", notify_socket=name)
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=value`` fields as one datagram; True when it was sent."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(), self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify_failed", error=str(exc), fields=list(fields))
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Startup finished (the data plane listens), or a reload finished (ok or not)."""
        return self.notify("READY=1", *_status(status))

    def reloading(self, status: str | None = None) -> bool:
        """A reload starts. ``MONOTONIC_USEC`` is required by ``Type=notify-reload`` (systemd >= 253)
        and ignored by older ones. Send ``ready()`` when the reload is over."""
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", *_status(status))

    def stopping(self, status: str | None = None) -> bool:
        """The drain starts."""
        return self.notify("STOPPING=1", *_status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        """Free text shown by ``systemctl status``."""
        return self.notify(*_status(text))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str | None) -> tuple[str, ...]:
    # A newline would start a new field: keep the status on one line.
    return () if text is None else ("STATUS=" + " ".join(text.splitlines()),)


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """Half the ``WatchdogSec=`` period from ``WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises;
    None when the watchdog is off, malformed, or meant for another process (``WATCHDOG_PID``)."""
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid is not None:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2_000_000


Stalled = Callable[[], str | None]
"""Why the daemon must not be counted alive now (the control loop no longer ticks), or None."""


def never_stalled() -> str | None:
    return None


async def watchdog_loop(
    notifier: Notifier,
    interval_s: float,
    stalled: Stalled = never_stalled,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Ping ``WATCHDOG=1`` every ``interval_s`` while ``stalled()`` is None, until cancelled; while it
    says why not, withhold the ping (systemd restarts the service after ``WatchdogSec=``), say why in
    the log and in ``systemctl status``. Run it as a task on the daemon's loop; cancel and await it at
    shutdown (after ``stopping()``)."""
    withheld: str | None = None
    while True:
        why = stalled()
        if why is None:
            if withheld is not None:
                log.warning("watchdog_resumed", reason="control_loop_ticks", was=withheld)
                notifier.status("serving")
            notifier.watchdog()
        elif withheld is None:
            log.error("watchdog_withheld", reason="control_loop_stalled", detail=why)
            notifier.status(f"control loop stalled: {why}")
        withheld = why
        await sleep(interval_s)


def start_watchdog(notifier: Notifier, stalled: Stalled = never_stalled) -> asyncio.Task[None] | None:
    """The watchdog task when systemd asked for one (``WatchdogSec=``), else None."""
    interval = watchdog_interval_s()
    if interval is None or not notifier.enabled:
        return None
    log.info("watchdog_enabled", interval_s=interval)
    return asyncio.create_task(watchdog_loop(notifier, interval, stalled), name="sd_watchdog")

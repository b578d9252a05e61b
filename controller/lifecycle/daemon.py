"""The daemon: startup, run, shutdown and signals only (STYLE.md practice 9).

Signal handlers only record the signal; the daemon acts on it. SIGHUP reloads the config
(``controller.lifecycle.reload``). SIGTERM/SIGINT drain: the data plane stops listening and refuses
new requests, in-flight and queued ones finish up to ``[server] shutdown_timeout_s``, then the engine
shuts down and the process exits 0. A second signal forces the exit. systemd hears READY=1 once the
engine serves, RELOADING=1/READY=1 around a reload, STOPPING=1 on drain, and WATCHDOG=1 from this
event loop while the control loop ticks. What runs is built in ``controller.lifecycle.parts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from typing import Any

import structlog

from controller.admin import status
from controller.admin.server import make_admin_app, start_admin
from controller.config.load import Config
from controller.control.samplers import GpuSource, HostReadingSource
from controller.engine.frontend.app import bind_data_plane, build_data_plane, make_server, refresh_app_state
from controller.engine.frontend.client import GovernedEngineClient
from controller.engine.frontend.limits import ServerLimits
from controller.engine.runtime.procs import forget_daemon_signals_after_fork
from controller.lifecycle.notify import start_watchdog
from controller.lifecycle.parts import TICK_JOB, build_parts
from controller.lifecycle.reload import Reloader
from controller.lifecycle.warm import warm_start

log = structlog.get_logger(__name__)

EXIT_ENGINE_UNRECOVERABLE = 3
"""The exit status once the guard gave up on the engine (its restart budget spent): non-zero, so
systemd's ``Restart=on-failure`` and start limit (or a pod's restart back-off) take over."""

END_GRACE_S = 5.0
"""After the drain deadline, how long the answers to the requests ended then have to go out (uvicorn
cuts what is left ``END_GRACE_S`` after ``shutdown_timeout_s``)."""


class ListenError(Exception):
    """A port the daemon listens on could not be bound: the message names it and the fix."""


class Daemon:
    def __init__(
        self,
        config: Config,
        install_signals: bool = True,
        gpu_source: GpuSource | None = None,
        host_source: HostReadingSource | None = None,
    ) -> None:
        self.parts = build_parts(config, gpu_source, host_source)
        self.reloader = Reloader(self.parts)
        self._install_signals = install_signals
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._hup = asyncio.Event()
        self._server_task: asyncio.Task[None] | None = None
        self._admin: Any = None
        self._data_socket: socket.socket | None = None

    @property
    def config(self) -> Config:
        """The config in force (a reload changes its live tables)."""
        return self.parts.config

    # -- signals ------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        # A child forked from here would inherit these handlers and uvloop's wakeup fd: its own
        # SIGTERM would reach this process's handler (engine/runtime/procs.py).
        forget_daemon_signals_after_fork()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signals.put_nowait, sig)
        loop.add_signal_handler(signal.SIGHUP, self._hup.set)

    async def _reload_on_hup(self) -> None:
        while True:
            await self._hup.wait()
            self._hup.clear()
            try:
                await self.reloader.reload()
            except Exception as exc:  # the reloader reports its own errors; this loop must outlive any
                log.error("reload_failed", error=f"{type(exc).__name__}: {exc}")

    async def _force_on_second_signal(self) -> None:
        await self._signals.get()
        log.warning("forced_exit")
        self.parts.server.force_exit = True

    # -- startup ------------------------------------------------------------------------------------
    async def _start_admin(self) -> None:
        p, admin = self.parts, self.config.admin
        state, health = lambda: status.state(p), lambda: status.health(p)
        app = make_admin_app(p.registry, state, health, self.reloader.reload, admin.token, host=admin.host)
        try:
            self._admin = await start_admin(app, admin.host, admin.port)
        except OSError as exc:
            raise ListenError(_listen_error("[admin]", admin.host, admin.port, exc)) from exc
        log.info("control_plane_listening", host=admin.host, port=admin.port)

    def _bind_data_plane(self) -> None:
        """Before the engine build, so that nothing it starts takes the port (app.bind_data_plane)."""
        server = self.config.server
        try:
            self._data_socket = bind_data_plane(self.parts.args)
        except OSError as exc:
            raise ListenError(_listen_error("[server]", server.host, server.port, exc)) from exc

    async def _start_data_plane(self) -> None:
        p = self.parts
        client = GovernedEngineClient(p.host, p.gate, p.guard.notice_dead)
        app = await build_data_plane(client, p.args)
        p.host.on_new_engine = lambda: refresh_app_state(app, client, p.host.args)
        timeout, bounds = self.config.server.shutdown_timeout_s, lambda: p.config.admission.priority_bounds
        server = self.config.server
        limits = ServerLimits(
            send_timeout_s=server.send_timeout_s,
            max_connections=server.max_connections,
            max_body_bytes=server.max_body_bytes,
            body_timeout_s=server.body_timeout_s,
            header_timeout_s=server.header_timeout_s,
            max_header_bytes=server.max_header_bytes,
            max_connections_per_peer=server.max_connections_per_peer,
        )
        p.server = make_server(app, p.args, timeout, p.gate, bounds, limits)  # bounds read per request
        assert self._data_socket is not None, "bound in startup, before the engine"
        self._server_task = asyncio.create_task(p.server.serve(sockets=[self._data_socket]))
        while not p.server.started and not self._server_task.done():
            await asyncio.sleep(0.05)

    def _start_background(self) -> None:
        p = self.parts
        p.scheduler.add_job(
            p.loop.tick,
            "interval",
            seconds=self.config.control.tick_s,
            max_instances=1,
            coalesce=True,
            misfire_grace_time=None,
            id=TICK_JOB,
        )
        p.scheduler.start()
        p.tasks.spawn(self._reload_on_hup())
        p.tasks.spawn(p.guard.watch())
        watchdog = start_watchdog(p.notifier, lambda: status.loop_stall(p))  # pings while the loop ticks
        if watchdog is not None:
            p.tasks.add(watchdog)

    async def startup(self) -> None:
        p, server = self.parts, self.config.server
        p.starting = True  # until the engine serves, a reload is refused (reload.py)
        if self._install_signals:
            self._install_signal_handlers()
        await self._start_admin()
        self._bind_data_plane()
        p.notifier.status("starting the engine")
        await p.host.start()
        if p.cost is not None:  # the step-cost model starts from this box (warm.py), before serving
            p.notifier.status("fitting the step-cost model")
            warm = await warm_start(
                p.host, p.cost.model, self.config.control.cost_profile, self.config.control.warmup_s
            )
            p.cost.warm_start = warm.as_dict()
            if p.fit_check is not None:  # served steps are judged against the fit the model starts from
                p.fit_check.start(p.cost.model.coefficients if p.cost.model.prior else None)
            if warm.source == "warm-up":
                p.window.reset()  # its synthetic requests are not the load the loop observes
        await p.loop.tick()  # the policy's initial values apply before the first request
        await self._start_data_plane()
        self._start_background()
        p.starting = False
        p.notifier.ready(f"serving on {server.host}:{server.port}")
        log.info("serving", host=server.host, port=server.port)

    # -- run ----------------------------------------------------------------------------------------
    async def run(self) -> int:
        """Serve until a signal asks for a drain (exit 0), the data plane dies (exit 1) or the guard
        gives up on the engine (``EXIT_ENGINE_UNRECOVERABLE``)."""
        assert self._server_task is not None
        sig_wait = asyncio.create_task(self._signals.get())
        gave_up = asyncio.create_task(self.parts.guard.given_up.wait())
        done, _ = await asyncio.wait(
            {sig_wait, gave_up, self._server_task}, return_when=asyncio.FIRST_COMPLETED
        )
        if sig_wait in done:
            log.info("drain_requested", signal=signal.Signals(sig_wait.result()).name)
            gave_up.cancel()
            return 0
        sig_wait.cancel()
        gave_up.cancel()
        if self._server_task in done:
            log.error("data_plane_stopped", engine_ready=self.parts.host.ready)
            return 1
        log.critical("exiting", reason="restart_budget_spent", exit_status=EXIT_ENGINE_UNRECOVERABLE)
        return EXIT_ENGINE_UNRECOVERABLE

    # -- shutdown -----------------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Drain with a deadline, then stop the engine and the control plane. Each step runs even
        when one before it failed (logged), so nothing is left open."""
        p = self.parts
        p.draining = True
        p.notifier.stopping()
        p.gate.stop_admitting()
        if p.scheduler.running:
            p.scheduler.shutdown(wait=False)
        steps = (
            p.tasks.cancel_all,
            self._drain_data_plane,
            self._close_gate,
            self._stop_engine,
            self._stop_admin,
        )
        for step in steps:
            try:
                await step()
            except Exception as exc:
                log.error("shutdown_step_failed", step=step.__name__, error=f"{type(exc).__name__}: {exc}")
        p.notifier.close()
        log.info("stopped")

    async def _drain_data_plane(self) -> None:
        """Stop listening; in-flight and queued requests finish up to ``shutdown_timeout_s``. Those
        left then end with an answer, never a dropped connection: queued ones get 503, running
        ones a retryable 503 (an error event in a stream), before uvicorn's own deadline
        (``END_GRACE_S`` later) would cut their connections."""
        p = self.parts
        if p.server is None or self._server_task is None:
            return
        p.server.should_exit = True  # uvicorn stops listening and waits for in-flight requests
        force = asyncio.create_task(self._force_on_second_signal())
        try:
            server_done = asyncio.shield(self._server_task)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server_done, self.config.server.shutdown_timeout_s)
            if not self._server_task.done():
                p.gate.close()  # queued: 503 now
                aborted = await p.host.abort_in_flight("the server is shutting down")
                log.warning("shutdown_deadline_passed", aborted=aborted, queued_refused=True)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._server_task), END_GRACE_S)
        finally:
            force.cancel()

    async def _close_gate(self) -> None:
        self.parts.gate.close()

    async def _stop_engine(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.parts.host.stop)

    async def _stop_admin(self) -> None:
        if self._admin is not None:
            await self._admin.cleanup()
        if self._data_socket is not None:  # uvicorn closes its own copy; a failed startup leaves ours
            self._data_socket.close()


def _listen_error(table: str, host: str, port: int, exc: OSError) -> str:
    return (
        f"cannot listen on {host}:{port} ({exc.strerror or exc}): another process holds the port or the "
        f"address is not this host's; stop it or set {table} host/port"
    )


async def serve(config: Config) -> int:
    daemon = Daemon(config)
    code = 1
    try:
        await daemon.startup()
        code = await daemon.run()
    finally:
        await daemon.shutdown()
    return code

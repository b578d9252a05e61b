"""The daemon: startup, run, shutdown (STYLE.md practice 9).

Signal handlers only record the signal; the loop acts on it. SIGHUP reloads the config. SIGTERM/SIGINT
drain: the data plane stops listening and refuses new requests, in-flight and queued ones finish up to
``[server] shutdown_timeout_s``, then the engine shuts down and the process exits 0. A second signal
forces the exit. systemd hears READY=1 once the engine serves, RELOADING=1/READY=1 around a reload,
STOPPING=1 on drain, and WATCHDOG=1 from this event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from typing import Any

import structlog
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from prometheus_client import CollectorRegistry

from controller.admin import status
from controller.admin.metrics import GateMetrics, Metrics
from controller.admission.gate import AdmissionGate
from controller.config.diff import ConfigDiff, diff_config, engine_overrides, merge_live
from controller.config.load import Config, ConfigError, load_config
from controller.control.diagnosis import Diagnoser, Diagnosis
from controller.control.loop import Change, ControlLoop
from controller.control.normalize import Normalizer
from controller.control.observe import build_observation
from controller.control.samplers import GpuSource, HostReadingSource, HostSource, NvmlSource
from controller.control.telemetry import TelemetryWindow
from controller.lifecycle.guard import Guard
from controller.lifecycle.notify import Notifier, start_watchdog
from policies.base import Observation, Policy, build_policy

log = structlog.get_logger(__name__)


def make_policy(config: Config) -> Policy:
    return build_policy(
        config.control.policy,
        config.control.params,
        max_num_seqs=config.max_num_seqs,
        initial_limit=config.admission.limit,
    )


def make_normalizer(config: Config) -> Normalizer:
    c = config.control
    return Normalizer(
        limit_max=c.limit_max,
        tolerance=c.tolerance,
        max_step_up=c.max_step_up,
        max_step_down=c.max_step_down,
        stabilization_s=c.stabilization_s,
    )


class Daemon:
    def __init__(
        self,
        config: Config,
        install_signals: bool = True,
        gpu_source: GpuSource | None = None,
        host_source: HostReadingSource | None = None,
    ) -> None:
        from controller.engine.runtime.args import serve_namespace
        from controller.engine.runtime.host import EngineHost

        self.config = config
        self._install_signals = install_signals
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.window = TelemetryWindow(config.control.window_seconds)
        self.gate = AdmissionGate(
            config.admission.limit,
            config.admission.max_queue,
            config.admission.classes,
            config.admission.aging_s,
            events=GateMetrics(self.metrics),
        )
        self.args = serve_namespace(
            config.engine, {"host": config.server.host, "port": config.server.port, **config.server.vllm}
        )
        self.host = EngineHost(self.args, self.window, config.server.engine_poll_sleep_s)
        self.guard = Guard(config.guard, self.gate, self.host, self._on_restart)
        self.gpu_source: GpuSource = gpu_source or NvmlSource()
        self.host_source: HostReadingSource = host_source or HostSource()
        self.diagnoser = Diagnoser()
        self.diagnosis: Diagnosis | None = None
        self.loop = ControlLoop(
            make_policy(config),
            make_normalizer(config),
            self.observe,
            self,
            self._on_change,
            config.control.history,
        )
        self.notifier = Notifier()
        self.pending_changes: dict[str, list[str]] = {}
        self.draining = False
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._hup = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[Any]] = []
        self._server: Any = None
        self._server_task: asyncio.Task[None] | None = None
        self._admin: Any = None
        self._scheduler: AsyncIOScheduler | None = None

    # -- reload -------------------------------------------------------------------------------------
    async def reload(self) -> dict[str, Any]:
        """Re-read the config file; apply what can change live. On any error the old config stays."""
        async with self._reload_lock:
            self.notifier.reloading()
            try:
                return await self._reload()
            finally:
                self.notifier.ready()

    async def _reload(self) -> dict[str, Any]:
        try:
            new = load_config(self.config.path)
        except ConfigError as exc:
            self.metrics.config_reloads.labels("error").inc()
            log.error("reload_rejected", path=str(self.config.path), errors=exc.errors)
            return {"ok": False, "errors": exc.errors}
        diff = diff_config(self.config, new)
        self._apply_live(new, diff)
        self.pending_changes = diff.pending
        restart = self._maybe_restart_for(new, diff)
        result = "pending_engine_restart" if diff.pending else "ok"
        self.metrics.config_reloads.labels(result).inc()
        log.info("reloaded", live=diff.live, pending=diff.pending, engine_restart=restart)
        await self.loop.tick()  # the new policy acts now, not at the next tick
        return {"ok": True, "changed": diff.live, "pending": diff.pending, "engine_restart": restart}

    def _maybe_restart_for(self, new: Config, diff: ConfigDiff) -> dict[str, Any] | None:
        """With ``restart_on_reload``, [engine] changes go through the guard's drain-and-restart."""
        overrides = engine_overrides(self.config, new, diff) if new.restart_on_reload else None
        if overrides is None or self.guard.restarting:
            return None

        async def restart() -> None:
            await self.guard.restart("config_reload", overrides, drain=True)
            self.config = dataclasses.replace(self.config, engine={**self.config.engine, **overrides})
            self.pending_changes = {t: k for t, k in self.pending_changes.items() if t != "engine"}

        self._tasks.append(asyncio.create_task(restart()))
        return overrides

    def _apply_live(self, new: Config, diff: ConfigDiff) -> None:
        old = self.config
        self.config = merge_live(old, new)
        a = new.admission
        self.gate.configure(a.classes, a.aging_s, a.max_queue)
        if new.admission.limit != old.admission.limit:
            self.gate.set_limit(new.admission.limit)
        self.window.window_s = new.control.window_seconds
        if "control" in diff.live or new.admission.limit != old.admission.limit:
            self.loop.policy = make_policy(self.config)
            self.loop.normalizer = make_normalizer(self.config)
        self.loop.resize_history(new.control.history)
        self.guard.s = self.guard.memory.s = new.guard
        if self._scheduler is not None and new.control.tick_seconds != old.control.tick_seconds:
            tick = new.control.tick_seconds
            self._scheduler.reschedule_job("control_tick", trigger="interval", seconds=tick)

    async def _reload_on_hup(self) -> None:
        while True:
            await self._hup.wait()
            self._hup.clear()
            await self.reload()

    # -- actuator (the loop's apply stage calls these) ----------------------------------------------
    def set_admission_limit(self, limit: int) -> None:
        self.gate.set_limit(limit)

    async def set_batch_cap(self, cap: int) -> int:
        return await self.host.set_batch_cap(cap)

    def _on_change(self, change: Change) -> None:
        self.metrics.decisions.labels(change.knob, change.reason).inc()

    def _on_restart(self, reason: str, duration_s: float) -> None:
        self.metrics.engine_restarts.labels(reason).inc()
        self.metrics.restart_duration.observe(duration_s)

    @property
    def data_plane_up(self) -> bool:
        """The OpenAI API listens (healthy only then: a load balancer may send traffic at once)."""
        return self._server is not None and bool(self._server.started) and not self._server.should_exit

    # -- observation ----------------------------------------------------------------------------
    def observe(self) -> Observation:
        """One tick's observation; the memory guard sees it too."""
        obs = build_observation(
            self.window.snapshot(),
            self.gate,
            self.host.batch_cap,
            self.host.max_num_seqs,
            self.gpu_source.read(),
            self.host_source.read(),
        )
        self.diagnosis = self.diagnoser.observe(obs)
        task = self.guard.on_observation(obs)
        if task is not None:
            self._tasks.append(task)
        return obs

    # -- lifecycle ----------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signals.put_nowait, sig)
        loop.add_signal_handler(signal.SIGHUP, self._hup.set)

    async def _start_admin(self) -> None:
        from controller.admin.server import make_admin_app, start_admin

        app = make_admin_app(
            self.registry,
            lambda: status.refresh_metrics(self),
            lambda: status.state(self),
            lambda: status.health(self),
            self.reload,
            self.config.admin.token,
        )
        self._admin = await start_admin(app, self.config.admin.host, self.config.admin.port)
        log.info("control_plane_listening", host=self.config.admin.host, port=self.config.admin.port)

    async def _start_data_plane(self) -> None:
        from controller.engine.frontend.app import build_data_plane, make_server, refresh_app_state
        from controller.engine.frontend.client import GovernedEngineClient

        client = GovernedEngineClient(self.host, self.gate, self.guard.notice_dead)
        app = await build_data_plane(client, self.args)
        self.host.on_new_engine = lambda: refresh_app_state(app, client, self.host.args)
        self._server = make_server(app, self.args, self.config.server.shutdown_timeout_s, self.gate)
        self._server_task = asyncio.create_task(self._server.serve())
        while not self._server.started and not self._server_task.done():
            await asyncio.sleep(0.05)

    def _start_background(self) -> None:
        self._scheduler = AsyncIOScheduler()
        self._scheduler.add_job(
            self.loop.tick, "interval", seconds=self.config.control.tick_seconds,
            max_instances=1, coalesce=True, misfire_grace_time=None, id="control_tick",
        )  # fmt: skip
        self._scheduler.start()
        self._tasks.append(asyncio.create_task(self._reload_on_hup()))
        self._tasks.append(asyncio.create_task(self.guard.watch()))
        watchdog = start_watchdog(self.notifier)
        if watchdog is not None:
            self._tasks.append(watchdog)

    async def startup(self) -> None:
        if self._install_signals:
            self._install_signal_handlers()
        await self._start_admin()
        self.notifier.status("starting the engine")
        await self.host.start()
        await self.loop.tick()  # the policy's initial values apply before the first request
        await self._start_data_plane()
        self._start_background()
        self.notifier.ready(f"serving on {self.config.server.host}:{self.config.server.port}")
        log.info("serving", host=self.config.server.host, port=self.config.server.port)

    async def run(self) -> int:
        """Serve until a signal asks for a drain (exit 0) or the data plane dies (exit 1)."""
        assert self._server_task is not None
        sig_wait = asyncio.create_task(self._signals.get())
        done, _ = await asyncio.wait({sig_wait, self._server_task}, return_when=asyncio.FIRST_COMPLETED)
        if sig_wait in done:
            log.info("drain_requested", signal=signal.Signals(sig_wait.result()).name)
            return 0
        sig_wait.cancel()
        log.error("data_plane_stopped", engine_ready=self.host.ready)
        return 1

    async def shutdown(self) -> None:
        """Drain with a deadline, then stop the engine and the control plane."""
        self.draining = True
        self.notifier.stopping()
        self.gate.stop_admitting()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None and self._server_task is not None:
            self._server.should_exit = True  # stop listening; uvicorn waits for in-flight requests
            force = asyncio.create_task(self._force_on_second_signal())
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.shield(self._server_task), self.config.server.shutdown_timeout_s + 5
                )
            force.cancel()
        self.gate.close()
        await asyncio.get_running_loop().run_in_executor(None, self.host.stop)
        if self._admin is not None:
            await self._admin.cleanup()
        self.notifier.close()
        log.info("stopped")

    async def _force_on_second_signal(self) -> None:
        await self._signals.get()
        log.warning("forced_exit")
        self._server.force_exit = True


async def serve(config: Config) -> int:
    daemon = Daemon(config)
    code = 1
    try:
        await daemon.startup()
        code = await daemon.run()
    finally:
        await daemon.shutdown()
    return code

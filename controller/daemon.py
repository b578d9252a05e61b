"""The daemon: startup, run, shutdown (STYLE.md practice 9).

Signal handlers only record the signal; ``run`` acts on it. SIGTERM/SIGINT drain: the data plane
stops listening and refuses new requests, in-flight and queued ones finish up to
``[server] shutdown_timeout_s``, then the engine shuts down and the process exits 0. A second signal
forces the exit.
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

from controller.config import Config, ConfigError, describe, load_config
from controller.diagnosis import Diagnoser, Diagnosis
from controller.gate import AdmissionGate
from controller.loop import Change, ControlLoop
from controller.metrics import Metrics
from controller.reload import ConfigDiff, diff_config, merge_live
from controller.samplers import GpuSource, HostSource, NvmlSource
from controller.telemetry import TelemetryWindow
from policies.base import Observation, Policy, build_policy

log = structlog.get_logger(__name__)


def priority_class(priority: int) -> str:
    return "interactive" if priority <= 0 else "batch"


class Daemon:
    def __init__(
        self, config: Config, install_signals: bool = True, gpu_source: GpuSource | None = None
    ) -> None:
        from controller.engine.args import serve_namespace
        from controller.engine.host import EngineHost

        self.config = config
        self._install_signals = install_signals
        self.registry = CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.window = TelemetryWindow(config.control.window_seconds)
        self.gate = AdmissionGate(
            config.admission.limit,
            config.admission.max_queue,
            on_reject=lambda reason: self.metrics.rejected.labels(reason, "unknown").inc(),
        )
        self.args = serve_namespace(
            config.engine, {"host": config.server.host, "port": config.server.port, **config.server.vllm}
        )
        self.host = EngineHost(self.args, self.window)
        self.gpu_source: GpuSource = gpu_source or NvmlSource()
        self.host_source = HostSource()
        self.diagnoser = Diagnoser()
        self.diagnosis: Diagnosis | None = None
        self.policy = self._build_policy(config)
        self.loop = ControlLoop(self.policy, self.observe, self, self._on_change, config.control.history)
        self.pending_changes: dict[str, list[str]] = {}
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._hup = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._draining = False
        self._server: Any = None
        self._server_task: asyncio.Task[None] | None = None
        self._admin: Any = None
        self._scheduler: AsyncIOScheduler | None = None

    @staticmethod
    def _build_policy(config: Config) -> Policy:
        return build_policy(
            config.control.policy,
            config.control.params,
            max_num_seqs=config.max_num_seqs,
            initial_limit=config.admission.limit,
        )

    # -- reload -------------------------------------------------------------------------------------
    async def reload(self) -> dict[str, Any]:
        """Re-read the config file; apply what can change live. On any error the old config stays."""
        async with self._reload_lock:
            try:
                new = load_config(self.config.path)
            except ConfigError as exc:
                self.metrics.config_reloads.labels("error").inc()
                log.error("reload_rejected", path=str(self.config.path), errors=exc.errors)
                return {"ok": False, "errors": exc.errors}
            diff = diff_config(self.config, new)
            self._apply_live(new, diff)
            self.pending_changes = diff.pending
            result = "pending_engine_restart" if diff.pending else "ok"
            self.metrics.config_reloads.labels(result).inc()
            log.info("reloaded", live=diff.live, pending=diff.pending)
            await self.loop.tick()  # the new policy acts now, not at the next tick
            return {"ok": True, "changed": diff.live, "pending": diff.pending}

    def _apply_live(self, new: Config, diff: ConfigDiff) -> None:
        old = self.config
        self.config = merge_live(old, new)
        self.gate.max_queue = new.admission.max_queue
        if new.admission.limit != old.admission.limit:
            self.gate.set_limit(new.admission.limit)
        self.window.window_s = new.control.window_seconds
        if "control" in diff.live or new.admission.limit != old.admission.limit:
            self.policy = self.loop.policy = self._build_policy(self.config)
        self.loop.resize_history(new.control.history)
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

    # -- observation, state, health -----------------------------------------------------------------
    def queued_by_class(self) -> dict[str, int]:
        depth = {"interactive": 0, "batch": 0}
        for p in self.gate.queued_priorities():
            depth[priority_class(p)] += 1
        return depth

    def observe(self) -> Observation:
        eng = self.window.snapshot()
        g = self.gate.stats()
        gpu = self.gpu_source.read()
        hostr = self.host_source.read()
        obs = Observation(
            now_mono=eng.now_mono,
            admission_limit=g.limit,
            batch_cap=self.host.batch_cap,
            max_num_seqs=self.host.max_num_seqs,
            in_flight=g.in_flight,
            queued=g.queued,
            running=eng.running,
            waiting=eng.waiting,
            kv_usage=eng.kv_usage,
            kv_usage_mean=eng.kv_usage_mean,
            kv_usage_max=eng.kv_usage_max,
            preemptions_per_s=eng.preemptions_per_s,
            generated_tokens_per_s=eng.generated_tokens_per_s,
            ttft_p99_s=eng.ttft_p99_s,
            itl_p99_s=eng.itl_p99_s,
            stats_age_s=eng.last_step_age_s,
            ttft_p50_s=eng.ttft_p50_s,
            itl_p50_s=eng.itl_p50_s,
            finished_per_s=eng.finished_per_s,
            queued_by_class=self.queued_by_class(),
            gpu_memory_used_bytes=gpu.used_bytes if gpu else None,
            gpu_memory_total_bytes=gpu.total_bytes if gpu else None,
            gpu_memory_free_bytes=gpu.free_bytes if gpu else None,
            gpu_utilization=gpu.utilization if gpu else None,
            host_memory_available_bytes=hostr.memory_available_bytes,
            daemon_cpu_percent=hostr.daemon_cpu_percent,
        )
        self.diagnosis = self.diagnoser.observe(obs)
        return obs

    def health(self) -> tuple[bool, str]:
        if self._draining:
            return False, "draining"
        if not self.host.ready:
            return False, "engine_not_ready" if self.host.generation == 0 else "engine_dead"
        return True, "serving"

    def refresh_metrics(self) -> None:
        m, g = self.metrics, self.gate.stats()
        m.admission_limit.set(g.limit)
        m.batch_cap.set(self.host.batch_cap)
        m.max_num_seqs.set(self.host.max_num_seqs)
        m.in_flight.set(g.in_flight)
        for cls, n in self.queued_by_class().items():
            m.queue_depth.labels(cls).set(n)
        m.engine_generation.set(self.host.generation)
        m.engine_up.set(1 if self.host.ready else 0)
        for term, value in self.policy.terms().items():
            m.policy_term.labels(self.policy.name, term).set(value)

    def state(self) -> dict[str, Any]:
        g = self.gate.stats()
        eng = self.window.snapshot()
        ok, reason = self.health()
        return {
            "healthy": ok,
            "health_reason": reason,
            "admission_limit": g.limit,
            "batch_cap": self.host.batch_cap,
            "policy": {
                "name": self.config.control.policy,
                "params": self.policy.params(),
                "terms": self.policy.terms(),
                "last_reason": self.loop.last_reason,
            },
            "engine": self.host.settings(),
            "gate": {
                "in_flight": g.in_flight,
                "queue_depth": g.queued,
                "pending": g.pending,
                "admitted_total": g.admitted_total,
                "rejected_total": g.rejected_total,
                "completed_total": g.completed_total,
            },
            "engine_stats": eng.__dict__,
            "decisions": self.loop.recent(),
            "diagnosis": dataclasses.asdict(self.diagnosis) if self.diagnosis else None,
            "config": describe(self.config),
            "pending_config_changes": self.pending_changes,
        }

    # -- lifecycle ----------------------------------------------------------------------------------
    async def startup(self) -> None:
        from controller.admin import make_admin_app, start_admin
        from controller.engine.app import build_data_plane, make_server
        from controller.engine.client import GovernedEngineClient

        if self._install_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._signals.put_nowait, sig)
            loop.add_signal_handler(signal.SIGHUP, self._hup.set)
        admin_app = make_admin_app(
            self.registry, self.refresh_metrics, self.state, self.health, self.reload, self.config.admin.token
        )
        self._admin = await start_admin(admin_app, self.config.admin.host, self.config.admin.port)
        log.info("control_plane_listening", host=self.config.admin.host, port=self.config.admin.port)
        await self.host.start()
        await self.loop.tick()  # the policy's initial values apply before the first request
        client = GovernedEngineClient(self.host, self.gate)
        app = await build_data_plane(client, self.args)
        self._server = make_server(
            app, self.args, self.config.server.shutdown_timeout_s, self.gate.retry_after_s
        )
        self._server_task = asyncio.create_task(self._server.serve())
        while not self._server.started and not self._server_task.done():
            await asyncio.sleep(0.05)
        self._scheduler = AsyncIOScheduler()
        self._scheduler.add_job(
            self.loop.tick,
            "interval",
            seconds=self.config.control.tick_seconds,
            max_instances=1,
            coalesce=True,
            misfire_grace_time=None,
            id="control_tick",
        )
        self._scheduler.start()
        self._tasks.append(asyncio.create_task(self._reload_on_hup()))
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
        self._draining = True
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

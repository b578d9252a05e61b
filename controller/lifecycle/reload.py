"""Reload (SIGHUP or POST /reload): parse and validate the whole new file, then swap in at once
what can change live (``controller/config/diff.py`` says which tables). On any error the old config
stays, and the error is logged and counted. systemd hears RELOADING=1 / READY=1 around it."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import structlog

from controller.config.diff import ConfigDiff, diff_config, engine_overrides, merge_live
from controller.config.load import Config, ConfigError, load_config
from controller.control.build import normalizer_for, policy_for
from controller.lifecycle.parts import TICK_JOB, Parts

log = structlog.get_logger(__name__)


class Reloader:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self._lock = asyncio.Lock()

    async def reload(self) -> dict[str, Any]:
        """Re-read the config file; apply what can change live. On any error the old config stays."""
        async with self._lock:
            self.parts.notifier.reloading()
            try:
                return await self._reload()
            finally:
                self.parts.notifier.ready()

    async def _reload(self) -> dict[str, Any]:
        p = self.parts
        try:
            new = load_config(p.config.path)
        except ConfigError as exc:
            p.metrics.config_reloads.labels("error").inc()
            log.error("reload_rejected", path=str(p.config.path), errors=exc.errors)
            return {"ok": False, "errors": exc.errors}
        diff = diff_config(p.config, new)
        self._apply_live(new, diff)
        p.pending_changes = diff.pending
        restart = self._maybe_restart_for(new, diff)
        result = "pending_engine_restart" if diff.pending else "ok"
        p.metrics.config_reloads.labels(result).inc()
        log.info("reloaded", live=diff.live, pending=diff.pending, engine_restart=restart)
        await p.loop.tick()  # the new policy acts now, not at the next tick
        return {"ok": True, "changed": diff.live, "pending": diff.pending, "engine_restart": restart}

    def _maybe_restart_for(self, new: Config, diff: ConfigDiff) -> dict[str, Any] | None:
        """With ``restart_on_reload``, [engine] changes go through the guard's drain-and-restart."""
        p = self.parts
        overrides = engine_overrides(p.config, new, diff) if new.restart_on_reload else None
        if overrides is None or p.guard.restarting:
            return None

        async def restart() -> None:
            await p.guard.restart("config_reload", overrides, drain=True)
            p.config = dataclasses.replace(p.config, engine={**p.config.engine, **overrides})
            p.pending_changes = {t: k for t, k in p.pending_changes.items() if t != "engine"}

        p.tasks.spawn(restart())
        return overrides

    def _apply_live(self, new: Config, diff: ConfigDiff) -> None:
        p, old = self.parts, self.parts.config
        p.config = merge_live(old, new)
        a = new.admission
        p.gate.configure(a.classes, a.aging_s, a.max_queue)
        limit_moved = a.limit != old.admission.limit
        if limit_moved:
            p.actuator.set_admission_limit(a.limit)
        p.window.window_s = new.control.window_seconds
        if "control" in diff.live or limit_moved:
            p.loop.policy = policy_for(p.config)
            p.loop.normalizer = normalizer_for(p.config.control)
        p.loop.resize_history(new.control.history)
        p.guard.configure(new.guard)
        tick = new.control.tick_seconds
        if tick != old.control.tick_seconds and p.scheduler.get_job(TICK_JOB) is not None:
            p.scheduler.reschedule_job(TICK_JOB, trigger="interval", seconds=tick)

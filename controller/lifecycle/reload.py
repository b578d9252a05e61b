"""Reload (SIGHUP or POST /reload): parse and validate the whole new file, then swap in at once
what can change live (``controller/config/diff.py`` says which tables). On any error the old config
stays, and the error is logged, counted (``result="error"``) and answered: a file that is not UTF-8
or a plug-in that raises on import is an error of that reload, not of the daemon. systemd hears
RELOADING=1 / READY=1 around it.

Reloads run one at a time, in the order they came. While the daemon starts (its first engine
builds) or drains, a reload is refused with a reason (``unavailable``; /reload answers 503): a
restart then would race the first build or outlive the shutdown.

An engine change (with ``restart_on_reload``) goes through the guard's drain-and-restart in the
background, one restart task for all reloads: it brings the engine to the newest reloaded file's
[engine], so two quick reloads end on the second's values, and never runs twice at once. One that
arrives while a restart or a recovery runs is answered ``deferred`` and applied after it (the guard
runs one at a time). The config in force follows the engine only when the new engine built (the
guard reports it, ``Parts.adopt_engine``): a bad value leaves both as they were.

[engine] is compared with the file values the engine runs (``Parts.file_engine``: the first file's, then
each reloaded file's whose [engine] an engine built), never with the config in force: that holds the
memory guard's shrink, and a reload of a file that did not touch the key would restart the engine at
the value that was at risk. An operator raises the setting by changing it in the file."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import structlog

from controller.config.cli_layer import load_layered
from controller.config.diff import ConfigDiff, diff_config, engine_overrides, merge_live
from controller.config.load import Config, ConfigError
from controller.config.secrets import redact
from controller.control.build import CoreSettings
from controller.lifecycle.parts import TICK_JOB, Parts

log = structlog.get_logger(__name__)


class Reloader:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self._lock = asyncio.Lock()
        self._wanted: Config | None = None
        """The newest reloaded file: the engine restart task brings the engine to its [engine]."""
        self._restarter: asyncio.Task[None] | None = None

    def _diff(self, new: Config) -> ConfigDiff:
        return diff_config(self.parts.config, new, engine_from=self.parts.file_engine)

    async def reload(self) -> dict[str, Any]:
        """Re-read the config file; apply what can change live. On any error the old config stays."""
        async with self._lock:
            unavailable = self._unavailable()
            if unavailable is not None:
                return unavailable
            self.parts.notifier.reloading()
            try:
                return await self._reload()
            except Exception as exc:  # an error past validation: answered and counted, never raised
                return self._rejected([f"reload failed: {type(exc).__name__}: {exc}"])
            finally:
                self.parts.notifier.ready()

    def _unavailable(self) -> dict[str, Any] | None:
        """The answer to a reload while the daemon starts or drains, else None."""
        p = self.parts
        if p.draining:
            reason, why = "draining", "the daemon is shutting down; the next start reads the file"
        elif p.starting:
            reason, why = (
                "starting",
                "the daemon is starting (its first engine builds); retry when /healthz is ok",
            )
        else:
            return None
        log.warning("reload_refused", reason=reason, path=str(p.config.path))
        return {"ok": False, "unavailable": reason, "errors": [f"reload refused: {why}"]}

    def _rejected(self, errors: list[str]) -> dict[str, Any]:
        self.parts.metrics.config_reloads.labels("error").inc()
        log.error("reload_rejected", path=str(self.parts.config.path), errors=errors)
        return {"ok": False, "errors": errors}

    async def _reload(self) -> dict[str, Any]:
        p = self.parts
        try:
            new = load_layered(p.config.path, p.config.overlay)  # the command line stays on top
            diff = self._diff(new)
            change = self._plan(new)  # everything that can fail, before anything changes
        except ConfigError as exc:
            return self._rejected(exc.errors)
        except Exception as exc:  # not UTF-8, a plug-in raising on import, ...: the old config stays
            return self._rejected([f"{p.config.path}: {type(exc).__name__}: {exc}"])
        self._apply_live(change)
        p.pending_changes = diff.pending
        restart, deferred = self._maybe_restart_for(new, diff)
        result = "pending_engine_restart" if diff.pending else "ok"
        p.metrics.config_reloads.labels(result).inc()
        log.info("reloaded", live=diff.live, pending=diff.pending, engine_restart=restart, deferred=deferred)
        try:
            await p.loop.tick()  # the new policy acts now, not at the next tick
        except Exception as exc:  # the new config is in force; the scheduled ticks go on
            log.error("reload_tick_failed", error=f"{type(exc).__name__}: {exc}")
        return {
            "ok": True,
            "changed": diff.live,
            "pending": diff.pending,
            "engine_restart": restart,
            "deferred": deferred,
        }

    def _plan(self, new: Config) -> LiveChange:
        """What the reload swaps in, every part of it built (a policy that raises, a cost profile
        gone since validation): applying it then only assigns."""
        old = self.parts.config
        merged = merge_live(old, new)
        tick = new.control.tick_s
        return LiveChange(
            config=merged,
            core=self.parts.core.prepare(merged),
            tick_s=tick if tick != old.control.tick_s else None,
        )

    def _maybe_restart_for(self, new: Config, diff: ConfigDiff) -> tuple[dict[str, Any] | None, bool]:
        """With ``restart_on_reload``, [engine] changes go through the guard's drain-and-restart;
        ``deferred`` when a restart or recovery runs now (this one follows it). The overrides are
        answered and logged redacted (a changed hf_token is not shown)."""
        p = self.parts
        queued = self._restarter is not None and not self._restarter.done()
        if queued:
            self._wanted = new  # the queued task ends on this file's [engine], whatever it brings
        overrides = engine_overrides(p.config, new, diff) if new.restart_on_reload else None
        if overrides is None:
            return None, queued
        deferred = p.guard.restarting
        if deferred:
            log.info("reload_restart_deferred", **redact(overrides))
        if not queued:
            self._wanted = new
            self._restarter = p.tasks.spawn(self._restart_engine())
        return redact(overrides), deferred or queued

    async def _restart_engine(self) -> None:
        """Restart the engine on the newest reloaded [engine] until it runs it (a reload during a
        restart asks for one more), or until a restart fails (the engine and the config in force
        stay as they were)."""
        p = self.parts
        while (wanted := self._wanted) is not None and wanted.restart_on_reload:
            overrides = engine_overrides(p.config, wanted, self._diff(wanted))
            if not overrides:
                break
            try:
                await p.guard.restart("config_reload", overrides, drain=True)
            except Exception as exc:
                log.error("reload_restart_failed", error=f"{type(exc).__name__}: {exc}", **redact(overrides))
                if self._wanted is wanted:
                    return
                continue  # a newer file came meanwhile: try its values
            p.file_engine = dict(wanted.engine)  # the engine runs this file's [engine] now
            p.pending_changes = self._diff(wanted).pending
            if self._wanted is wanted:
                break

    def _apply_live(self, change: LiveChange) -> None:
        """Swap ``change`` in: assignments and the parts' own setters, nothing left to build. The
        core's live tables go through its one door (``ControlCore.apply``, as at the first build);
        [guard] and the tick's interval are the daemon's own."""
        p, new = self.parts, change.config
        p.config = new
        p.core.apply(change.core)
        p.guard.configure(new.guard)
        if change.tick_s is not None and p.scheduler.get_job(TICK_JOB) is not None:
            p.scheduler.reschedule_job(TICK_JOB, trigger="interval", seconds=change.tick_s)


@dataclass(frozen=True)
class LiveChange:
    """A reload's live tables, built and ready to assign."""

    config: Config
    """The config in force after it: the new live tables, the current restart-only ones."""
    core: CoreSettings
    """The control core's live settings, built from ``config`` (``ControlCore.prepare``)."""
    tick_s: float | None
    """The loop's new interval, when it changed."""

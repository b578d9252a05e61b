"""The memory guard and crash recovery: the only code that restarts the engine.

``gpu_memory_utilization`` (on the CPU, ``kv_cache_memory_bytes``) is the one knob that needs a new
engine, so it moves only on out-of-memory risk and only downward; an operator raises it by reload.

* Memory risk (``memory.py``: ``MemoryWatch``, pure): on a GPU, NVML free memory below
  ``gpu_free_margin_bytes`` or ``gpu_free_margin_fraction`` of the total (at most half of what vLLM
  leaves free at the ``gpu_memory_utilization`` in force) for ``consecutive_samples`` samples; on
  the CPU, host available memory below ``host_available_margin_bytes``. The new setting subtracts
  the measured deficit, at least ``memory_step_fraction``, never below the floor.
* Crash recovery (``Guard.watch``): an engine that dies is rebuilt with exponential backoff, at most
  ``max_restarts_per_hour`` times an hour. Only crashes spend that budget: an operator's reload or a
  memory restart is chosen, not a failure, and must not bring the next crash nearer to a permanent 503.
  A death of memory is a memory restart, not a rebuild at the same setting: the kernel's OOM killer
  (the ``oom_kill`` counter of the service's own cgroup moved, ``oom_killed``), or on a GPU a CUDA
  out-of-memory error (``cuda_oom``: the engine's own word at its death,
  ``EngineControl.died_out_of_memory``, or where it left none, the last GPU reading before the death
  below the margin). Its smaller setting comes from ``MemoryRestarts.plan`` (the floor held), its
  build's outcome sets the cooldown or the back-off as a memory restart's does; it still spends the
  crash budget, as any death does. With the budget spent the guard gives up (``given_up``):
  requests get 503 with Retry-After and the daemon exits non-zero, so that its supervisor's own
  limits apply (systemd's ``Restart=on-failure`` and start limit, a pod's restart back-off), where a
  daemon that stayed up would answer 503 for good with nothing to restart it.
* A memory restart whose smaller setting fails to build (vLLM refuses a KV cache that cannot hold
  one ``max_model_len`` sequence; a GPU build that runs out) is not retried at each confirmed risk:
  ``MemoryRestarts`` (``memory.py``) holds the decision, the cooldown, the floor and the back-off
  in one place, for ``kv_cache_memory_bytes`` and ``gpu_memory_utilization`` alike. The failed
  value becomes the floor (no later shrink goes to it or below), and memory readings are ignored
  for ``cooldown_s`` after any restart, doubled at each failure in a row up to an hour. On a GPU a
  value that failed with no engine left and less free memory than it asks (vLLM's start check: a
  co-tenant took what the old engine freed) was too large, not too small: no floor, the same
  back-off, and recovery builds at what the free memory holds (``MemoryRestarts.too_large``), where
  the settings that built last would fail the same check until the crash budget was spent.
* Liveness (``liveness.py``): an engine with requests inside and no step for ``stall_timeout_s`` is
  recovered like a crash. While no engine can serve, new requests get 503 with Retry-After (queued
  ones keep their place, for at most ``max_restart_wait_s`` beyond their queue deadline).
* Restart = drain + swap: the gate pauses (new requests wait, none refused), in-flight requests finish
  up to ``drain_timeout_s`` and the rest are aborted with a clear error, the engine is rebuilt, the gate
  resumes. A build that fails leaves an engine serving where it can (``EngineControl.restart``): the
  gate then resumes on it; where no engine is left the gate stays paused and recovery starts, so no
  request enters a dead engine. One restart or one recovery at a time: the lock is held through
  recovery's back-off sleep too, and a restart asked for meanwhile waits its turn.
* After a restart the new settings are reported (``on_engine_args``), so the config in force says
  what the engine runs; a reload compares [engine] with the file, not with this (``reload.py``), so
  only a file that changes the key moves it back.
  No vLLM import here: the engine is reached through ``EngineControl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import structlog

from controller.admission.gate import AdmissionGate, GateRejected
from controller.clock import Clock, monotonic
from controller.config.secrets import redact
from controller.lifecycle.liveness import StallWatch, no_engine
from controller.lifecycle.memory import (
    VLLM_GPU_MEMORY_UTILIZATION,
    GuardSettings,
    MemoryRestarts,
    MemoryWatch,
    fitting_utilization,
    sizing_utilization,
)
from policies.base import Observation

log = structlog.get_logger(__name__)

PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")

MEMORY_REASONS = frozenset({"gpu_memory_low", "host_memory_low", "oom_killed", "cuda_oom"})
"""Restarts that free memory: the old engine must go before the new one is built (two may not fit)."""


class EngineControl(Protocol):
    @property
    def dead(self) -> bool: ...

    @property
    def memory_knob(self) -> str:
        """ "kv_cache_memory_bytes" when the config sets it (it wins in vLLM), else
        "gpu_memory_utilization"."""

    def memory_settings(self) -> dict[str, Any]: ...

    async def restart(self, overrides: dict[str, Any], build_first: bool = False) -> None:
        """Start an engine with ``overrides`` on top of the settings in force and swap it in.

        ``build_first`` asks to build the new engine before the old one stops (where two fit). If the
        new settings fail, an engine on the old settings serves again where it can and the error is
        raised; the settings in force change only with a build that succeeded."""

    async def abort_in_flight(self, reason: str) -> int:
        """Abort every request still running in the engine; returns how many."""

    def mark_failed(self, reason: str) -> None:
        """Count the engine as dead (it hangs): recovery retires it, then builds a new one."""

    @property
    def died_out_of_memory(self) -> bool:
        """The dead engine said at its death that it ran out of GPU memory (never on a CPU)."""


def own_memory_events(proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT) -> Path | None:
    """This process's cgroup v2 ``memory.events`` (the service's own: the root cgroup has none), from
    the ``0::/path`` line of ``/proc/self/cgroup``; None on cgroup v1 or where it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            return root / path.lstrip("/") / "memory.events"
    return None


def read_oom_kills(proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """The ``oom_kill`` counter of this service's cgroup (cgroup v2; it counts the EngineCore child
    too), or None where it cannot be read."""
    events = own_memory_events(proc_cgroup, root)
    if events is None:
        return None
    try:
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


class Guard:
    def __init__(
        self,
        settings: GuardSettings,
        gate: AdmissionGate,
        engine: EngineControl,
        on_restart: Callable[[str, float], None],
        clock: Clock = monotonic,
        oom_kills: Callable[[], int | None] = read_oom_kills,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        last_step_age: Callable[[], float | None] = lambda: None,
        gpu_free: Callable[[], tuple[int, int] | None] = lambda: None,
    ) -> None:
        self.s = settings
        self.gate = gate
        self.engine = engine
        self.memory = MemoryWatch(settings)
        self.stall = StallWatch(settings.stall_timeout_s)
        self._last_step_age = last_step_age
        self._gpu_free = gpu_free
        """The free and total bytes of the engine's tightest GPU now (NVML), None without one."""
        """Seconds since the engine's last step (the stat logger's): the liveness signal."""
        self._failure_reason: str | None = None
        """Why a live engine was counted as failed (a stall), for recovery's reason label."""
        gate.set_restart_wait(settings.max_restart_wait_s)
        self._on_restart = on_restart
        self._clock = clock
        self._oom_kills = oom_kills
        self._sleep = sleep
        self._restarts: deque[float] = deque()
        """When each crash restart was tried (the budget's window)."""
        self.memory_restarts = MemoryRestarts(settings)
        self._lock = asyncio.Lock()
        self._dead_noticed = asyncio.Event()
        self.given_up = asyncio.Event()
        """Set when the restart budget is spent: the daemon exits non-zero (module docstring)."""
        self._oom_baseline = oom_kills()
        self.unavailable_reason: str | None = None
        self.last_restart: dict[str, Any] | None = None
        self.on_engine_args: Callable[[dict[str, Any]], None] | None = None
        """Told the overrides of each restart that succeeded (the daemon's config in force follows)."""

    def configure(self, settings: GuardSettings) -> None:
        """Apply a reloaded [guard] table (the risk streak so far is kept)."""
        self.s = self.memory.s = self.memory_restarts.s = settings
        self.stall.timeout_s = settings.stall_timeout_s
        self.gate.set_restart_wait(settings.max_restart_wait_s)

    @property
    def restarting(self) -> bool:
        """A restart or a recovery (back-off sleep included) is running."""
        return self._lock.locked()

    # -- memory ---------------------------------------------------------------------------------
    def on_observation(self, obs: Observation) -> asyncio.Task[None] | None:
        """Feed one observation; starts a restart task when the memory risk is confirmed."""
        if self.restarting or self.unavailable_reason or self.engine.dead:
            return None  # a dead engine's memory is free: its last reading before the death stays
        if self.memory_restarts.hold(obs.now_mono) is not None:
            self.memory.reset()
            return None
        knob, settings = self.engine.memory_knob, self.engine.memory_settings()
        risk = self.memory.observe(obs, sizing_utilization(knob, settings))
        if risk is None:
            return None
        total = obs.gpu_memory_total_bytes
        overrides = self.memory_restarts.plan(settings, knob, risk.deficit_bytes, total)
        if overrides is None:
            floor = self.memory_restarts.failed_floor.get(knob)
            log.warning("memory_risk_at_floor", reason=risk.reason, failed_floor=floor, **risk.readings)
            return None
        log.warning(
            "memory_risk",
            reason=risk.reason,
            deficit_bytes=risk.deficit_bytes,
            new=overrides,
            **risk.readings,
        )
        return asyncio.create_task(self.restart(risk.reason, overrides, drain=True))

    # -- restart --------------------------------------------------------------------------------
    async def restart(self, reason: str, overrides: dict[str, Any], drain: bool) -> None:
        """Drain (when the engine is alive), swap the engine, resume. Queued requests are kept.
        Waits for a restart or recovery in progress; raises when the new engine failed to build."""
        async with self._lock:
            await self._restart(reason, overrides, drain)

    async def _restart(self, reason: str, overrides: dict[str, Any], drain: bool) -> None:
        t0 = self._clock()
        self.memory.reset()  # the readings so far were of the engine going: none tells a new one's death
        self.gate.pause()
        try:
            if drain and not self.engine.dead and not await self.gate.wait_idle(self.s.drain_timeout_s):
                aborted = await self.engine.abort_in_flight(f"engine restart ({reason})")
                log.warning("drain_deadline_passed", aborted=aborted)
            await self.engine.restart(overrides, build_first=reason not in MEMORY_REASONS)
        except BaseException as exc:
            self._after_failed_build(reason, overrides, exc)
            raise
        self.gate.resume()
        duration = self._clock() - t0
        self.memory_restarts.built(self._clock())
        if reason == "config_reload":
            self.memory_restarts.forget_floor()
        self._oom_baseline = self._oom_kills()
        shown = redact(overrides)  # /state and the log show it: an [engine] hf_token never
        self.last_restart = {
            "started_mono": t0,
            "reason": reason,
            "duration_s": duration,
            "overrides": shown,
            "t_wall": time.time(),
        }
        if self.unavailable_reason is not None:  # an engine serves again: stop refusing
            self.unavailable_reason = None
            self.gate.reopen()
        if self.on_engine_args is not None and overrides:
            self.on_engine_args(overrides)
        self._on_restart(reason, duration)
        log.info("engine_restarted", reason=reason, duration_s=round(duration, 3), **shown)

    def _after_failed_build(self, reason: str, overrides: dict[str, Any], exc: BaseException) -> None:
        """Resume on the engine that still serves; with none left, keep requests waiting and wake
        the watcher to recover (with the last settings that built). A memory setting that failed
        becomes the floor, and memory restarts back off (``MemoryRestarts``)."""
        if isinstance(exc, asyncio.CancelledError):
            log.warning("engine_restart_cancelled", reason=reason)  # shutdown
        else:
            log.error("engine_restart_failed", reason=reason, error=f"{type(exc).__name__}: {exc}")
            knob = self.engine.memory_knob
            if reason in MEMORY_REASONS and knob in overrides:
                self._memory_build_failed(knob, overrides[knob])
        if not self.engine.dead or self.unavailable_reason is not None:
            self.gate.resume()
        else:
            self._dead_noticed.set()

    def _memory_build_failed(self, knob: str, value: Any) -> None:
        """A smaller memory setting did not build. With no engine left on a GPU whose free memory is
        below what vLLM's start check asks (util x total free: a co-tenant holds the memory), it was
        too large, not too small: recovery builds at what the free memory holds, where the settings
        that built last would fail the same check. Else the value is the floor.

        The check asks for ``gpu_memory_utilization`` x total even where ``kv_cache_memory_bytes``
        sizes the cache (``vllm/v1/worker/utils.request_memory``): a smaller cache that a co-tenant
        left room for still failed it at the util in force, and so did every recovery, until the
        crash budget was spent. There the util comes down beside the cache (it sizes nothing else
        with the cache set)."""
        util = self._start_check_util(knob, value)
        reading = self._gpu_free() if self.engine.dead else None
        if reading is not None and reading[0] < util * reading[1]:
            fit = min(util, fitting_utilization(self.s, *reading))
            retry = {knob: value, "gpu_memory_utilization": fit}  # the util itself, or beside the cache
            wait = self.memory_restarts.too_large(self._clock(), retry)
            log.warning(
                "memory_restart_backoff", reason="free_memory_below_setting", retry=retry, wait_s=wait
            )
            return
        wait = self.memory_restarts.failed(self._clock(), knob, value)
        log.warning("memory_restart_backoff", reason="build_failed", floor=value, wait_s=wait)

    def _start_check_util(self, knob: str, value: Any) -> float:
        """The ``gpu_memory_utilization`` vLLM's start check asked of a build of ``value``: the value
        itself, or beside a ``kv_cache_memory_bytes`` the util in force (vLLM's default unset)."""
        if knob == "gpu_memory_utilization":
            return float(value)
        in_force = self.engine.memory_settings().get("gpu_memory_utilization")
        return float(in_force or VLLM_GPU_MEMORY_UTILIZATION)

    def _memory_death(self) -> str | None:
        """Why the dead engine ran out of memory, or None: the kernel's OOM killer in the service's
        cgroup (``oom_killed``), or a CUDA out-of-memory error (``cuda_oom``), by the engine's own word
        or, where it left none (a worker killed outright), by the last GPU reading before the death
        below the margin."""
        oom_now = self._oom_kills()
        if self._oom_baseline is not None and oom_now is not None and oom_now > self._oom_baseline:
            return "oom_killed"
        last = self.memory.last
        if self.engine.died_out_of_memory or (last is not None and last.reason == "gpu_memory_low"):
            return "cuda_oom"
        return None

    def _recovery_overrides(self, memory_death: bool) -> dict[str, Any]:
        """What a rebuild changes: after a death of memory, the smaller setting a memory restart
        takes (``MemoryRestarts.plan``: the floor holds; at it, the same setting); after a memory
        restart the free GPU memory could not hold, what it holds now (``MemoryRestarts.retry``)."""
        knob, settings = self.engine.memory_knob, self.engine.memory_settings()
        if memory_death:
            reading = self._gpu_free()
            overrides = self.memory_restarts.plan(settings, knob, 0, reading[1] if reading else None)
            if overrides is None:
                log.warning("memory_death_at_floor", failed_floor=self.memory_restarts.failed_floor.get(knob))
            return overrides or {}
        retry = self.memory_restarts.retry
        if retry is None:
            return {}
        reading = self._gpu_free()
        util = retry.get("gpu_memory_utilization")
        if reading is not None and util is not None:
            return {**retry, "gpu_memory_utilization": min(util, fitting_utilization(self.s, *reading))}
        return dict(retry)

    def _budget_left(self) -> int:
        horizon = self._clock() - 3600.0
        while self._restarts and self._restarts[0] < horizon:
            self._restarts.popleft()
        return self.s.max_restarts_per_hour - len(self._restarts)

    def _backoff_s(self) -> float:
        """Exponential in the restarts of the last hour: 1, 2, 4, ... up to ``backoff_max_s``."""
        return float(min(self.s.backoff_max_s, self.s.backoff_initial_s * 2 ** len(self._restarts)))

    async def recover(self) -> None:
        """Rebuild a dead engine with backoff, within the hourly crash budget. Queued requests wait;
        no other restart runs meanwhile."""
        async with self._lock:
            await self._recover()

    async def _recover(self) -> None:
        self.gate.pause()
        while self.engine.dead:
            if self._budget_left() <= 0:
                self._give_up()
                return
            memory_death = self._memory_death()
            overrides = self._recovery_overrides(memory_death is not None)
            reason = memory_death or self._failure_reason or "engine_died"
            delay = self._backoff_s()
            build_s = self.last_restart["duration_s"] if self.last_restart else 0.0
            self.gate.refuse_new(no_engine(delay + build_s, reason))  # queued requests keep waiting
            log.error("engine_dead", reason=reason, restart_in_s=delay, budget_left=self._budget_left())
            await self._sleep(delay)
            self._restarts.append(self._clock())  # a crash restart tried: it spends the budget
            with contextlib.suppress(Exception):  # the build failed (logged): back off, try again
                await self._restart(reason, overrides, drain=False)
            if self.engine.dead:
                self.gate.pause()
        self._failure_reason = None
        self.stall.reset()
        self.gate.refuse_new(None)

    def _give_up(self) -> None:
        n = self.s.max_restarts_per_hour
        self.unavailable_reason = "restart_budget_spent"
        message = (
            f"the engine died and was restarted {n} times in the last hour (max_restarts_per_hour = {n}); "
            "the daemon stopped restarting it: see its logs, fix the cause, then restart the service"
        )
        self.gate.refuse_all(GateRejected(message, 503, 60, "engine_unavailable"))
        self.gate.resume()
        log.critical("restart_budget_spent", max_restarts_per_hour=n, action="exit")
        self.given_up.set()

    def notice_dead(self) -> None:
        """Called by whoever sees the engine die first (a request on the engine in force: the client
        does not call it for an engine already replaced): hold the gate, wake the watcher."""
        if self.unavailable_reason is None:
            self.gate.pause()
        self._dead_noticed.set()

    async def watch(self) -> None:
        """Background task: notice a dead or stalled engine and recover it."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dead_noticed.wait(), self.s.check_interval_s)
            self._dead_noticed.clear()
            if self.restarting or self.unavailable_reason is not None:
                self.stall.reset()  # a restart's own quiet time is not a stall
                continue
            if self.engine.dead or self._stalled():
                await self.recover()
            elif self.gate.paused:
                self._resume_stray_pause()

    def _resume_stray_pause(self) -> None:
        """Only a restart or a recovery holds the gate, and none runs while the engine serves: a pause
        left now (a death noticed that the engine in force did not suffer) would hold every request
        until its deadline for good, so it ends."""
        log.warning("gate_resumed", reason="paused_without_restart")
        self.gate.resume()

    def _stalled(self) -> bool:
        """Work inside a live engine and no step for ``stall_timeout_s`` (liveness.py): the engine
        is counted as failed, so recovery restarts it (within the crash budget: a hang is a fault)."""
        why = self.stall.check(self._clock(), self.gate.stats().in_flight, self._last_step_age())
        if why is None:
            return False
        log.error("engine_stalled", reason="engine_stalled", detail=why)
        self._failure_reason = "engine_stalled"
        self.engine.mark_failed(why)
        return True

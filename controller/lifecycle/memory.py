"""What the memory guard decides, pure: when memory is at risk (``MemoryWatch``), the smaller
setting that covers the deficit (``shrink``), and when a memory restart may start and how low it may
go (``MemoryRestarts``). The guard (``guard.py``) acts on it; one mechanism for every memory knob,
``kv_cache_memory_bytes`` on the CPU and ``gpu_memory_utilization`` on a GPU alike."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from controller.config.load import GuardConfig
from policies.base import Observation

GuardSettings = GuardConfig
"""The guard reads its [guard] table as it is."""


@dataclass(frozen=True)
class MemoryRisk:
    reason: str
    """"gpu_memory_low" or "host_memory_low"."""
    deficit_bytes: int
    readings: dict[str, Any] = field(default_factory=dict)


VLLM_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``gpu_memory_utilization``: its start check asks for it beside a
``kv_cache_memory_bytes`` the config sets (``vllm/v1/worker/utils.request_memory``)."""
VLLM_FREE_SHARE = 0.5
"""On a GPU the margin is at most this share of what vLLM leaves free (``gpu_margin_bytes``)."""


def sizing_utilization(knob: str, settings: dict[str, Any]) -> float | None:
    """The ``gpu_memory_utilization`` that sizes the engine, or None where another knob does (with
    ``kv_cache_memory_bytes`` set, vLLM takes the weights, that cache and the activations only)."""
    value = settings.get("gpu_memory_utilization") if knob == "gpu_memory_utilization" else None
    return float(value) if value else None


def gpu_margin_bytes(
    s: GuardSettings, total_bytes: int, util: float | None = None, free_at_start: int | None = None
) -> int:
    """The free GPU memory below which the engine is at risk: ``gpu_free_margin_bytes`` or
    ``gpu_free_margin_fraction`` of the total, and, at a ``util`` in force, at most
    ``VLLM_FREE_SHARE`` of what vLLM leaves free. vLLM takes util x total at start (its CUDA-graph
    estimate included) beside the CUDA contexts it made before it measured, so NVML's free memory is
    then at most (1 - util) x total and at most ``free_at_start``, the first reading at that util:
    at util 0.97 the fixed margin (3 % of the total) sat above it and the guard restarted the
    engine seconds after its start. The margin trips when co-tenants took half of what was left."""
    margin = max(s.gpu_free_margin_bytes, int(s.gpu_free_margin_fraction * total_bytes))
    if util is None:
        return margin
    left = (1.0 - util) * total_bytes
    if free_at_start is not None:
        left = min(left, free_at_start)
    return min(margin, int(VLLM_FREE_SHARE * max(left, 0.0)))


def fitting_utilization(s: GuardSettings, free_bytes: int, total_bytes: int) -> float:
    """The largest ``gpu_memory_utilization`` vLLM's start check passes with ``free_bytes`` free (it
    refuses to start below util x total free, ``vllm/v1/worker/utils.request_memory``), less the
    guard's margin for the CUDA contexts made before vLLM measures; never below the floor."""
    fit = (free_bytes - gpu_margin_bytes(s, total_bytes)) / total_bytes if total_bytes else 0.0
    return max(s.min_gpu_memory_utilization, math.floor(fit * 10_000) / 10_000)


class MemoryWatch:
    """Counts consecutive risky samples, and keeps the first GPU reading at each utilization in
    force; pure apart from those."""

    def __init__(self, s: GuardSettings) -> None:
        self.s = s
        self.streak = 0
        self.last: MemoryRisk | None = None
        """The last sample's risk (confirmed or not), None when it was clear: what the memory looked
        like just before an engine died."""
        self.free_at_start: tuple[float, int] | None = None
        """The utilization in force and the free GPU memory first read at it."""

    def _risk(self, obs: Observation, util: float | None) -> MemoryRisk | None:
        s = self.s
        if obs.gpu_memory_free_bytes is not None and obs.gpu_memory_total_bytes:
            if util is not None and (self.free_at_start is None or self.free_at_start[0] != util):
                self.free_at_start = (util, obs.gpu_memory_free_bytes)
            start = self.free_at_start[1] if util is not None and self.free_at_start else None
            need = gpu_margin_bytes(s, obs.gpu_memory_total_bytes, util, start)
            if obs.gpu_memory_free_bytes < need:
                readings = {
                    "gpu_free_bytes": obs.gpu_memory_free_bytes,
                    "gpu_total_bytes": obs.gpu_memory_total_bytes,
                    "margin_bytes": need,
                    "gpu_memory_utilization": util,
                }
                return MemoryRisk("gpu_memory_low", need - obs.gpu_memory_free_bytes, readings)
            return None
        avail = obs.host_memory_available_bytes
        if avail is not None and avail < s.host_available_margin_bytes:
            readings = {"host_available_bytes": avail, "margin_bytes": s.host_available_margin_bytes}
            return MemoryRisk("host_memory_low", s.host_available_margin_bytes - avail, readings)
        return None

    def reset(self) -> None:
        """Readings are ignored (a cooldown, a new engine): no streak, no last risk."""
        self.streak = 0
        self.last = None

    def observe(self, obs: Observation, util: float | None = None) -> MemoryRisk | None:
        """A risk once ``consecutive_samples`` risky samples in a row were seen, else None; ``util``:
        the ``gpu_memory_utilization`` sizing the engine (``sizing_utilization``), if any."""
        risk = self.last = self._risk(obs, util)
        self.streak = self.streak + 1 if risk else 0
        if risk and self.streak >= self.s.consecutive_samples:
            self.streak = 0
            return risk
        return None


def shrink(
    settings: dict[str, Any], knob: str, deficit_bytes: int, s: GuardSettings, total_bytes: int | None = None
) -> dict[str, Any] | None:
    """The smaller memory setting that covers ``deficit_bytes``; None when already at the floor."""
    if knob == "gpu_memory_utilization":
        util = float(settings[knob])
        by_deficit = deficit_bytes / total_bytes if total_bytes else 0.0
        step = max(s.memory_step_fraction * util, by_deficit)
        new = round(max(s.min_gpu_memory_utilization, util - step), 4)
        return {knob: new} if new < util else None
    kv = int(settings[knob])
    new_kv = max(s.min_kv_cache_memory_bytes, kv - max(int(s.memory_step_fraction * kv), deficit_bytes))
    return {knob: new_kv} if new_kv < kv else None


MEMORY_BACKOFF_MAX_S = 3600.0
"""The longest wait after memory restarts that failed in a row: an hour, so a risk that persists is
tried again at most once an hour, and its logs say why."""


class MemoryRestarts:
    """When a memory restart may start and how low it may go: the decision, the cooldown, the floor
    and the back-off, one mechanism for every memory knob (a GPU's failed smaller build is the same
    event as a CPU's).

    * ``hold(now)``: the reason memory readings are ignored now (``cooldown`` after a restart that
      built, ``backoff`` after one that failed), else None.
    * ``plan(...)``: the smaller setting (``shrink``), never at or below a value that failed to
      build: a shrink that would go there stops halfway between it and the value in force; None when
      no value is left between them (``at_floor``).
    * ``built(now)`` / ``failed(now, knob, value)``: the outcome of a restart. After ``failed``, the
      wait is ``cooldown_s * 2**failures`` (failures in a row), up to ``MEMORY_BACKOFF_MAX_S``.
    * ``too_large(now, retry)``: a GPU setting the free memory could not hold (too large, not too
      small): no floor, the same back-off, and the next build takes ``retry``.
    """

    def __init__(self, s: GuardSettings) -> None:
        self.s = s
        self.until_mono: float | None = None
        """Memory readings are ignored until then."""
        self.failures = 0
        """Memory restarts that failed to build, in a row."""
        self.failed_floor: dict[str, float] = {}
        """Per knob, the largest value that failed to build: later shrinks stay above it."""
        self.retry: dict[str, float] | None = None
        """The setting the next build takes after one the free GPU memory could not hold
        (``too_large``); cleared by a build that succeeds."""

    def hold(self, now_mono: float) -> str | None:
        if self.until_mono is None or now_mono >= self.until_mono:
            return None
        return "backoff" if self.failures else "cooldown"

    def plan(
        self, settings: dict[str, Any], knob: str, deficit_bytes: int, total_bytes: int | None
    ) -> dict[str, Any] | None:
        overrides = shrink(settings, knob, deficit_bytes, self.s, total_bytes)
        floor = self.failed_floor.get(knob)
        if overrides is None or floor is None or overrides[knob] > floor:
            return overrides
        current = float(settings[knob])
        halfway = (floor + current) / 2
        new: float | int = round(halfway, 4) if knob == "gpu_memory_utilization" else int(halfway)
        return {knob: new} if floor < new < current else None

    def built(self, now_mono: float) -> None:
        self.failures = 0
        self.retry = None
        self.until_mono = now_mono + self.s.cooldown_s

    def failed(self, now_mono: float, knob: str, value: float) -> float:
        """Remember a setting that did not build; returns the wait before the next memory restart."""
        self.failed_floor[knob] = max(float(value), self.failed_floor.get(knob, float("-inf")))
        return self._back_off(now_mono)

    def too_large(self, now_mono: float, retry: dict[str, float]) -> float:
        """A GPU setting that did not build because the free memory could not hold it (a co-tenant
        holds it): not a floor, as a smaller one may build; the next build takes ``retry`` (its
        ``gpu_memory_utilization``: at most what the free memory then holds), after the same
        back-off as ``failed``. Returns the wait."""
        self.retry = dict(retry)
        return self._back_off(now_mono)

    def _back_off(self, now_mono: float) -> float:
        self.failures += 1
        wait = float(min(MEMORY_BACKOFF_MAX_S, self.s.cooldown_s * 2**self.failures))
        self.until_mono = now_mono + wait
        return wait

    def forget_floor(self) -> None:
        """An [engine] change built (a reload): what failed before was measured on other settings."""
        self.failed_floor.clear()

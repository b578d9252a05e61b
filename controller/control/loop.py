"""The control loop: observe -> decide -> normalize -> apply, one function each (STYLE.md 4).

Only ``apply`` touches the engine. Every change carries the policy's reason, or the normalize
stage's own ("clamped_max", ...), and is logged, counted and kept in a short history for /state.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import structlog

from controller.control.normalize import Move, Normalizer
from policies.base import Observation, Policy

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Change:
    """One knob moving from ``old`` to ``new``, and why."""

    knob: str
    """"admission_limit" or "batch_cap"."""
    old: int
    new: int
    reason: str
    t_mono: float
    t_wall: float


class Actuator(Protocol):
    def set_admission_limit(self, limit: int) -> None: ...

    def set_batch_cap(self, cap: int) -> Awaitable[int]: ...


class ControlLoop:
    """Runs one tick at a time; the scheduler calls ``tick`` every ``[control] tick_seconds``."""

    def __init__(
        self,
        policy: Policy,
        normalizer: Normalizer,
        observe: Callable[[], Observation],
        actuator: Actuator,
        on_change: Callable[[Change], None],
        history: int = 50,
    ) -> None:
        self.policy = policy
        self.normalizer = normalizer
        self._observe = observe
        self._actuator = actuator
        self._on_change = on_change
        self.history: deque[Change] = deque(maxlen=history)
        self.last_reason = "not_started"
        self._lock = asyncio.Lock()

    async def tick(self) -> list[Change]:
        if self._lock.locked():  # never overlap the previous tick
            return []
        async with self._lock:
            obs = self._observe()
            decision = self.policy.decide(obs, obs.now_mono)
            self.last_reason = decision.reason
            return await self._apply(self.normalizer.normalize(decision, obs, obs.now_mono), obs)

    async def _apply(self, moves: list[Move], obs: Observation) -> list[Change]:
        changes = []
        for knob, old, new, reason in moves:
            if knob == "admission_limit":
                self._actuator.set_admission_limit(new)
            else:
                new = await self._actuator.set_batch_cap(new)
            change = Change(knob, old, new, reason, obs.now_mono, time.time())
            self.history.append(change)
            self._on_change(change)
            log.info("knob_changed", **asdict(change))
            changes.append(change)
        return changes

    def resize_history(self, n: int) -> None:
        if n != self.history.maxlen:
            self.history = deque(self.history, maxlen=n)

    def recent(self) -> list[dict[str, Any]]:
        return [asdict(c) for c in self.history]

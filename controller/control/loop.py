"""The control loop: observe -> decide -> normalize -> apply, one function each (STYLE.md 4),
then the subscribers.

Only ``apply`` touches the engine (through the actuator). Every change carries the policy's reason,
or the normalize stage's own ("clamped_max", ...), and is logged and kept in a short history for
/state. Before observing, the tick pulls the engine's per-step figures through its ``StepFeed`` (when
it has one), so a step-cost model fed by it is up to date in the observation. After apply, each
subscriber sees the tick's observation and changes: the daemon's are the
diagnosis, the memory guard (which may start an engine restart from what it sees) and the decisions
metric, so everything a tick sets off is listed where the loop is built.

A tick awaits the engine only through its host (the pull, the batch cap, the token budget), whose
every call has a deadline, so a tick ends; the loop keeps when its ticks end, and says it is stalled
(``stalled``: /healthz and the systemd watchdog read it) when none ended for longer than a tick can
take. The daemon then reports it rather than serve on with its knobs, its memory guard and its
saturation frozen.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import structlog

from controller.clock import Clock, monotonic
from controller.control.actuator import Knobs
from controller.control.knobs import ADMISSION_LIMIT, BATCH_CAP, setters
from controller.control.normalize import Move, Normalizer
from controller.control.steps import StepFeed
from policies.base import Observation, Policy

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Change:
    """One knob moving from ``old`` to ``new``, and why."""

    knob: str
    """The knob's name (``control/knobs.py``: ``admission_limit``, ``batch_cap``, ``token_budget``)."""
    old: int
    new: int
    reason: str
    t_mono: float
    t_wall: float


Subscriber = Callable[[Observation, list[Change]], None]
"""Called after each tick's apply stage with its observation and the changes it made (maybe none)."""

ENGINE_CALLS_PER_TICK = 3
"""The most times a tick awaits the engine: the step pull, the batch cap, the token budget."""


class ControlLoop:
    """Runs one tick at a time; the scheduler calls ``tick`` every ``[control] tick_s``."""

    def __init__(
        self,
        policy: Policy,
        normalizer: Normalizer,
        observe: Callable[[], Observation],
        actuator: Knobs,
        subscribers: Sequence[Subscriber] = (),
        history: int = 50,
        steps: StepFeed | None = None,
        clock: Clock = monotonic,
    ) -> None:
        self.policy = policy
        self.normalizer = normalizer
        self._observe = observe
        self._set = setters(actuator)
        """Knob name -> the actuator's setter that moves it (``control/knobs.py``)."""
        self._subscribers = list(subscribers)
        self.steps = steps
        """The engine's per-step figures, pulled each tick before observing: subscribe a consumer to it
        (``loop.steps.subscribe``)."""
        self.history: deque[Change] = deque(maxlen=history)
        self.last_reason = "not_started"
        self._last_learned: dict[str, Any] | None = None
        """The policy's lesson last logged (``_log_learned``)."""
        self._lock = asyncio.Lock()
        self.clock = clock
        """Times the ticks (not the observation's ``now_mono``: the twin's engine may own that)."""
        self.ticks_total = 0
        """Ticks that ran to their subscribers."""
        self.skipped_total = 0
        """Ticks not run because the one before had not ended."""
        self.last_tick_mono: float | None = None
        """When the latest tick ended (``clock``); None before the first."""
        self.tick_started_mono: float | None = None
        """When the running tick began; None between ticks."""

    def subscribe(self, subscriber: Subscriber) -> None:
        """Called after each tick, after those subscribed before it."""
        self._subscribers.append(subscriber)

    async def tick(self) -> list[Change]:
        if self._lock.locked():  # never overlap the previous tick
            self._skipped()
            return []
        async with self._lock:
            self.tick_started_mono = self.clock()
            try:
                changes = await self._tick()
            finally:
                self.tick_started_mono = None
            self.ticks_total += 1
            self.last_tick_mono = self.clock()
            return changes

    async def _tick(self) -> list[Change]:
        if self.steps is not None:
            await self.steps.pull()
        obs = self._observe()
        decision = self.policy.decide(obs, obs.now_mono)
        self.last_reason = decision.reason
        self._log_learned()
        changes = await self._apply(self.normalizer.normalize(decision, obs, obs.now_mono), obs)
        in_force = {ADMISSION_LIMIT.name: obs.admission_limit, BATCH_CAP.name: obs.batch_cap}
        in_force.update({c.knob: c.new for c in changes})
        self.policy.applied(in_force[ADMISSION_LIMIT.name], in_force[BATCH_CAP.name], obs.now_mono)
        for notify in self._subscribers:
            notify(obs, changes)
        return changes

    def _log_learned(self) -> None:
        """Log the policy's newest lesson once (a margin look that holds moves no knob, so
        ``knob_changed`` would not carry its reason)."""
        learned = self.policy.learned()
        if learned and learned[-1] is not self._last_learned:
            self._last_learned = learned[-1]
            log.info("policy_learned", policy=self.policy.name, **learned[-1])

    def _skipped(self) -> None:
        self.skipped_total += 1
        started = self.tick_started_mono
        running_s = None if started is None else round(self.clock() - started, 1)
        log.warning("tick_skipped", reason="previous_tick_running", running_s=running_s)

    def stalled(self, now_mono: float, tick_s: float, call_deadline_s: float) -> str | None:
        """Why the loop counts as stalled at ``now_mono``, or None: a tick ticks every ``tick_s`` and
        waits on the engine at most ``ENGINE_CALLS_PER_TICK`` times ``call_deadline_s``, so a tick
        that ran longer, or no tick ended for a period and that, is a loop that no longer ticks.
        Never before the first tick ended (the daemon starts)."""
        if self.last_tick_mono is None:
            return None
        can_take_s = ENGINE_CALLS_PER_TICK * call_deadline_s
        started = self.tick_started_mono
        if started is not None and now_mono - started > can_take_s:
            return (
                f"a control tick has run for {now_mono - started:.0f}s (a tick takes {can_take_s:g}s at most)"
            )
        quiet_s = now_mono - self.last_tick_mono
        if quiet_s > tick_s + can_take_s:
            return f"no control tick ended for {quiet_s:.0f}s (tick_s = {tick_s:g})"
        return None

    async def _apply(self, moves: list[Move], obs: Observation) -> list[Change]:
        changes = []
        for knob, old, new, reason in moves:
            new = await self._set[knob](new)
            change = Change(knob, old, new, reason, obs.now_mono, time.time())
            self.history.append(change)
            log.info("knob_changed", **asdict(change))
            changes.append(change)
        return changes

    def resize_history(self, n: int) -> None:
        if n != self.history.maxlen:
            self.history = deque(self.history, maxlen=n)

    def recent(self) -> list[dict[str, Any]]:
        return [asdict(c) for c in self.history]

"""One engine step's figures, the one record every consumer of them reads: the telemetry window, the
step-cost model, the fit check, the warm-up's fit, the capacity meter (through the window) and the
twin, whose engine makes the same records.

A step is known from two places, and the record names each part by where it is measured:

* ``cost`` (``StepCost``): what the scheduler subclass measures inside the EngineCore
  (``controller/engine/runtime/stepmeter.py``), right around the forward pass: the tokens the step
  prefilled, the sequences it decoded, the KV tokens they attend over, and its time. The step-cost
  model fits these.
* ``stats`` (``StepStats``): what vLLM's stat logger reports in the API process
  (``controller/engine/runtime/stats.py``): the scheduler's queues and KV usage after the step, and what
  the step's outputs did for the requests (tokens, TTFT, ITL, requests finished). The telemetry
  window summarises these.

On the real engine the two parts arrive apart, each record carrying one: the stat logger runs in the
API process once per batch of outputs that reaches it over IPC (one call may cover several steps, or
none), while the EngineCore's own figures wait in its ring until the control loop drains it, so no
step id joins them. The twin knows both of each step at once and fills both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from controller.clock import Clock, monotonic

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StepCost:
    """A step's cost figures, as the scheduler measures them inside the EngineCore.

    ``kv_tokens`` counts as the twin's ``StepPlan.kv_tokens_read`` does (each scheduled request's
    computed tokens plus its new ones), so a fit compares with, and can be seeded from, a profile.
    """

    prefill_tokens: int
    """Tokens the step prefilled (a prompt's chunk, or a preempted request's recompute)."""
    decode_seqs: int
    """Sequences the step decoded."""
    kv_tokens: int
    """KV tokens the step's attention reads."""
    step_s: float
    """How long the step took, schedule to output (seconds)."""
    gap_s: float = 0.0
    """Time from the previous step's end to this one's start, where a sequence ran on from that step
    (the engine was busy): the engine loop's own work between steps and, on a shared CPU, the wait
    for a core. 0 where the engine may have idled, and in the twin (``stepmeter.StepMeter``)."""


@dataclass(frozen=True)
class StepStats:
    """A step as vLLM's stat-logger hook reports it."""

    running: int
    """Requests in the scheduler's RUNNING set after the step."""
    waiting: int
    """Requests waiting inside the engine (not in our gate)."""
    kv_usage: float
    """Fraction of KV-cache blocks in use, 0..1."""
    preempted: int
    """Requests preempted during the step."""
    generated_tokens: int
    """Tokens generated during the step."""
    ttft_s: tuple[float, ...]
    """Time to first token of the requests that got it in this step (seconds)."""
    itl_s: tuple[float, ...]
    """Inter-token latencies observed in this step (seconds)."""
    finished: int
    """Requests that finished in this step."""
    finished_prefill_tokens: int = 0
    """Prompt tokens the requests finished in this step had to prefill: their prompts less the
    prefix-cache hits (what the request mix costs in prefill, ``controller/control/capacity.py``)."""
    finished_output_tokens: int = 0
    """Output tokens the requests finished in this step generated."""
    finished_prompt_tokens: int = 0
    """Prompt tokens of the requests finished in this step, prefix-cache hits included."""


@dataclass(frozen=True)
class EngineStep:
    """One engine step: when it ended, which engine took it, and what is known of it (the module's
    docstring says why the real engine's records carry one part each)."""

    t_mono: float
    """When the step ended, on the monotonic clock: the EngineCore's at the step's end for a record
    with ``cost``, the daemon's when the stat logger reported it for one with ``stats`` alone (the
    twin's virtual end of the step for both). CLOCK_MONOTONIC is system-wide on Linux, so a value
    taken in the EngineCore process compares with the daemon's clock."""
    cost: StepCost | None = None
    """The scheduler's own figures; None where the record comes from the stat logger, or the step
    scheduled no token (no forward pass)."""
    stats: StepStats | None = None
    """The stat logger's figures; None where the record comes from the EngineCore."""
    engine_idx: int = 0
    """Which engine of a data-parallel group reported the step's ``stats`` (vLLM's ``engine_idx``; 0
    without DP): ``stats.running``, ``stats.waiting`` and ``stats.kv_usage`` are that engine's alone,
    and a record of ``cost`` is that engine's step (the engine host merges every engine's ring in
    time order)."""

    @classmethod
    def measured(
        cls,
        t_mono: float,
        prefill_tokens: int,
        decode_seqs: int,
        kv_tokens: int,
        step_s: float,
        gap_s: float = 0.0,
    ) -> EngineStep:
        """A record of the scheduler's figures alone (the EngineCore's ring, a test's step)."""
        return cls(t_mono, cost=StepCost(prefill_tokens, decode_seqs, kv_tokens, step_s, gap_s))


def costs(steps: Sequence[EngineStep]) -> list[tuple[float, StepCost]]:
    """The steps that carry the scheduler's figures, as (end time, figures), in order: what the
    step-cost model, the fit check and the warm-up's fit read."""
    return [(s.t_mono, s.cost) for s in steps if s.cost is not None]


class StepSource(Protocol):
    """Where the steps wait to be pulled: the engine host (the scheduler subclass's ring inside each
    EngineCore). Each call returns the steps since the last one, oldest first."""

    async def drain_steps(self) -> list[EngineStep]: ...


StepConsumer = Callable[[Sequence[EngineStep]], None]
"""Gets steps, oldest first (maybe none); e.g. the telemetry window's or the step-cost model's
``update``. A consumer reads the part it needs (``EngineStep.cost`` or ``EngineStep.stats``) and
passes over records without it."""

KEPT = 4096
"""Published steps kept for the next tick, as the EngineCore's ring keeps its own (``stepmeter.RING``):
the loop ticks about every second, and past this many the oldest are dropped."""


class StepFeed:
    """The one route of the engine's steps to every consumer.

    Steps enter as the engine makes them known: ``publish`` where they are pushed (vLLM's stat
    logger, on the event loop; the twin's driver, at each step's end), ``pull`` where they wait in
    the EngineCore's ring (an IPC call, which the control loop makes once a tick, before it
    observes). A consumer either ``watch``es, and gets each step at once (the telemetry window: the
    liveness check, the gate's prefix-cache share and /state read it between ticks), or
    ``subscribe``s, and gets at each tick every step since the last one (the step-cost model and the
    fit check learn once a tick). Either way it sees each step exactly once.
    """

    def __init__(
        self,
        source: StepSource | None = None,
        consumers: Sequence[StepConsumer] = (),
        clock: Clock = monotonic,
    ) -> None:
        self.source = source
        """Where the tick pulls from; None: every step is published (the twin)."""
        self.consumers = list(consumers)
        self.watchers: list[StepConsumer] = []
        self.resets: list[Callable[[], None]] = []
        self.now = clock
        """The clock a publisher stamps its steps with (``EngineStep.t_mono``)."""
        self._kept: deque[EngineStep] = deque(maxlen=KEPT)
        self.total = 0
        """Steps handed to the tick's consumers since the feed was built."""

    def subscribe(self, consumer: StepConsumer) -> None:
        """``consumer`` gets, at each tick, the steps since the last one."""
        self.consumers.append(consumer)

    def watch(self, consumer: StepConsumer, reset: Callable[[], None] | None = None) -> None:
        """``consumer`` gets each step as it comes, and ``reset`` is called when a new engine serves
        (what it kept of the last one is stale)."""
        self.watchers.append(consumer)
        if reset is not None:
            self.resets.append(reset)

    def publish(self, steps: Sequence[EngineStep]) -> None:
        """Steps the engine pushed: to each watcher now, to each consumer at the next tick."""
        for consume in self.watchers:
            consume(steps)
        self._kept.extend(steps)

    def engine_started(self) -> None:
        """A new engine serves (the engine host adopted it): each watcher's view starts over."""
        for reset in self.resets:
            reset()

    async def pull(self) -> list[EngineStep]:
        """The source's new steps (each watcher gets them), then every step since the last tick, in
        time order, to each consumer; returns those. A failed drain (an engine that died between two
        ticks) loses the source's steps, never the tick: the loop's subscribers, the memory guard
        among them, must still run."""
        pulled: list[EngineStep] = []
        if self.source is not None:
            try:
                pulled = await self.source.drain_steps()
            except Exception as exc:
                log.warning("engine_steps_lost", error=f"{type(exc).__name__}: {exc}")
        if pulled:
            for consume in self.watchers:
                consume(pulled)
        steps = sorted([*self._kept, *pulled], key=lambda s: s.t_mono)
        self._kept.clear()
        self.total += len(steps)
        for consume in self.consumers:
            consume(steps)
        return steps

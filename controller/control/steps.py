"""One engine step's cost figures: what the online step-cost model fits and what the scheduler
subclass inside the EngineCore measures (the twin's engine emits the same records)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class EngineStep:
    """One scheduler step: the tokens it prefilled, the sequences it decoded, the KV tokens those
    sequences attend over, and how long the step took (schedule to output, seconds).

    ``kv_tokens`` counts as the twin's ``CostModel.kv_tokens_read`` does (each scheduled request's
    computed tokens plus its new ones), so a fit compares with, and can be seeded from, a profile.

    ``t_mono`` is ``time.monotonic()`` at the step's end; CLOCK_MONOTONIC is system-wide on Linux, so
    a value taken in the EngineCore process compares with the daemon's clock.
    """

    t_mono: float
    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    step_s: float


class StepSource(Protocol):
    """Where the steps come from: the engine host (measured inside the EngineCore by the scheduler
    subclass) or the twin. Each call returns the steps since the last one, oldest first."""

    async def drain_steps(self) -> list[EngineStep]: ...


StepConsumer = Callable[[Sequence[EngineStep]], None]
"""Gets each tick's new steps (maybe none), oldest first; e.g. the step-cost model's update."""


class StepFeed:
    """Pulls a source's steps once per tick (the control loop calls ``pull`` before it observes) and
    hands them to each consumer in order, so every consumer sees every step exactly once."""

    def __init__(self, source: StepSource, consumers: Sequence[StepConsumer] = ()) -> None:
        self.source = source
        self.consumers = list(consumers)
        self.total = 0
        """Steps pulled since the feed was built."""

    def subscribe(self, consumer: StepConsumer) -> None:
        self.consumers.append(consumer)

    async def pull(self) -> list[EngineStep]:
        """The source's new steps, after every consumer has had them. A failed drain (an engine that
        died between two ticks) loses those steps, never the tick: the loop's subscribers, the memory
        guard among them, must still run."""
        try:
            steps = await self.source.drain_steps()
        except Exception as exc:
            log.warning("engine_steps_lost", error=f"{type(exc).__name__}: {exc}")
            return []
        self.total += len(steps)
        for consume in self.consumers:
            consume(steps)
        return steps

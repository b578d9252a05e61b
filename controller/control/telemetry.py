"""The engine-stats window: what the engine reported over the last seconds.

vLLM calls our stat logger once per engine step that produced output (never when idle), on the event
loop. Each call becomes an ``EngineStep`` with its ``stats`` part (``controller/control/steps.py``),
which the step feed hands the window at once (it watches the feed); ``TelemetryWindow.snapshot``
summarises the window. Time arrives as an argument or from the injected
clock, never from a hidden read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from controller.clock import Clock, monotonic
from controller.control.steps import EngineStep, StepStats
from controller.percentile import percentile


@dataclass(frozen=True)
class EngineStats:
    """Summary of the window; what policies and /state read."""

    now_mono: float
    window_s: float
    steps: int
    """Engine steps recorded inside the window."""
    running: int
    """Requests running, summed over the engines (each engine's latest step in the window)."""
    running_max: int
    """Largest RUNNING count over the window, summed over the engines likewise (the count behind
    ``kv_usage_max``'s peak, or above it)."""
    waiting: int
    """Requests waiting inside the engines, summed likewise."""
    kv_usage: float
    """The fullest engine's KV usage at its latest step: the engine that preempts first."""
    kv_usage_mean: float
    kv_usage_max: float
    preemptions: int
    preemptions_per_s: float
    generated_tokens_per_s: float
    finished_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    last_step_age_s: float | None
    """Seconds since the engine last reported a step; None before the first one. A large age with
    nothing running means idle, not stalled."""


@dataclass(frozen=True)
class FinishedMix:
    """The requests that finished inside the window: how many, and what a mean one cost."""

    finished: int
    """Requests finished inside the window."""
    prefill_tokens: float | None
    """Mean prompt tokens prefilled per finished request (prefix-cache hits excluded); None: none."""
    output_tokens: float | None
    """Mean output tokens per finished request; None when none finished."""
    cached_share: float | None = None
    """Share of those requests' prompt tokens the prefix cache served (not prefilled); None: no
    prompt tokens reported."""


@dataclass(frozen=True)
class _Seen:
    """A step in the window: its stat-logger figures, when and on which engine."""

    t_mono: float
    engine_idx: int
    stats: StepStats


class TelemetryWindow:
    """A rolling window of engine steps, as the stat logger reported them (``EngineStep.stats``)."""

    def __init__(self, window_s: float = 10.0, clock: Clock = monotonic, max_steps: int = 20_000) -> None:
        self.window_s = window_s
        self._clock = clock
        self._steps: deque[_Seen] = deque(maxlen=max_steps)
        self._last_t_mono: float | None = None
        """Time of the latest step, kept after it leaves the window (an idle engine reports nothing)."""
        self.total_steps = 0
        self.total_preemptions = 0
        self.total_generated_tokens = 0

    def now(self) -> float:
        return self._clock()

    def update(self, steps: Sequence[EngineStep]) -> None:
        """Take in steps as the feed hands them (a ``StepConsumer``), oldest first."""
        for step in steps:
            self.record(step)

    def record(self, step: EngineStep) -> None:
        """Take in a step the stat logger reported; one without its figures (the EngineCore's) is
        none of the window's."""
        if step.stats is None:
            return
        self._steps.append(_Seen(step.t_mono, step.engine_idx, step.stats))
        self._last_t_mono = step.t_mono
        self.total_steps += 1
        self.total_preemptions += step.stats.preempted
        self.total_generated_tokens += step.stats.generated_tokens

    def last_step_age_s(self) -> float | None:
        """Seconds since the engine last reported a step (None before the first): the guard's
        liveness signal, read without building a snapshot."""
        return None if self._last_t_mono is None else self._clock() - self._last_t_mono

    def reset(self) -> None:
        """Forget the window (a new engine starts from nothing)."""
        self._steps.clear()
        self._last_t_mono = None

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._steps and self._steps[0].t_mono < horizon:
            self._steps.popleft()

    def snapshot(self) -> EngineStats:
        now = self._clock()
        self._trim(now)
        seen = list(self._steps)
        latest, running_max = _latest_per_engine(seen)
        steps = [s.stats for s in seen]
        span = self.window_s
        kv = [s.kv_usage for s in steps]
        ttft = [v for s in steps for v in s.ttft_s]
        itl = [v for s in steps for v in s.itl_s]
        preempted = sum(s.preempted for s in steps)
        return EngineStats(
            now_mono=now,
            window_s=span,
            steps=len(steps),
            running=sum(s.running for s in latest),
            running_max=running_max,
            waiting=sum(s.waiting for s in latest),
            kv_usage=max((s.kv_usage for s in latest), default=0.0),
            kv_usage_mean=sum(kv) / len(kv) if kv else 0.0,
            kv_usage_max=max(kv) if kv else 0.0,
            preemptions=preempted,
            preemptions_per_s=preempted / span,
            generated_tokens_per_s=sum(s.generated_tokens for s in steps) / span,
            finished_per_s=sum(s.finished for s in steps) / span,
            ttft_p50_s=percentile(ttft, 50, "nearest_rank"),
            ttft_p99_s=percentile(ttft, 99, "nearest_rank"),
            itl_p50_s=percentile(itl, 50, "nearest_rank"),
            itl_p99_s=percentile(itl, 99, "nearest_rank"),
            last_step_age_s=(now - self._last_t_mono) if self._last_t_mono is not None else None,
        )

    def finished_mix(self) -> FinishedMix:
        """The request mix of the window, from the requests that finished in it (each one's prompt
        and output are known only then)."""
        self._trim(self._clock())
        steps = [s.stats for s in self._steps]
        n = sum(s.finished for s in steps)
        if n == 0:
            return FinishedMix(0, None, None)
        prefill = sum(s.finished_prefill_tokens for s in steps)
        prompt = sum(s.finished_prompt_tokens for s in steps)
        cached = min(1.0, max(0.0, 1.0 - prefill / prompt)) if prompt > 0 else None
        return FinishedMix(n, prefill / n, sum(s.finished_output_tokens for s in steps) / n, cached)

    def max_running_since(self, t_mono: float) -> int:
        """Largest RUNNING count one engine reported at or after ``t_mono`` (0 when none)."""
        return max((s.stats.running for s in self._steps if s.t_mono >= t_mono), default=0)


def _latest_per_engine(steps: list[_Seen]) -> tuple[list[StepStats], int]:
    """Each engine's latest step among ``steps`` (oldest first), and the largest RUNNING count summed
    over the engines at any step. With data parallelism each engine's stat logger reports its own
    step into the one window, so the last sample alone is one engine's figures, not the group's."""
    latest: dict[int, StepStats] = {}
    running_max = 0
    for s in steps:
        latest[s.engine_idx] = s.stats
        running_max = max(running_max, sum(x.running for x in latest.values()))
    return list(latest.values()), running_max

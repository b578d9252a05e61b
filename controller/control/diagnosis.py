"""What saturates: when more concurrency no longer brings more throughput, is it the engine or the
front end's CPU? The usual troubleshooting advice asks operators to find this out by hand.

Pure: observations in, a verdict out. Throughput is tracked per concurrency level (running requests
bucketed by powers of two, smoothed with an EWMA); when the top level observed gives less than
``min_gain`` more tokens/s than the level below it, concurrency has stopped paying.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Observation


@dataclass(frozen=True)
class Diagnosis:
    saturated: bool
    bottleneck: str | None
    """"engine", "front_end_cpu" or None."""
    reason: str
    throughput_by_concurrency: dict[int, float]


class Diagnoser:
    def __init__(self, min_gain: float = 0.05, alpha: float = 0.3, cpu_busy_percent: float = 90.0) -> None:
        self.min_gain = min_gain
        self.alpha = alpha
        self.cpu_busy_percent = cpu_busy_percent
        self._tps: dict[int, float] = {}
        self.last: Diagnosis | None = None
        """The verdict of the latest tick (for /state); None before the first."""

    @staticmethod
    def _bucket(running: int) -> int:
        return 1 << max(0, running.bit_length() - 1)

    def observe(self, obs: Observation) -> Diagnosis:
        if obs.running > 0 and obs.generated_tokens_per_s > 0:
            b = self._bucket(obs.running)
            old = self._tps.get(b)
            tps = obs.generated_tokens_per_s
            self._tps[b] = tps if old is None else old + self.alpha * (tps - old)
        return self._verdict(obs)

    def on_tick(self, obs: Observation, _changes: object) -> None:
        """A control-loop subscriber: each tick's observation updates the verdict."""
        self.last = self.observe(obs)

    def _verdict(self, obs: Observation) -> Diagnosis:
        table = dict(sorted(self._tps.items()))
        if len(table) < 2:
            return Diagnosis(False, None, "not_enough_levels", table)
        levels = list(table)
        top, below = levels[-1], levels[-2]
        gain = table[top] / table[below] - 1.0 if table[below] > 0 else 1.0
        if gain >= self.min_gain:
            return Diagnosis(False, None, f"concurrency_{below}_to_{top}_gains_{gain:.0%}", table)
        cpu = obs.daemon_cpu_percent
        if cpu is not None and cpu >= self.cpu_busy_percent:
            return Diagnosis(True, "front_end_cpu", f"front_end_cpu_{cpu:.0f}pct_gain_{gain:.0%}", table)
        return Diagnosis(True, "engine", f"engine_saturated_gain_{gain:.0%}_from_{below}_to_{top}", table)

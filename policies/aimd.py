"""The AIMD policy: additive increase, multiplicative decrease of the admission limit (Netflix AIMDLimit)."""

from __future__ import annotations

import math
from typing import Any

from policies.base import Decision, Observation, Policy
from policies.common import LimitMover, check_float, check_int


class AimdPolicy(Policy):
    """Adds ``increase`` to the admission limit per tick while latency is fine; multiplies it by
    ``backoff`` on overload.

    Formula, with ``L`` the limit estimate (a float) and ``lat`` the latency sample::

        overload (preemptions_per_s > 0, or lat > threshold_s) -> L = max(min_limit, L * backoff)
                                                                   "preemptions" / "latency_high"
        else, with demand (requests queued in the gate, or in_flight >= demand_fraction * limit)
                                                                -> L = min(max_limit, L + increase)
                                                                   "latency_ok"
        admission_limit = floor(L)

    After a backoff the policy holds for ``cooldown_s`` ("cooldown"): the telemetry window keeps an
    overload signal for its whole length, and backing off again for the same event would collapse the
    limit. ``L`` restarts from the limit in force whenever that differs from ``floor(L)`` (the
    normalize stage clamped or rate-limited it, or a reload changed it). Holds: "stale_stats",
    "no_measurement" (no latency sample and no preemptions), "no_demand", "cooldown".

    The batch cap is left alone (None) unless ``cap_follows_limit``: then ``batch_cap = clamp(limit,
    1, max_num_seqs)``.

    Parameters (defaults): ``latency`` "ttft_p99" (or "ttft_p50", "itl_p50", "itl_p99");
    ``threshold_s`` 1.0; ``increase`` 1; ``backoff`` 0.9; ``cooldown_s`` 5.0; ``demand_fraction`` 0.5
    (Netflix: ``inflight * 2 >= limit``); and the limit mover's ``min_limit``, ``max_limit``,
    ``cap_follows_limit``, ``stale_after_s`` (``policies.common.LimitMover``).

    The cooldown stays here rather than in the normalize stage: it follows a backoff only, not a
    growth step, which a generic stage cannot tell apart.

    States: the limit estimate, the time of the last backoff.
    """

    name = "aimd"
    param_names = ("threshold_s", "increase", "backoff", "cooldown_s")

    def __init__(
        self,
        *,
        max_num_seqs: int,
        initial_limit: int,
        latency: str = "ttft_p99",
        threshold_s: float = 1.0,
        increase: int = 1,
        backoff: float = 0.9,
        cooldown_s: float = 5.0,
        demand_fraction: float = 0.5,
        **limits: Any,
    ) -> None:
        self.limits = LimitMover(
            max_num_seqs=max_num_seqs, latency=latency, demand_fraction=demand_fraction, **limits
        )
        self.threshold_s = check_float("threshold_s", threshold_s, 0.0, lo_open=True)
        self.increase = check_int("increase", increase, 1)
        self.backoff = check_float("backoff", backoff, 0.5, 0.99)
        self.cooldown_s = check_float("cooldown_s", cooldown_s, 0.0)
        self._estimate = self.limits.clamp(float(initial_limit))
        self._backoff_mono: float | None = None
        self._sample: float | None = None

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        if self.limits.stale(obs):
            return Decision(None, None, "stale_stats")
        if self._backoff_mono is not None and now_mono - self._backoff_mono < self.cooldown_s:
            return Decision(None, None, "cooldown")
        if math.floor(self._estimate) != obs.admission_limit:
            self._estimate = self.limits.clamp(float(obs.admission_limit))
        self._sample = self.limits.sample(obs)
        overload = self._overload(obs)
        if overload is not None:
            self._estimate = max(self.limits.min_limit, self._estimate * self.backoff)
            self._backoff_mono = now_mono
            return self._decision(overload)
        if self._sample is None:
            return Decision(None, None, "no_measurement")
        if not self.limits.has_demand(obs):
            return Decision(None, None, "no_demand")
        self._estimate = min(self.limits.top, self._estimate + self.increase)
        return self._decision("latency_ok")

    def _overload(self, obs: Observation) -> str | None:
        if obs.preemptions_per_s > 0:
            return "preemptions"
        if self._sample is not None and self._sample > self.threshold_s:
            return "latency_high"
        return None

    def _decision(self, reason: str) -> Decision:
        return self.limits.decision(math.floor(self._estimate), reason)

    def params(self) -> dict[str, Any]:
        return {**super().params(), **self.limits.params()}

    def terms(self) -> dict[str, float]:
        """Limit estimate and the last latency sample (s)."""
        sample = math.nan if self._sample is None else self._sample
        return {"limit_estimate": self._estimate, "sample_s": sample}

"""The AIMD policy: additive increase, multiplicative decrease of the admission limit (Netflix AIMDLimit)."""

from __future__ import annotations

import math

from policies.base import Decision, Observation, Policy
from policies.common import (
    LATENCIES,
    check_bool,
    check_choice,
    check_float,
    check_int,
    clamp,
    has_demand,
    is_stale,
    latency_sample,
    limit_decision,
)


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
    ``threshold_s`` 1.0; ``increase`` 1; ``backoff`` 0.9; ``cooldown_s`` 5.0; ``min_limit`` 1;
    ``max_limit`` 2 * max_num_seqs; ``demand_fraction`` 0.5 (Netflix: ``inflight * 2 >= limit``);
    ``cap_follows_limit`` false; ``stale_after_s`` 5.0.

    States: the limit estimate, the time of the last backoff.
    """

    name = "aimd"
    param_names = tuple(
        "latency threshold_s increase backoff cooldown_s min_limit max_limit demand_fraction "
        "cap_follows_limit stale_after_s".split()
    )

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
        min_limit: int = 1,
        max_limit: int | None = None,
        demand_fraction: float = 0.5,
        cap_follows_limit: bool = False,
        stale_after_s: float = 5.0,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.latency = check_choice("latency", latency, LATENCIES)
        self.threshold_s = check_float("threshold_s", threshold_s, 0.0, lo_open=True)
        self.increase = check_int("increase", increase, 1)
        self.backoff = check_float("backoff", backoff, 0.5, 0.99)
        self.cooldown_s = check_float("cooldown_s", cooldown_s, 0.0)
        self.min_limit = check_int("min_limit", min_limit, 1)
        limit_max = 2 * max_num_seqs if max_limit is None else max_limit
        self.max_limit = check_int("max_limit", limit_max, self.min_limit)
        self.demand_fraction = check_float("demand_fraction", demand_fraction, 0.0, 1.0, lo_open=True)
        self.cap_follows_limit = check_bool("cap_follows_limit", cap_follows_limit)
        self.stale_after_s = check_float("stale_after_s", stale_after_s, 0.0, lo_open=True)
        self._estimate = clamp(float(initial_limit), self.min_limit, self.max_limit)
        self._backoff_mono: float | None = None
        self._sample: float | None = None

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        if is_stale(obs, self.stale_after_s):
            return Decision(None, None, "stale_stats")
        if self._backoff_mono is not None and now_mono - self._backoff_mono < self.cooldown_s:
            return Decision(None, None, "cooldown")
        if math.floor(self._estimate) != obs.admission_limit:
            self._estimate = clamp(float(obs.admission_limit), self.min_limit, self.max_limit)
        self._sample = latency_sample(obs, self.latency)
        overload = self._overload(obs)
        if overload is not None:
            self._estimate = max(self.min_limit, self._estimate * self.backoff)
            self._backoff_mono = now_mono
            return self._decision(overload)
        if self._sample is None:
            return Decision(None, None, "no_measurement")
        if not has_demand(obs, obs.in_flight, obs.admission_limit, self.demand_fraction):
            return Decision(None, None, "no_demand")
        self._estimate = min(self.max_limit, self._estimate + self.increase)
        return self._decision("latency_ok")

    def _overload(self, obs: Observation) -> str | None:
        if obs.preemptions_per_s > 0:
            return "preemptions"
        if self._sample is not None and self._sample > self.threshold_s:
            return "latency_high"
        return None

    def _decision(self, reason: str) -> Decision:
        return limit_decision(math.floor(self._estimate), reason, self.cap_follows_limit, self.max_num_seqs)

    def terms(self) -> dict[str, float]:
        """Limit estimate and the last latency sample (s)."""
        sample = math.nan if self._sample is None else self._sample
        return {"limit_estimate": self._estimate, "sample_s": sample}

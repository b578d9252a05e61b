"""The gradient policy: adaptive concurrency for the admission limit (Envoy / Netflix Gradient2 style)."""

from __future__ import annotations

import math
from typing import Any

from policies.base import Decision, Observation, Policy, PolicyError
from policies.common import LimitMover, check_float, check_int, clamp

MEASURING, NORMAL = "measuring", "normal"


class GradientPolicy(Policy):
    """Grows the admission limit while latency stays near its unloaded baseline, shrinks it when not.

    Formula (state "normal"), with ``L`` the limit estimate (a float), ``s`` the latency sample and
    ``b`` the baseline latency::

        gradient = clamp(b * (1 + tolerance) / s, 0.5, 1.0)
        L' = L * gradient + sqrt(L)                  # sqrt(L): queue headroom, lets the limit probe up
        L  = clamp((1 - smoothing) * L + smoothing * L', min_limit, max_limit)
        admission_limit = floor(L)     # only once |floor(L) - limit| >= max(1, min_change * limit)

    One update per sample: the sample is a window percentile, so after an update of ``L`` or a move
    of the limit the policy holds ("dwell") until ``dwell_s`` has passed (by default the
    Observation's window, ``[control] window_seconds``), as Gradient2 updates once per sample window.
    Updating every tick applied the same reading up to ten times: one latency spike cut the limit
    from 29 to 8 in 12 s, and the limit then crept back one request every few ticks (tests/sim:
    8 and 31 moves a minute at a steady load).

    Minimum change: ``L`` moves freely, the limit in force only once ``floor(L)`` is at least
    ``max(1, min_change * limit)`` away from it ("below_min_change" otherwise: hold): quantisation
    with hysteresis, so an estimate that drifts around an integer does not flip the limit.

    A limit that does not bind: with a gradient below 1 and fewer requests in flight than the
    limit, a cut to any value above ``in_flight`` changes nothing, so ``L`` starts from ``in_flight``
    (not from the limit) on that update: the first cut bites.

    ``L`` follows the applied limit: when the limit in force is not the one this policy set last (the
    normalize stage clamped, rate-limited or dropped it, or a reload changed it), ``L`` restarts from
    the limit in force. A growth of ``L`` needs demand (requests queued in the gate, or ``in_flight >=
    demand_fraction * limit``), else hold, "no_demand" (Gradient2's "app limited"). Reasons:
    "latency_high" (gradient < 1), "latency_ok" (gradient = 1), "no_measurement" (no sample in the
    window: hold), "dwell", "below_min_change", "stale_stats".

    States: "measuring" -> "normal" -> (every ``baseline_interval_s``) "measuring" -> ... The first
    tick enters "measuring": the limit is pinned to ``baseline_limit`` ("measuring_baseline") for at
    least ``baseline_window_s`` and until one sample came; the baseline is the smallest sample seen
    in that window (Envoy's minRTT). The limit then goes back to the estimate it had before the
    window ("baseline_measured"). Pinning the limit only stops new admissions: requests already in the
    engine finish at their pace, so make the window at least as long as the telemetry window.
    No jitter: one daemon drives one engine, there is no fleet to de-synchronise.

    The batch cap is left alone (None) unless ``cap_follows_limit``: then ``batch_cap = clamp(limit,
    1, max_num_seqs)``.

    Parameters (defaults): ``latency`` "ttft_p50" (or "ttft_p99", "itl_p50", "itl_p99");
    ``tolerance`` 0.5; ``smoothing`` 0.2; ``baseline_interval_s`` 300.0; ``baseline_window_s`` 10.0;
    ``baseline_limit`` 4; ``demand_fraction`` 0.9; ``dwell_s`` None (the telemetry window; 0: update
    every tick); ``min_change`` 0.1 (0: any whole step); and the limit mover's ``min_limit``,
    ``max_limit``, ``cap_follows_limit``, ``stale_after_s`` (``policies.common.LimitMover``).

    Dwell and minimum change stay here rather than in the normalize stage: both act on the estimate
    ``L``, which only this policy has (a dwell also starts at an update that moves no knob), and
    the normalize stage's tolerance band, applied to the limit alone, would drop the steps the
    estimate accumulates.
    """

    name = "gradient"
    param_names = tuple(
        "tolerance smoothing baseline_interval_s baseline_window_s baseline_limit dwell_s min_change".split()
    )

    def __init__(
        self,
        *,
        max_num_seqs: int,
        initial_limit: int,
        latency: str = "ttft_p50",
        tolerance: float = 0.5,
        smoothing: float = 0.2,
        baseline_interval_s: float = 300.0,
        baseline_window_s: float = 10.0,
        baseline_limit: int = 4,
        demand_fraction: float = 0.9,
        dwell_s: float | None = None,
        min_change: float = 0.1,
        **limits: Any,
    ) -> None:
        self.limits = LimitMover(
            max_num_seqs=max_num_seqs, latency=latency, demand_fraction=demand_fraction, **limits
        )
        self.tolerance = check_float("tolerance", tolerance, 0.0)
        self.smoothing = check_float("smoothing", smoothing, 0.0, 1.0, lo_open=True)
        self.baseline_window_s = check_float("baseline_window_s", baseline_window_s, 0.0)
        self.baseline_interval_s = check_float("baseline_interval_s", baseline_interval_s, 0.0, lo_open=True)
        if self.baseline_interval_s <= self.baseline_window_s:
            raise PolicyError(
                f"baseline_interval_s = {baseline_interval_s}: must be longer than "
                f"baseline_window_s = {baseline_window_s}"
            )
        self.baseline_limit = check_int("baseline_limit", baseline_limit, 1, self.limits.top)
        self.dwell_s = None if dwell_s is None else check_float("dwell_s", dwell_s, 0.0)
        self.min_change = check_float("min_change", min_change, 0.0, 1.0)
        self.state = MEASURING
        self._estimate = self.limits.clamp(float(initial_limit))
        self._deferred = self._estimate  # the estimate to go back to after a measuring window
        self._window_start: float | None = None
        self._best: float | None = None  # smallest sample in the current measuring window
        self._baseline: float | None = None
        self._baseline_mono = 0.0
        self._sample: float | None = None
        self._gradient = math.nan
        self._applied: int | None = None  # the limit this policy set last
        self._limit_seen: int | None = None  # the limit in force when this tick decided
        self._moved_at: float | None = None  # when the limit last moved (start of a dwell)
        self._updated_at: float | None = None  # when the estimate last changed (start of a dwell)

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        self._limit_seen = obs.admission_limit
        if self.limits.stale(obs):
            return Decision(None, None, "stale_stats")
        self._sample = self.limits.sample(obs)
        if self.state == NORMAL and now_mono - self._baseline_mono >= self.baseline_interval_s:
            self.state, self._window_start = MEASURING, None
        if self.state == MEASURING:
            return self._measure(now_mono)
        if self._sample is None:
            return Decision(None, None, "no_measurement")
        dwell = obs.window_s if self.dwell_s is None else self.dwell_s
        last = max(self._moved_at or -math.inf, self._updated_at or -math.inf)
        if dwell > 0 and now_mono - last <= dwell:
            # The sample (a window percentile) still covers time before the last update or move:
            # applying it again would compound the same reading.
            return Decision(None, None, "dwell")
        return self._update(obs, self._sample, now_mono)

    def _measure(self, now_mono: float) -> Decision:
        if self._window_start is None:
            self._window_start, self._best, self._deferred = now_mono, None, self._estimate
        if self._sample is not None:
            self._best = self._sample if self._best is None else min(self._best, self._sample)
        if now_mono - self._window_start < self.baseline_window_s or self._best is None:
            return self._decision(self.baseline_limit, "measuring_baseline")
        self.state, self._baseline, self._baseline_mono = NORMAL, self._best, now_mono
        self._estimate = self._deferred
        self._applied = math.floor(self._estimate)
        return self._decision(self._applied, "baseline_measured")

    def _update(self, obs: Observation, sample: float, now_mono: float) -> Decision:
        if obs.admission_limit != self._applied:
            # Not the limit this policy set last (first tick, the loop clamped or rate-limited it,
            # dropped it, or a reload changed it): restart from the limit in force.
            self._estimate, self._applied = float(obs.admission_limit), obs.admission_limit
        estimate = self._estimate
        baseline = self._baseline if self._baseline is not None else sample
        self._gradient = 1.0 if sample <= 0 else clamp(baseline * (1 + self.tolerance) / sample, 0.5, 1.0)
        if self._gradient < 1.0 and obs.in_flight < obs.admission_limit:
            # The limit does not bind: a cut to any value above the requests in flight changes
            # nothing, so the cut starts from them.
            estimate = min(estimate, max(float(self.limits.min_limit), float(obs.in_flight)))
        target = estimate * self._gradient + math.sqrt(estimate)
        new = self.limits.clamp((1 - self.smoothing) * estimate + self.smoothing * target)
        if new > estimate and not self.limits.has_demand(obs):
            return Decision(None, None, "no_demand")
        self._estimate, self._updated_at = new, now_mono
        reason = "latency_high" if self._gradient < 1.0 else "latency_ok"
        limit = obs.admission_limit
        if abs(math.floor(new) - limit) < max(1.0, self.min_change * limit):
            # Quantisation with hysteresis: the estimate keeps moving, the limit in force only once
            # the estimate is a whole step away from it, so noise around an integer does not flip it.
            return Decision(None, None, "below_min_change")
        self._applied = math.floor(new)
        return self._decision(self._applied, reason)

    def _decision(self, limit: int, reason: str) -> Decision:
        return self.limits.decision(limit, reason)

    def params(self) -> dict[str, Any]:
        return {**super().params(), **self.limits.params()}

    def applied(self, admission_limit: int, batch_cap: int, now_mono: float) -> None:
        """A limit the loop moved this tick starts a dwell: later samples still cover time before it."""
        if self._limit_seen is not None and admission_limit != self._limit_seen:
            self._moved_at = now_mono

    def terms(self) -> dict[str, float]:
        """Limit estimate, last gradient, baseline and sample latencies (s), 1.0 while measuring."""
        return {
            "limit_estimate": self._estimate,
            "gradient": self._gradient,
            "baseline_s": math.nan if self._baseline is None else self._baseline,
            "sample_s": math.nan if self._sample is None else self._sample,
            "measuring": 1.0 if self.state == MEASURING else 0.0,
        }

"""The PID policy: drive the batch cap so a measured signal (KV usage or a latency) sits at a setpoint."""

from __future__ import annotations

import math
from typing import Any

from policies.base import Decision, Observation, Policy, PolicyError
from policies.common import KV_SOURCES, CapFollower, check_choice, check_float, clamp, kv_signal
from policies.knobs import cap_bounds

TARGETS = ("kv_usage", "ttft_p99", "itl_p99")
DEFAULT_SETPOINTS = {"kv_usage": 0.9}


class PidPolicy(Policy):
    """A positional PID on a relative error; its output in [0, 1] spans the batch cap's range.

    Formula, with ``m`` the measurement (KV usage read by ``kv_source``, or the window's p99 TTFT / ITL in
    seconds), ``sp`` the setpoint and ``dt`` the time since the previous tick with a measurement::

        r = clamp((sp - m) / sp, -1, 1)            # > 0: room to spare, raise the cap
        e = r - deadband if r > deadband else min(r, 0)   # within sp * (1 - deadband) .. sp: on target
        I = clamp(I + ki * e * dt, -kp, 1 + kp)    # skipped while saturated (below)
        D = -kd * ((m - m_prev) / sp) / dt         # derivative on measurement, not on error
        u = clamp(kp * e + I + D, 0, 1)
        batch_cap = min_cap + round(u * (max_num_seqs - min_cap))      # output_scale = "linear"
        batch_cap = round(min_cap * (max_num_seqs / min_cap) ** u)    # output_scale = "log"
        admission_limit = ceil(batch_cap * limit_factor) + limit_headroom   # CapFollower

    The error is relative, so the same gains suit KV usage and latencies. With ``output_scale = "log"``
    a step of ``u`` changes the cap by a fixed ratio: KV usage grows in proportion to the cap, so the
    loop gain no longer depends on how much KV each request takes (use it for KV targets).

    The deadband keeps measurement noise away from the integral: at steady load a noisy signal
    (KV usage's window max, a p99 latency) wanders, and integrating each excursion moves the cap up
    and down (on the real engine, without it: 1, 6 and 8 direction changes a minute in three runs).
    The band lies below the setpoint: being a little under it costs a little throughput, crossing
    it costs preemptions or the SLO, so above the setpoint the full error acts. Subtracting the
    band (rather than zeroing inside it) keeps the P term continuous at its lower edge.

    The first tick starts bumpless: ``I = u(current cap) - kp * e``, no integration, no D.
    Anti-windup: ``I`` is clamped to [-kp, 1 + kp] (just enough to hold any output against the
    largest P term), and it is not integrated while the error pushes an output that cannot follow:
    ``kp*e + I + D`` beyond [0, 1], the loop's normalize stage having moved the cap only part of the
    way asked at the previous tick (rate limit, as ``applied`` reports it; a change it dropped whole,
    as within its tolerance band, does not stop the integral, or the cap would never leave the
    band), or a raise held for lack of demand.

    Holds (both knobs None): "stale_stats"; "settling" (above the setpoint while more requests run
    than the cap allows: the previous cut is still taking effect, so neither P nor I acts on it);
    "cut_dwell" (above the setpoint within one observation window of the last cut in force, as
    ``applied`` reports it, unless KV usage is read as the "latest" step: a window's max, mean or p99
    still holds what ran before that cut, and cutting again for it over-cuts; on the real engine the
    cap then climbed back and cycled between 7 and 22 every ~35 s);
    "no_measurement" (no latency samples in the window; the next measurement starts a fresh dt and
    D); "no_demand" (a raise without requests queued in the gate and with ``running <
    demand_fraction * cap``). Otherwise the decision carries both knobs and the reason says why the
    cap moves: "below_setpoint" (up), "above_setpoint" (down), "measurement_rising"
    (down although e >= 0: the D term), "measurement_falling" (up although e <= 0), "steady" (unchanged).

    Parameters (defaults): ``target`` "kv_usage" (or "ttft_p99", "itl_p99"); ``kv_source`` "max"
    (how KV usage is read: the window "max", its "mean", or the "latest" step; the max, because a
    burst's peak is what overflows the cache and preempts); ``output_scale`` "log" (or "linear");
    ``setpoint`` 0.9 for kv_usage, required (seconds) for latencies, e.g. the TPOT SLO for
    "itl_p99"; ``kp`` 0.2, ``ki`` 0.2 (per second), ``kd`` 0.0 (seconds); ``deadband`` 0.1 (a
    fraction of the setpoint); and the cap follower's ``min_cap``, ``demand_fraction``,
    ``limit_factor``, ``limit_headroom``, ``stale_after_s``, ``idle_restore_s``
    (``policies.common.CapFollower``); after an "idle_restore" the controller restarts bumpless
    from the ceiling.

    States: the cap follower's idle clock; integral ``I`` (None until the first measurement),
    previous measurement and its time; this tick's ask and whether the previous one was held short;
    when the cap in force last went down.
    """

    name = "pid"
    param_names = tuple("target setpoint kv_source output_scale kp ki kd deadband".split())

    def __init__(
        self,
        *,
        max_num_seqs: int,
        initial_limit: int,
        target: str = "kv_usage",
        setpoint: float | None = None,
        kv_source: str = "max",
        output_scale: str = "log",
        kp: float = 0.2,
        ki: float = 0.2,
        kd: float = 0.0,
        deadband: float = 0.1,
        **follower: Any,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.target = check_choice("target", target, TARGETS)
        self.kv_source = check_choice("kv_source", kv_source, KV_SOURCES)
        self.output_scale = check_choice("output_scale", output_scale, ("linear", "log"))
        if setpoint is None and target not in DEFAULT_SETPOINTS:
            raise PolicyError(f"target = {target!r} needs a setpoint (seconds), e.g. 0.5")
        sp = DEFAULT_SETPOINTS[target] if setpoint is None else setpoint
        top = 1.0 if target == "kv_usage" else math.inf
        self.setpoint = check_float("setpoint", sp, 0.0, top, lo_open=True)
        self.kp = check_float("kp", kp, 0.0)
        self.ki = check_float("ki", ki, 0.0)
        self.kd = check_float("kd", kd, 0.0)
        self.deadband = check_float("deadband", deadband, 0.0, 0.99)
        self.follower = CapFollower(max_num_seqs=max_num_seqs, **follower)
        self._integral: float | None = None
        self._prev: tuple[float, float] | None = None  # (now_mono, measurement)
        self._ask: tuple[int, int] | None = None  # this tick's (cap in force, cap asked), for applied()
        self._held = 0  # the previous ask took effect only in part: -1 held below it, +1 above
        self._last_cut_mono: float | None = None  # when the cap in force last went down
        self._terms = {"measurement": math.nan, "error": math.nan, "derivative": math.nan, "output": math.nan}

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        self._ask = None
        if self.follower.stale(obs):
            return self._hold("stale_stats", forget=True)
        if self.follower.restore_due(obs, now_mono):
            self._integral, self._prev, self._last_cut_mono = None, None, None  # bumpless from the ceiling
            return self.follower.decision(self.max_num_seqs, "idle_restore")
        m = self._measure(obs)
        if m is None:
            return self._hold("no_measurement", forget=True)
        r = clamp((self.setpoint - m) / self.setpoint, -1.0, 1.0)
        e = r - self.deadband if r > self.deadband else min(r, 0.0)
        if e < 0 and obs.running > obs.batch_cap:
            # The last cut has not taken effect yet (lowering the cap never preempts: the requests
            # admitted before it run to completion). Integrating now would wind the cap down to the floor.
            self._terms = {**self._terms, "measurement": m, "error": e}
            return self._hold("settling", forget=True)
        if e < 0 and self._cut_unseen(obs, now_mono):
            # A window statistic still holds the peak from before the last cut: cutting again for it
            # over-cuts, and the cap then climbs back (a limit cycle of ~35 s on the real engine).
            self._terms = {**self._terms, "measurement": m, "error": e}
            return self._hold("cut_dwell", forget=True)
        integral, dt = self._start_integral(obs, e), self._dt(now_mono)
        d = self._derivative(m, dt)
        self._prev = (now_mono, m)
        if dt is not None and not self._saturated(e, integral + self.kp * e + d):
            integral = clamp(integral + self.ki * e * dt, -self.kp, 1.0 + self.kp)
        u = clamp(self.kp * e + integral + d, 0.0, 1.0)
        cap = self._cap_for(u)
        self._terms = {"measurement": m, "error": e, "derivative": d, "output": u}
        if cap > obs.batch_cap and not self.follower.has_demand(obs):
            if e <= 0:  # a raise from D alone: the integral may still move down
                self._integral = integral
            return self._hold("no_demand", forget=False)
        self._integral, self._ask = integral, (obs.batch_cap, cap)
        return self.follower.decision(cap, _reason(cap, obs.batch_cap, e))

    def applied(self, admission_limit: int, batch_cap: int, now_mono: float) -> None:
        """Whether this tick's ask took effect only in part: the normalize stage moved the cap, but
        not as far as asked (rate limit, stabilisation window). A cap left where it was (an ask
        dropped whole, as within the tolerance band) is not held short."""
        self._held = 0
        if self._ask is not None and batch_cap != self._ask[0]:
            asked = self._ask[1]
            self._held = (batch_cap > asked) - (batch_cap < asked)
            if batch_cap < self._ask[0]:
                self._last_cut_mono = now_mono

    def _cut_unseen(self, obs: Observation, now_mono: float) -> bool:
        """Less than one observation window since the last cut, on a measurement taken over the
        window (the window max or mean of KV usage, a p99 latency): it may not show that cut yet."""
        if self.target == "kv_usage" and self.kv_source == "latest":
            return False
        return self._last_cut_mono is not None and now_mono - self._last_cut_mono < obs.window_s

    def _measure(self, obs: Observation) -> float | None:
        if self.target == "kv_usage":
            return kv_signal(obs, self.kv_source)
        return obs.ttft_p99_s if self.target == "ttft_p99" else obs.itl_p99_s

    def _start_integral(self, obs: Observation, e: float) -> float:
        """Bumpless start: the first output equals the cap in force."""
        if self._integral is None:
            current = self._u_for(obs.batch_cap)
            self._integral = clamp(current - self.kp * e, -self.kp, 1.0 + self.kp)
        return self._integral

    def _cap_for(self, u: float) -> int:
        lo, hi = self.follower.min_cap, self.max_num_seqs
        if self.output_scale == "log":
            ratio: float = (hi / lo) ** u
            return cap_bounds(hi, lo).clamp(round(lo * ratio))
        return lo + round(u * (hi - lo))

    def _u_for(self, cap: int) -> float:
        lo, hi = self.follower.min_cap, self.max_num_seqs
        if hi == lo:
            return 0.0
        cap = cap_bounds(hi, lo).clamp(cap)
        if self.output_scale == "log":
            return math.log(cap / lo) / math.log(hi / lo)
        return (cap - lo) / (hi - lo)

    def _dt(self, now_mono: float) -> float | None:
        if self._prev is None or now_mono <= self._prev[0]:
            return None
        return now_mono - self._prev[0]

    def _derivative(self, m: float, dt: float | None) -> float:
        if dt is None or self._prev is None:
            return 0.0
        return -self.kd * ((m - self._prev[1]) / self.setpoint) / dt

    def _saturated(self, e: float, u_raw: float) -> bool:
        """The output cannot move further the way the error pushes it (conditional integration)."""
        if e > 0:
            return u_raw > 1.0 or self._held < 0
        return e < 0 and (u_raw < 0.0 or self._held > 0)

    def _hold(self, reason: str, *, forget: bool) -> Decision:
        if forget:
            self._prev = None
        return Decision(None, None, reason)

    def params(self) -> dict[str, Any]:
        return {**super().params(), **self.follower.params()}

    def terms(self) -> dict[str, float]:
        """Measurement, error, integral, derivative and output (0..1) of the last computed tick."""
        integral = math.nan if self._integral is None else self._integral
        return {**self._terms, "integral": integral, "setpoint": self.setpoint}


def _reason(cap: int, current: int, e: float) -> str:
    if cap > current:
        return "below_setpoint" if e > 0 else "measurement_falling"
    if cap < current:
        return "above_setpoint" if e < 0 else "measurement_rising"
    return "steady"

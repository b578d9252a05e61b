"""The PID policy: drive the batch cap so a measured signal (KV usage or a latency) sits at a setpoint."""

from __future__ import annotations

import math

from policies.base import Decision, Observation, Policy, PolicyError, register
from policies.common import (
    KV_SOURCES,
    IdleTimer,
    check_cap_follower,
    check_choice,
    check_float,
    clamp,
    has_demand,
    idle_restore_due,
    is_stale,
    kv_signal,
    limit_for_cap,
)

TARGETS = ("kv_usage", "ttft_p99", "itl_p99")
DEFAULT_SETPOINTS = {"kv_usage": 0.9}


@register
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
        admission_limit = ceil(batch_cap * limit_factor) + limit_headroom

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
    way asked (rate limit; a change it dropped whole, as within its tolerance band, does not stop
    the integral, or the cap would never leave the band), or a raise held for lack of demand.

    Holds (both knobs None): "stale_stats"; "settling" (above the setpoint while more requests run
    than the cap allows: the previous cut is still taking effect, so neither P nor I acts on it);
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
    fraction of the setpoint); ``min_cap`` 1; ``demand_fraction`` 0.9; ``limit_factor`` 1.0;
    ``limit_headroom`` 2;
    ``stale_after_s`` 5.0; ``idle_restore_s`` 60.0: idle (nothing in flight or queued) that long, the
    cap goes back to ``max_num_seqs`` ("idle_restore") and the controller restarts bumpless from there
    (None: never).

    States: idle since; integral ``I`` (None until the first measurement), previous measurement and its time,
    the cap asked for at the previous tick.
    """

    name = "pid"
    param_names = tuple(
        "target setpoint kv_source output_scale kp ki kd deadband min_cap demand_fraction limit_factor "
        "limit_headroom stale_after_s idle_restore_s".split()
    )

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
        min_cap: int = 1,
        demand_fraction: float = 0.9,
        limit_factor: float = 1.0,
        limit_headroom: int = 2,
        stale_after_s: float = 5.0,
        idle_restore_s: float | None = 60.0,
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
        (
            self.min_cap,
            self.demand_fraction,
            self.limit_factor,
            self.limit_headroom,
            self.stale_after_s,
            self.idle_restore_s,
        ) = check_cap_follower(
            max_num_seqs,
            min_cap,
            demand_fraction,
            limit_factor,
            limit_headroom,
            stale_after_s,
            idle_restore_s,
        )
        self._idle = IdleTimer()
        self._integral: float | None = None
        self._prev: tuple[float, float] | None = None  # (now_mono, measurement)
        self._asked: int | None = None
        self._cap_seen: int | None = None
        self._terms = {"measurement": math.nan, "error": math.nan, "derivative": math.nan, "output": math.nan}

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        if is_stale(obs, self.stale_after_s):
            return self._hold("stale_stats", forget=True)
        idle_for = self._idle.update(obs, now_mono)
        if idle_restore_due(idle_for, self.idle_restore_s, obs.batch_cap, self.max_num_seqs):
            self._integral, self._prev, self._asked = None, None, None  # bumpless from the ceiling
            cap = self.max_num_seqs
            return Decision(limit_for_cap(cap, self.limit_factor, self.limit_headroom), cap, "idle_restore")
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
        integral, dt = self._start_integral(obs, e), self._dt(now_mono)
        d = self._derivative(m, dt)
        self._prev = (now_mono, m)
        saturated = self._saturated(obs, e, integral + self.kp * e + d)
        self._cap_seen = obs.batch_cap
        if dt is not None and not saturated:
            integral = clamp(integral + self.ki * e * dt, -self.kp, 1.0 + self.kp)
        u = clamp(self.kp * e + integral + d, 0.0, 1.0)
        cap = self._cap_for(u)
        self._terms = {"measurement": m, "error": e, "derivative": d, "output": u}
        if cap > obs.batch_cap and not has_demand(obs, obs.running, obs.batch_cap, self.demand_fraction):
            if e <= 0:  # a raise from D alone: the integral may still move down
                self._integral = integral
            return self._hold("no_demand", forget=False)
        self._integral, self._asked = integral, cap
        reason = _reason(cap, obs.batch_cap, e)
        return Decision(limit_for_cap(cap, self.limit_factor, self.limit_headroom), cap, reason)

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
        lo, hi = self.min_cap, self.max_num_seqs
        if self.output_scale == "log":
            ratio: float = (hi / lo) ** u
            return max(lo, min(hi, round(lo * ratio)))
        return lo + round(u * (hi - lo))

    def _u_for(self, cap: int) -> float:
        lo, hi = self.min_cap, self.max_num_seqs
        if hi == lo:
            return 0.0
        cap = max(lo, min(hi, cap))
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

    def _saturated(self, obs: Observation, e: float, u_raw: float) -> bool:
        """The output cannot move further the way the error pushes it (conditional integration)."""
        seen, asked, cap = self._cap_seen, self._asked, obs.batch_cap
        moved = seen is not None and cap != seen  # the normalize stage applied part of the last ask
        held_low = asked is not None and moved and cap < asked
        held_high = asked is not None and moved and cap > asked
        if e > 0:
            return u_raw > 1.0 or held_low
        return e < 0 and (u_raw < 0.0 or held_high)

    def _hold(self, reason: str, *, forget: bool) -> Decision:
        if forget:
            self._prev = None
        self._asked = None
        return Decision(None, None, reason)

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

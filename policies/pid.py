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
        e = r - deadband   if r > deadband          # below the band
            0              if -deadband_above <= r <= deadband   # on target: hold
            r              if r < -deadband_above   # above the band: the whole error
        I = clamp(I + ki * e * dt, -kp, 1 + kp)    # skipped while saturated (below)
        D = -kd * ((m - m_prev) / sp) / dt         # derivative on measurement, not on error
        u = clamp(kp * e + I + D, 0, 1)
        batch_cap = min_cap + round(u * (max_num_seqs - min_cap))      # output_scale = "linear"
        batch_cap = round(min_cap * (max_num_seqs / min_cap) ** u)    # output_scale = "log"
        admission_limit = ceil(batch_cap * limit_factor) + limit_headroom

    The error is relative, so the same gains suit KV usage and latencies. With ``output_scale = "log"``
    a step of ``u`` changes the cap by a fixed ratio: KV usage grows in proportion to the cap, so the
    loop gain no longer depends on how much KV each request takes (use it for KV targets; with
    ``kp`` 0.2 and a ceiling of 128, ``kp * e`` moves the cap by about the relative error ``e``).

    Deadband: the measurement is on target within ``sp * (1 - deadband) .. sp * (1 + deadband_above)``:
    hold ("within_deadband"), and ``I`` tracks the cap in force (``I = u(cap)``), so leaving the band
    starts from that cap whatever moved it. At steady load a noisy signal (KV usage's window max, a
    p99 latency) wanders, and integrating each excursion moves the cap up and down (on the real
    engine, without the band: 1, 6 and 8 direction changes a minute in three runs). The band is wide
    below the setpoint (a little under it costs a little throughput) and narrow above it (crossing it
    costs preemptions or the SLO); it should be wider than what one request adds to the measurement
    at the cap in force, or the integer cap cycles between the two caps around the setpoint. Below the
    band the band is subtracted (P stays continuous at its lower edge); above it the whole error acts,
    so a cut aims at the setpoint rather than at the band's edge.

    Dwell: after the cap moved, hold ("dwell") until ``dwell_s`` has passed (by default the
    Observation's window, ``[control] window_seconds``): the window max and percentiles still cover
    time before the move, and acting on them again would cut (or raise) twice for one excess. ``I``
    does not integrate during the dwell; the next tick integrates over one tick.

    A cap that does not bind: above the band with fewer requests running than the cap, any cut that
    stays above the running count changes nothing, and walking the integral down through those caps
    moved the cap every tick for a minute (tests/sim). So the cut starts from the running count:
    ``I = u(running)``, no integration on that tick, and ``u = u(running) + kp * e``, a cut of about
    the relative error from where the engine is; then ``I = u``, so that P, acting on what is left
    of the error at the next tick, does not give the cut back. Below the band, a cut (P falling as
    ``m`` rises) that stays at or above the running count is held ("cap_not_binding"; ``I``
    unchanged). The
    running count is read as the measurement is: the window's largest (``running_max``) for the KV
    max or mean and for latency percentiles, the last step's for ``kv_source = "latest"``, so a
    peak of the window is not set against a lull of its last step.

    The first tick starts bumpless: ``I = u(current cap) - kp * e``, no integration, no D.
    Anti-windup: ``I`` is clamped to [-kp, 1 + kp] (just enough to hold any output against the
    largest P term), and it is not integrated while the error pushes an output that cannot follow:
    ``kp*e + I + D`` beyond [0, 1], the loop's normalize stage having moved the cap only part of the
    way asked (rate limit; a change it dropped whole, as within its tolerance band, does not stop
    the integral, or the cap would never leave the band), or a raise held for lack of demand.

    Holds (both knobs None): "stale_stats"; "within_deadband"; "settling" (above the band while
    more requests run than the cap allows: the previous cut is still taking effect, so neither P nor I
    acts on it); "dwell"; "no_measurement" (no latency samples in the window; the next measurement
    starts a fresh dt and D); "no_demand" (a raise without requests queued in the gate and with
    ``running < demand_fraction * cap``); "cap_not_binding". Otherwise the decision carries both
    knobs and the reason says why the cap moves: "below_setpoint" (up), "above_setpoint" (down),
    "measurement_rising" (down although e >= 0: P or D), "measurement_falling" (up although e <= 0),
    "steady" (unchanged).

    Parameters (defaults): ``target`` "kv_usage" (or "ttft_p99", "itl_p99"); ``kv_source`` "max"
    (how KV usage is read: the window "max", its "mean", or the "latest" step; the max, because a
    burst's peak is what overflows the cache and preempts); ``output_scale`` "log" (or "linear");
    ``setpoint`` 0.9 for kv_usage, required (seconds) for latencies, e.g. the TPOT SLO for
    "itl_p99"; ``kp`` 0.2, ``ki`` 0.2 (per second), ``kd`` 0.0 (seconds); ``deadband`` 0.1 and
    ``deadband_above`` 0.03 (fractions of the setpoint); ``dwell_s`` None (the telemetry window; 0:
    no dwell); ``min_cap`` 1; ``demand_fraction`` 0.9; ``limit_factor`` 1.0; ``limit_headroom`` 2;
    ``stale_after_s`` 5.0; ``idle_restore_s`` 60.0: idle (nothing in flight or queued) that long, the
    cap goes back to ``max_num_seqs`` ("idle_restore") and the controller restarts bumpless from there
    (None: never).

    States: idle since; integral ``I`` (None until the first measurement), previous measurement and its
    time, the cap asked for at the previous tick, the cap in force at the previous tick and when the
    cap last moved (the dwell).
    """

    name = "pid"
    param_names = tuple(
        "target setpoint kv_source output_scale kp ki kd deadband deadband_above dwell_s min_cap "
        "demand_fraction limit_factor limit_headroom stale_after_s idle_restore_s".split()
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
        deadband_above: float = 0.03,
        dwell_s: float | None = None,
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
        self.deadband_above = check_float("deadband_above", deadband_above, 0.0, 0.99)
        self.dwell_s = None if dwell_s is None else check_float("dwell_s", dwell_s, 0.0)
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
        self._cap_seen: int | None = None  # the cap in force at the previous tick
        self._asked_at: float | None = None  # when the previous tick asked for a new cap
        self._moved_at: float | None = None  # when the cap last moved (start of the dwell)
        self._terms = {"measurement": math.nan, "error": math.nan, "derivative": math.nan, "output": math.nan}

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        seen = self._cap_seen
        self._cap_seen = obs.batch_cap
        if seen is not None and obs.batch_cap != seen:  # the cap moved since the previous tick
            self._moved_at = now_mono if self._asked_at is None else self._asked_at
        self._asked_at = None
        if is_stale(obs, self.stale_after_s):
            return self._hold("stale_stats", forget=True)
        idle_for = self._idle.update(obs, now_mono)
        if idle_restore_due(idle_for, self.idle_restore_s, obs.batch_cap, self.max_num_seqs):
            self._integral, self._prev, self._asked = None, None, None  # bumpless from the ceiling
            self._moved_at, self._cap_seen = None, self.max_num_seqs  # no dwell for the next load
            cap = self.max_num_seqs
            return Decision(limit_for_cap(cap, self.limit_factor, self.limit_headroom), cap, "idle_restore")
        m = self._measure(obs)
        if m is None:
            return self._hold("no_measurement", forget=True)
        r = clamp((self.setpoint - m) / self.setpoint, -1.0, 1.0)
        e = self._error(r)
        self._terms = {**self._terms, "measurement": m, "error": e}
        if e == 0.0:
            # On target: hold, and track the cap in force (P = 0, so u = I), so that leaving the band
            # starts from the cap in force, whatever moved it meanwhile.
            self._integral = self._u_for(obs.batch_cap)
            self._prev = (now_mono, m)
            return self._hold("within_deadband", forget=False)
        if e < 0 and obs.running > obs.batch_cap:
            # The last cut has not taken effect yet (lowering the cap never preempts: the requests
            # admitted before it run to completion). Integrating now would wind the cap down to the floor.
            return self._hold("settling", forget=True)
        dwell = self._dwell(obs)
        if dwell > 0 and self._moved_at is not None and now_mono - self._moved_at <= dwell:
            # The measurement (a window max or percentile) still covers time before the last move.
            self._prev = (now_mono, m)
            return self._hold("dwell", forget=False)
        integral, dt = self._start_integral(obs, e), self._dt(now_mono)
        running = self._running(obs)
        rebase = e < 0 and running < obs.batch_cap
        if rebase:
            # The cap does not bind: a cut to any value above the running count changes nothing, so
            # the cut starts from the running count (no integration on this tick).
            integral, dt = clamp(self._u_for(running), -self.kp, 1.0 + self.kp), None
        d = self._derivative(m, dt)
        self._prev = (now_mono, m)
        saturated = self._saturated(obs, seen, e, integral + self.kp * e + d)
        if dt is not None and not saturated:
            integral = clamp(integral + self.ki * e * dt, -self.kp, 1.0 + self.kp)
        u = clamp(self.kp * e + integral + d, 0.0, 1.0)
        cap = self._cap_for(u)
        self._terms = {"measurement": m, "error": e, "derivative": d, "output": u}
        if cap > obs.batch_cap and not has_demand(obs, obs.running, obs.batch_cap, self.demand_fraction):
            if e <= 0:  # a raise from D alone: the integral may still move down
                self._integral = integral
            return self._hold("no_demand", forget=False)
        if e > 0 and running <= cap < obs.batch_cap:
            # Below the setpoint, a cut that stays at or above the running count changes nothing in
            # the engine: hold, without keeping the integral (as for no_demand).
            return self._hold("cap_not_binding", forget=False)
        # After a cut from the running count the integral keeps the cut (I = u), so that P, acting on
        # what is left of the error at the next tick, does not give it back.
        self._integral, self._asked = (u if rebase else integral), cap
        if cap != obs.batch_cap:
            self._asked_at = now_mono
        reason = _reason(cap, obs.batch_cap, e)
        return Decision(limit_for_cap(cap, self.limit_factor, self.limit_headroom), cap, reason)

    def _error(self, r: float) -> float:
        """The relative error ``r`` less the deadband: 0 on target (``-deadband_above <= r <= deadband``);
        below the band the band is subtracted (P stays continuous at the lower edge), above it the
        whole error acts, so a cut aims at the setpoint rather than at the band's edge."""
        if r > self.deadband:
            return r - self.deadband
        return r if r < -self.deadband_above else 0.0

    def _running(self, obs: Observation) -> int:
        """The running count the measurement reflects: the window's largest for a window statistic
        (the KV max or mean, a latency percentile), the last step's for ``kv_source = "latest"``."""
        if (self.target == "kv_usage" and self.kv_source == "latest") or obs.running_max is None:
            return obs.running
        return max(obs.running, obs.running_max)

    def _dwell(self, obs: Observation) -> float:
        return obs.window_s if self.dwell_s is None else self.dwell_s

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

    def _saturated(self, obs: Observation, seen: int | None, e: float, u_raw: float) -> bool:
        """The output cannot move further the way the error pushes it (conditional integration)."""
        asked, cap = self._asked, obs.batch_cap
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

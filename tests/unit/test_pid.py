"""policies/pid.py: exact decisions over fake time; no wind-up; convergence on a toy engine."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest

from policies.base import Decision, Observation, PolicyError
from policies.pid import PidPolicy
from tests.helpers import obs

# max_num_seqs 65 and min_cap 1: the output u in [0, 1] spans 64 caps, cap = 1 + round(64 * u).
# Most tables pin a plain linear PID on the window mean (no deadband), where the arithmetic is easy
# to follow; the defaults (log output, window max, deadband) have their own tests at the end.
PLAIN = {
    "setpoint": 0.8, "kv_source": "mean", "output_scale": "linear", "kp": 0.3, "ki": 0.1, "deadband": 0.0,
}  # fmt: skip


def make(**params: Any) -> PidPolicy:
    return PidPolicy(max_num_seqs=65, initial_limit=34, **{**PLAIN, **params})


def at(now: float, **fields: Any) -> Observation:
    return obs(now_mono=now, max_num_seqs=65, **{"batch_cap": 33, "kv_usage_mean": 0.4, **fields})


def warmed(**params: Any) -> PidPolicy:
    """After one tick at cap 33 (u = 0.5) and KV 0.4: e = 0.5, I = 0.5 - 0.3 * 0.5 = 0.35."""
    policy = make(**params)
    decision = policy.decide(at(0.0), 0.0)
    assert (decision.batch_cap, decision.reason) == (33, "steady")
    return policy


CASES = [
    # (name, params, second tick at t = 1, decision)
    # u = 0.3 * 0.5 + (0.35 + 0.1 * 0.5) = 0.55 -> cap 36
    ("below_setpoint", {}, {"queued": 1}, Decision(38, 36, "below_setpoint")),
    ("running_near_cap_is_demand", {}, {"running": 30}, Decision(38, 36, "below_setpoint")),
    ("no_demand", {}, {"running": 29}, Decision(None, None, "no_demand")),
    # e = -0.25: I = 0.35 - 0.025 = 0.325, u = -0.075 + 0.325 = 0.25 -> cap 17
    ("above_setpoint", {}, {"kv_usage_mean": 1.0}, Decision(19, 17, "above_setpoint")),
    # e = 0: u = I = 0.35 -> cap 23; the measurement rose, so the P term fell
    ("measurement_rising", {}, {"kv_usage_mean": 0.8}, Decision(25, 23, "measurement_rising")),
    # e = 0.375, D = -2 * (0.1 / 0.8) / 1 = -0.25, I = 0.3875: u = 0.1125 + 0.3875 - 0.25 = 0.25 -> 17
    (
        "derivative_on_measurement",
        {"kd": 2.0},
        {"kv_usage_mean": 0.5},
        Decision(19, 17, "measurement_rising"),
    ),
    (
        "limit_mapping",
        {"limit_factor": 2.0, "limit_headroom": 0},
        {"queued": 1},
        Decision(72, 36, "below_setpoint"),
    ),
    ("stale", {}, {"stats_age_s": 5.5}, Decision(None, None, "stale_stats")),
]


@pytest.mark.parametrize(("params", "fields", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_second_tick_table(params: dict[str, Any], fields: dict[str, Any], expected: Decision) -> None:
    assert warmed(**params).decide(at(1.0, **fields), 1.0) == expected


def test_terms_follow_the_formula() -> None:
    policy = warmed()
    policy.decide(at(1.0, kv_usage_mean=1.0), 1.0)
    assert policy.terms() == pytest.approx(
        {
            "measurement": 1.0,
            "error": -0.25,
            "derivative": 0.0,
            "output": 0.25,
            "integral": 0.325,
            "setpoint": 0.8,
        }
    )


def test_sequence_up_down_and_no_demand_does_not_integrate() -> None:
    policy = warmed()
    steps: list[tuple[float, dict[str, Any], Decision, float]] = [
        # (now, fields, decision, integral after)
        (1.0, {"queued": 1}, Decision(38, 36, "below_setpoint"), 0.4),
        # e = -0.25: I = 0.4 - 0.025 = 0.375, u = 0.3 -> 20
        (2.0, {"batch_cap": 36, "kv_usage_mean": 1.0}, Decision(22, 20, "above_setpoint"), 0.375),
        # a raise wanted but nothing waits: hold, and the integral does not grow
        (3.0, {"batch_cap": 20, "running": 5}, Decision(None, None, "no_demand"), 0.375),
        (9.0, {"batch_cap": 20, "running": 5}, Decision(None, None, "no_demand"), 0.375),
        # demand is back: u = 0.15 + 0.375 + 0.1 * 0.5 * 1 = 0.575 -> 38
        (10.0, {"batch_cap": 20, "queued": 4}, Decision(40, 38, "below_setpoint"), 0.425),
    ]
    for now, fields, expected, integral in steps:
        assert policy.decide(at(now, **fields), now) == expected, now
        assert policy.terms()["integral"] == pytest.approx(integral), now


def test_no_wind_up_while_saturated() -> None:
    policy = make()
    # cap at its maximum (u = 1) and an empty KV cache for 100 s: e = 1, I = 1 - 0.3 = 0.7
    for t in range(100):
        assert (
            policy.decide(at(float(t), batch_cap=65, kv_usage_mean=0.0, queued=1), float(t)).batch_cap == 65
        )
    # one integration (u_raw = 1.0 is not beyond 1), then none: u_raw = 1.1
    assert policy.terms()["integral"] == pytest.approx(0.8)
    # overload: e = -0.25, I = 0.775, u = -0.075 + 0.775 = 0.7 -> cap 46 at once
    assert policy.decide(at(100.0, batch_cap=65, kv_usage_mean=1.0), 100.0) == Decision(
        48, 46, "above_setpoint"
    )


def test_no_wind_up_while_the_normalize_stage_rate_limits_the_cap() -> None:
    policy = warmed()
    assert policy.decide(at(1.0, queued=1), 1.0) == Decision(38, 36, "below_setpoint")
    # asked for 36, the loop's rate limit moved the cap only to 34 (the loop says so): no integration
    policy.applied(36, 34, 1.0)
    assert policy.decide(at(2.0, queued=1, batch_cap=34), 2.0) == Decision(38, 36, "below_setpoint")
    assert policy.terms()["integral"] == pytest.approx(0.4)


def test_a_change_dropped_by_the_tolerance_band_keeps_integrating() -> None:
    policy = warmed()
    assert policy.decide(at(1.0, queued=1), 1.0) == Decision(38, 36, "below_setpoint")
    # asked for 36, the loop applied nothing (within its tolerance band): the ask must grow out of
    # the band, so the integral goes on: I = 0.45, u = 0.6, cap = 1 + round(0.6 * 64) = 39
    policy.applied(34, 33, 1.0)
    assert policy.decide(at(2.0, queued=1), 2.0) == Decision(41, 39, "below_setpoint")
    assert policy.terms()["integral"] == pytest.approx(0.45)


def test_latency_target_and_missing_measurement() -> None:
    policy = make(target="ttft_p99", setpoint=0.5)
    steps = [
        (0.0, 0.25, Decision(35, 33, "steady")),  # e = 0.5, I = 0.35
        (1.0, None, Decision(None, None, "no_measurement")),
        # dt restarts after a gap: no integration, no D on this tick
        (5.0, 0.25, Decision(35, 33, "steady")),
        # e = clamp((0.5 - 1.5) / 0.5) = -1: I = 0.35 - 0.1 = 0.25, u = -0.3 + 0.25 < 0 -> cap 1
        (6.0, 1.5, Decision(3, 1, "above_setpoint")),
    ]
    for now, ttft, expected in steps:
        assert policy.decide(at(now, ttft_p99_s=ttft), now) == expected, now


def test_itl_target_reads_itl_p99() -> None:
    policy = make(target="itl_p99", setpoint=0.05)
    assert policy.decide(at(0.0, itl_p99_s=None), 0.0) == Decision(None, None, "no_measurement")
    assert policy.decide(at(1.0, itl_p99_s=0.025), 1.0) == Decision(35, 33, "steady")


def test_min_cap_equal_to_max_pins_the_cap() -> None:
    policy = make(min_cap=65)
    assert policy.decide(at(0.0, batch_cap=65), 0.0) == Decision(67, 65, "steady")
    assert policy.decide(at(1.0, batch_cap=65, kv_usage_mean=1.0), 1.0) == Decision(67, 65, "steady")


def test_converges_on_a_toy_engine_without_overshoot() -> None:
    """KV usage lags the cap (half of the gap per tick) and settles at cap / 100: setpoint 0.8 -> cap 80."""
    policy = PidPolicy(max_num_seqs=128, initial_limit=16, **PLAIN)
    cap, kv, caps = 16, 0.16, []
    for t in range(60):
        kv += 0.5 * (min(1.0, cap / 100) - kv)
        decision = policy.decide(
            obs(now_mono=t, batch_cap=cap, max_num_seqs=128, kv_usage_mean=kv, queued=1), t
        )
        cap = decision.batch_cap if decision.batch_cap is not None else cap
        caps.append(cap)
    assert caps[:6] == [16, 26, 33, 39, 43, 48]
    assert max(caps) == 80
    assert caps[-15:] == [80] * 15


def test_params() -> None:
    assert make().params() == {
        "target": "kv_usage",
        "setpoint": 0.8,
        "kv_source": "mean",
        "output_scale": "linear",
        "kp": 0.3,
        "ki": 0.1,
        "kd": 0.0,
        "deadband": 0.0,
        "min_cap": 1,
        "demand_fraction": 0.9,
        "limit_factor": 1.0,
        "limit_headroom": 2,
        "stale_after_s": 5.0,
        "idle_restore_s": 60.0,
    }
    defaults = PidPolicy(max_num_seqs=8, initial_limit=8).params()
    assert {k: defaults[k] for k in ("setpoint", "kv_source", "output_scale", "kp", "ki", "deadband")} == {
        "setpoint": 0.9,
        "kv_source": "max",
        "output_scale": "log",
        "kp": 0.2,
        "ki": 0.2,
        "deadband": 0.1,
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"target": "ttft_p50"}, "target = 'ttft_p50': must be one of 'kv_usage', 'ttft_p99', 'itl_p99'"),
        ({"target": "ttft_p99", "setpoint": None}, "target = 'ttft_p99' needs a setpoint (seconds)"),
        ({"setpoint": 1.5}, "setpoint = 1.5: out of range; use a value in (0.0, 1.0]"),
        ({"setpoint": 0}, "setpoint = 0: out of range; use a value in (0.0, 1.0]"),
        ({"kp": -1}, "kp = -1: out of range; use a value >= 0.0"),
        ({"deadband": 1.0}, "deadband = 1.0: out of range; use a value in [0.0, 0.99]"),
        ({"min_cap": 0}, "min_cap = 0: out of range; use a value in [1, 65]"),
        ({"limit_headroom": -1}, "limit_headroom = -1: out of range; use a value >= 0"),
    ],
)
def test_bad_params(params: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(message)):
        make(**params)


def test_idle_restore_returns_to_the_ceiling_and_restarts_bumpless() -> None:
    p = PidPolicy(max_num_seqs=64, initial_limit=64, idle_restore_s=10.0, **PLAIN)
    idle = obs(batch_cap=8, admission_limit=10, in_flight=0, queued=0, running=0, kv_usage_mean=0.0)
    assert p.decide(idle, 0.0).reason != "idle_restore"
    assert p.decide(idle, 10.0) == Decision(66, 64, "idle_restore")
    # the next measurement starts from the cap in force (64), not from the old integral
    steady = obs(
        batch_cap=64, admission_limit=66, in_flight=10, running=10, kv_usage_mean=0.85, stats_age_s=0.1
    )
    assert p.decide(steady, 11.0) == Decision(66, 64, "steady")


def test_log_output_scale_maps_u_to_a_ratio_of_the_cap() -> None:
    p = PidPolicy(max_num_seqs=64, initial_limit=64, output_scale="log")
    assert [p._cap_for(u) for u in (0.0, 0.5, 1.0)] == [1, 8, 64]
    assert p._u_for(8) == 0.5
    # bumpless start from the cap in force, at the setpoint: no move
    at_sp = obs(batch_cap=8, admission_limit=10, in_flight=8, running=8, kv_usage_max=0.9, stats_age_s=0.1)
    assert p.decide(at_sp, 0.0) == Decision(10, 8, "steady")


# The defaults: setpoint 0.9 on the window max of KV usage, log output (max_num_seqs 64: cap = 64 ** u),
# kp = ki = 0.2, deadband 0.1 (KV max 0.81..0.9 is on target). Warmed at cap 8 (u = 0.5), KV max 0.9.
DEFAULT_CASES = [
    # r = 0.056, inside the band: e = 0, I and u stay 0.5
    ("within_deadband", {"kv_usage_max": 0.85, "queued": 1}, Decision(10, 8, "steady"), 0.5),
    # r = 0.5, e = 0.4: I = 0.5 + 0.2 * 0.4 = 0.58, u = 0.08 + 0.58 = 0.66, 64 ** 0.66 = 15.6
    ("below_the_band", {"kv_usage_max": 0.45, "queued": 1}, Decision(18, 16, "below_setpoint"), 0.58),
    # above the setpoint the whole error acts: e = -1/9, I = 0.4778, u = 0.4556, 64 ** 0.4556 = 6.7
    ("above_setpoint", {"kv_usage_max": 1.0}, Decision(9, 7, "above_setpoint"), 0.4778),
    # the window mean is not what the default reads
    ("reads_the_max", {"kv_usage_mean": 1.0, "kv_usage_max": 0.88}, Decision(10, 8, "steady"), 0.5),
]


@pytest.mark.parametrize(
    ("fields", "expected", "integral"), [c[1:] for c in DEFAULT_CASES], ids=[c[0] for c in DEFAULT_CASES]
)
def test_defaults_second_tick_table(fields: dict[str, Any], expected: Decision, integral: float) -> None:
    p = PidPolicy(max_num_seqs=64, initial_limit=64)
    base = {"batch_cap": 8, "admission_limit": 10, "in_flight": 8, "running": 8, "kv_usage_max": 0.9}
    assert p.decide(obs(**base), 0.0) == Decision(10, 8, "steady")
    assert p.decide(obs(**{**base, "now_mono": 1.0, **fields}), 1.0) == expected
    assert p.terms()["integral"] == pytest.approx(integral, abs=1e-4)


def test_deadband_holds_the_cap_under_noise_that_moves_it_without() -> None:
    """KV max wandering in 0.82..0.90 (inside the band) at steady load, one tick a second for a minute."""
    noise = [0.82, 0.9, 0.86, 0.84, 0.88, 0.83]

    def caps(deadband: float) -> list[int]:
        p = PidPolicy(max_num_seqs=64, initial_limit=64, deadband=deadband)
        cap, out = 8, []
        for t in range(60):
            o = obs(batch_cap=cap, admission_limit=cap + 2, in_flight=cap, running=cap, queued=1,
                    kv_usage_max=noise[t % len(noise)], now_mono=float(t))  # fmt: skip
            cap = p.decide(o, float(t)).batch_cap or cap
            out.append(cap)
        return out

    assert caps(0.1) == [8] * 60
    without = caps(0.0)
    assert without[:8] == [8, 7, 8, 9, 8, 9, 10, 10]
    moves = [b - a for a, b in itertools.pairwise(without) if b != a]
    assert sum((x > 0) != (y > 0) for x, y in itertools.pairwise(moves)) == 23


def test_a_cut_in_force_holds_further_cuts_for_one_window() -> None:
    """The window max still shows the peak from before a cut: within one window of it pid holds,
    then acts on what the window shows; a raise is never held, and "latest" KV has no dwell."""

    def warmed_on(source: str, field: str) -> PidPolicy:
        """As ``warmed``, reading KV by ``source``: e = 0.5, I = 0.35 at cap 33."""
        policy = make(kv_source=source)
        assert policy.decide(at(0.0, **{field: 0.4}), 0.0) == Decision(35, 33, "steady")
        return policy

    policy = warmed_on("max", "kv_usage_max")
    over = {"kv_usage_max": 1.0, "window_s": 3.0, "running": 17}
    # e = -0.25: I = 0.35 - 0.025 = 0.325, u = 0.25 -> cap 17 (the table's above_setpoint case)
    assert policy.decide(at(1.0, **over), 1.0) == Decision(19, 17, "above_setpoint")
    policy.applied(19, 17, 1.0)  # the cut is in force
    for now in (1.5, 2.0, 3.5):
        assert policy.decide(at(now, batch_cap=17, **over), now) == Decision(None, None, "cut_dwell")
    assert policy.terms()["integral"] == pytest.approx(0.325)  # no integration while it dwells
    # one window after the cut: a fresh dt (the dwell forgot it), so P alone on I: u = -0.075 + 0.325
    assert policy.decide(at(4.0, batch_cap=17, **over), 4.0) == Decision(19, 17, "steady")
    assert policy.decide(at(4.5, batch_cap=17, **over), 4.5).reason == "above_setpoint"
    # below the setpoint the dwell does not apply: a raise goes through at once
    raised = warmed_on("max", "kv_usage_max")
    assert raised.decide(at(1.0, **over), 1.0).reason == "above_setpoint"
    raised.applied(19, 17, 1.0)
    assert raised.decide(at(1.5, batch_cap=17, kv_usage_max=0.2, queued=1, window_s=3.0), 1.5).reason == (
        "below_setpoint"
    )
    latest = warmed_on("latest", "kv_usage")
    assert latest.decide(at(1.0, kv_usage=1.0, window_s=3.0), 1.0) == Decision(19, 17, "above_setpoint")
    latest.applied(19, 17, 1.0)
    assert (
        latest.decide(at(1.5, batch_cap=17, running=17, kv_usage=1.0, window_s=3.0), 1.5).reason
        == "above_setpoint"
    )

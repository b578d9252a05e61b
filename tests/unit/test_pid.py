"""policies/pid.py: exact decisions over fake time; no wind-up; convergence on a toy engine."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from typing import Any

import pytest

from policies.base import Decision, Observation, PolicyError
from policies.pid import PidPolicy
from tests.unit.obs import obs

# max_num_seqs 65 and min_cap 1: the output u in [0, 1] spans 64 caps, cap = 1 + round(64 * u).
# Most tables pin a plain linear PID on the window mean (no deadband, no dwell) with the cap binding
# (running = cap), where the arithmetic is easy to follow; the defaults (log output, window max,
# deadband, dwell) and the non-binding cap have their own tests at the end.
PLAIN = {
    "setpoint": 0.8, "kv_source": "mean", "output_scale": "linear", "kp": 0.3, "ki": 0.1, "deadband": 0.0,
    "deadband_above": 0.0, "dwell_s": 0.0,
}  # fmt: skip


def make(**params: Any) -> PidPolicy:
    return PidPolicy(max_num_seqs=65, initial_limit=34, **{**PLAIN, **params})


def at(now: float, **fields: Any) -> Observation:
    return obs(
        now_mono=now, max_num_seqs=65, **{"batch_cap": 33, "running": 33, "kv_usage_mean": 0.4, **fields}
    )


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
    # e = 0.125: I = 0.3625, u = 0.0375 + 0.3625 = 0.4 -> cap 27; the measurement rose, so P fell
    ("measurement_rising", {}, {"kv_usage_mean": 0.7}, Decision(29, 27, "measurement_rising")),
    # e = 0 (the band is the setpoint alone here): on target, hold
    ("at_setpoint", {}, {"kv_usage_mean": 0.8}, Decision(None, None, "within_deadband")),
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
        (
            2.0,
            {"batch_cap": 36, "running": 36, "kv_usage_mean": 1.0},
            Decision(22, 20, "above_setpoint"),
            0.375,
        ),
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
            policy.decide(
                at(float(t), batch_cap=65, running=65, kv_usage_mean=0.0, queued=1), float(t)
            ).batch_cap
            == 65
        )
    # one integration (u_raw = 1.0 is not beyond 1), then none: u_raw = 1.1
    assert policy.terms()["integral"] == pytest.approx(0.8)
    # overload: e = -0.25, I = 0.775, u = -0.075 + 0.775 = 0.7 -> cap 46 at once
    assert policy.decide(at(100.0, batch_cap=65, running=65, kv_usage_mean=1.0), 100.0) == Decision(
        48, 46, "above_setpoint"
    )


def test_no_wind_up_while_the_normalize_stage_rate_limits_the_cap() -> None:
    policy = warmed()
    assert policy.decide(at(1.0, queued=1), 1.0) == Decision(38, 36, "below_setpoint")
    # asked for 36, the loop's rate limit moved the cap only to 34: no integration
    assert policy.decide(at(2.0, queued=1, batch_cap=34), 2.0) == Decision(38, 36, "below_setpoint")
    assert policy.terms()["integral"] == pytest.approx(0.4)


def test_a_change_dropped_by_the_tolerance_band_keeps_integrating() -> None:
    policy = warmed()
    assert policy.decide(at(1.0, queued=1), 1.0) == Decision(38, 36, "below_setpoint")
    # asked for 36, the loop applied nothing (within its tolerance band): the ask must grow out of
    # the band, so the integral goes on: I = 0.45, u = 0.6, cap = 1 + round(0.6 * 64) = 39
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
        "deadband_above": 0.0,
        "dwell_s": 0.0,
        "min_cap": 1,
        "demand_fraction": 0.9,
        "limit_factor": 1.0,
        "limit_headroom": 2,
        "stale_after_s": 5.0,
        "idle_restore_s": 60.0,
    }
    defaults = PidPolicy(max_num_seqs=8, initial_limit=8).params()
    keys = ("setpoint", "kv_source", "output_scale", "kp", "ki", "deadband", "deadband_above", "dwell_s")
    assert {k: defaults[k] for k in keys} == {
        "setpoint": 0.9,
        "kv_source": "max",
        "output_scale": "log",
        "kp": 0.2,
        "ki": 0.2,
        "deadband": 0.1,
        "deadband_above": 0.03,
        "dwell_s": None,
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"target": "ttft_p50"}, "target = 'ttft_p50': use one of 'kv_usage', 'ttft_p99', 'itl_p99'"),
        ({"target": "ttft_p99", "setpoint": None}, "target = 'ttft_p99' needs a setpoint (seconds)"),
        ({"setpoint": 1.5}, "setpoint = 1.5: must be > 0.0 and <= 1.0"),
        ({"setpoint": 0}, "setpoint = 0: must be > 0.0"),
        ({"kp": -1}, "kp = -1: must be >= 0.0"),
        ({"deadband": 1.0}, "deadband = 1.0: must be >= 0.0 and <= 0.99"),
        ({"min_cap": 0}, "min_cap = 0: must be >= 1 and <= 65"),
        ({"limit_headroom": -1}, "limit_headroom = -1: must be >= 0"),
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
        batch_cap=64, admission_limit=66, in_flight=64, running=64, kv_usage_mean=0.85, stats_age_s=0.1
    )
    assert p.decide(steady, 11.0) == Decision(66, 64, "steady")


def test_log_output_scale_maps_u_to_a_ratio_of_the_cap() -> None:
    p = PidPolicy(max_num_seqs=64, initial_limit=64, output_scale="log")
    assert [p._cap_for(u) for u in (0.0, 0.5, 1.0)] == [1, 8, 64]
    assert p._u_for(8) == 0.5
    # at the setpoint: on target, no move
    at_sp = obs(batch_cap=8, admission_limit=10, in_flight=8, running=8, kv_usage_max=0.9, stats_age_s=0.1)
    assert p.decide(at_sp, 0.0) == Decision(None, None, "within_deadband")


# The defaults: setpoint 0.9 on the window max of KV usage, log output (max_num_seqs 64: cap = 64 ** u),
# kp = ki = 0.2, deadband 0.1 and deadband_above 0.03 (KV max 0.81..0.927 is on target: hold, I tracks
# the cap in force). Warmed at cap 8 (u = 0.5), KV max 0.9, the cap binding (running 8).
DEFAULT_CASES = [
    # r = 0.056, inside the band: e = 0, hold; I stays u(8) = 0.5
    ("within_deadband", {"kv_usage_max": 0.85, "queued": 1}, Decision(None, None, "within_deadband"), 0.5),
    # r = -0.022: above the setpoint but within deadband_above
    ("within_deadband_above", {"kv_usage_max": 0.92}, Decision(None, None, "within_deadband"), 0.5),
    # r = 0.5, e = 0.4: I = 0.5 + 0.2 * 0.4 = 0.58, u = 0.08 + 0.58 = 0.66, 64 ** 0.66 = 15.6
    ("below_the_band", {"kv_usage_max": 0.45, "queued": 1}, Decision(18, 16, "below_setpoint"), 0.58),
    # above the setpoint the whole error acts: e = -1/9, I = 0.4778, u = 0.4556, 64 ** 0.4556 = 6.7
    ("above_setpoint", {"kv_usage_max": 1.0}, Decision(9, 7, "above_setpoint"), 0.4778),
    # the window mean is not what the default reads
    (
        "reads_the_max",
        {"kv_usage_mean": 1.0, "kv_usage_max": 0.88},
        Decision(None, None, "within_deadband"),
        0.5,
    ),
]


@pytest.mark.parametrize(
    ("fields", "expected", "integral"), [c[1:] for c in DEFAULT_CASES], ids=[c[0] for c in DEFAULT_CASES]
)
def test_defaults_second_tick_table(fields: dict[str, Any], expected: Decision, integral: float) -> None:
    p = PidPolicy(max_num_seqs=64, initial_limit=64)
    base = {"batch_cap": 8, "admission_limit": 10, "in_flight": 8, "running": 8, "kv_usage_max": 0.9}
    assert p.decide(obs(**base), 0.0) == Decision(None, None, "within_deadband")
    assert p.decide(obs(**{**base, "now_mono": 1.0, **fields}), 1.0) == expected
    assert p.terms()["integral"] == pytest.approx(integral, abs=1e-4)


def test_deadband_holds_the_cap_under_noise_that_moves_it_without() -> None:
    """KV max wandering in 0.82..0.89 (inside the band) at steady load, one tick a second for a minute."""
    noise = [0.82, 0.89, 0.86, 0.84, 0.88, 0.83]

    def caps(deadband: float) -> list[int]:
        p = PidPolicy(max_num_seqs=64, initial_limit=64, deadband=deadband, deadband_above=0.0, dwell_s=0.0)
        cap, out = 8, []
        for t in range(60):
            o = obs(batch_cap=cap, admission_limit=cap + 2, in_flight=cap, running=cap, queued=1,
                    kv_usage_max=noise[t % len(noise)], now_mono=float(t))  # fmt: skip
            cap = p.decide(o, float(t)).batch_cap or cap
            out.append(cap)
        return out

    assert caps(0.1) == [8] * 60
    without = caps(0.0)
    assert without[:8] == [8, 8, 8, 9, 9, 10, 10, 10]
    moves = [b - a for a, b in itertools.pairwise(without) if b != a]
    assert sum((x > 0) != (y > 0) for x, y in itertools.pairwise(moves)) == 20


def test_dwell_holds_for_a_window_after_a_move() -> None:
    """The window max still holds the peak that caused a cut: no second cut on it until a window
    (the Observation's, 10 s) has passed since the move; then the fresh max acts."""
    p = PidPolicy(max_num_seqs=64, initial_limit=64)
    base = {"batch_cap": 8, "admission_limit": 10, "in_flight": 8, "running": 8, "kv_usage_max": 0.9}
    assert p.decide(obs(**base), 0.0).reason == "within_deadband"
    assert p.decide(obs(**{**base, "now_mono": 1.0, "kv_usage_max": 1.0}), 1.0) == Decision(
        9, 7, "above_setpoint"
    )
    after = {**base, "batch_cap": 7, "admission_limit": 9, "running": 7, "kv_usage_max": 1.0}
    for t in range(2, 12):  # the cut was asked at t = 1: held through t = 11
        assert p.decide(obs(**{**after, "now_mono": float(t)}), float(t)) == Decision(None, None, "dwell"), t
    # the integral did not move during the dwell: one tick of it, I = 0.4778 - 0.0222 = 0.4556,
    # u = -0.0222 + 0.4556 = 0.4333, 64 ** 0.4333 = 6.06
    assert p.decide(obs(**{**after, "now_mono": 12.0}), 12.0) == Decision(8, 6, "above_setpoint")
    assert p.terms()["integral"] == pytest.approx(0.4556, abs=1e-4)


def test_dwell_s_overrides_the_window_and_zero_turns_it_off() -> None:
    base = {"batch_cap": 8, "admission_limit": 10, "in_flight": 8, "running": 8, "kv_usage_max": 0.9}
    for dwell_s, second in ((3.0, "dwell"), (0.0, "above_setpoint")):
        p = PidPolicy(max_num_seqs=64, initial_limit=64, dwell_s=dwell_s)
        assert p.decide(obs(**base), 0.0).reason == "within_deadband"
        assert p.decide(obs(**{**base, "now_mono": 1.0, "kv_usage_max": 1.0}), 1.0).reason == "above_setpoint"
        moved = {**base, "batch_cap": 7, "running": 7, "kv_usage_max": 1.0}
        assert p.decide(obs(**{**moved, "now_mono": 2.0}), 2.0).reason == second
        if dwell_s:
            assert p.decide(obs(**{**moved, "now_mono": 4.0}), 4.0).reason == "dwell"
            assert p.decide(obs(**{**moved, "now_mono": 5.0}), 5.0).reason == "above_setpoint"


def test_a_cut_of_a_cap_that_does_not_bind_starts_from_the_running_count() -> None:
    """Cap 64, 20 running, KV max 0.99: any cap from 20 to 63 changes nothing. The cut starts from
    the running count (bumpless there, no integration on this tick): e = -0.1, u(20) = 0.7203,
    u = 0.7203 - 0.02 = 0.7003, 64 ** 0.7003 = 18.4. Without it: 64 ** (1 - 0.02 - 0.02) = 54.
    The integral keeps the cut (I = u), so P does not give it back while the error shrinks."""
    p = PidPolicy(max_num_seqs=64, initial_limit=64)
    o = obs(batch_cap=64, admission_limit=66, in_flight=20, running=20, kv_usage_max=0.99)
    assert p.decide(o, 0.0) == Decision(20, 18, "above_setpoint")
    assert p.terms()["integral"] == pytest.approx(0.7003, abs=1e-4)


def test_the_cut_starts_from_the_running_count_of_the_window_the_measurement_covers() -> None:
    """The KV max comes from the window's peak (20 running); its last step is a lull (5 running).
    The cut starts from the peak's 20, as above, not from 5; with kv_source = "latest" the KV and
    the running count are both the last step's."""
    o = obs(batch_cap=64, admission_limit=66, in_flight=20, running=5, running_max=20, kv_usage_max=0.99)
    assert PidPolicy(max_num_seqs=64, initial_limit=64).decide(o, 0.0) == Decision(20, 18, "above_setpoint")
    latest = PidPolicy(max_num_seqs=64, initial_limit=64, kv_source="latest")
    assert latest.decide(replace(o, kv_usage=0.99), 0.0) == Decision(7, 5, "above_setpoint")  # 5 * 0.92


def test_a_cut_below_the_setpoint_that_does_not_bind_is_held() -> None:
    """Below the setpoint the P term falls as the measurement rises; a cut that stays above the
    running count changes nothing in the engine: hold, and the integral stays."""
    policy = warmed()  # I = 0.35
    # e = 0.125: u = 0.0375 + 0.3625 = 0.4 -> cap 27, still above the 20 running
    assert policy.decide(at(1.0, kv_usage_mean=0.7, running=20), 1.0) == Decision(
        None, None, "cap_not_binding"
    )
    assert policy.terms()["integral"] == pytest.approx(0.35)


def test_holds_at_a_load_just_above_the_setpoint() -> None:
    """A steady load whose KV max sits at 0.91 (setpoint 0.9) with 24 requests running, whatever the
    cap above them (0.87 once the cap holds them to 23): with the band above the setpoint the cap
    holds; without it the cap goes below the running count and throttles the load."""

    def caps(**params: Any) -> list[int]:
        p = PidPolicy(max_num_seqs=128, initial_limit=128, **params)
        cap, out = 128, []
        for t in range(60):
            kv = 0.91 if cap >= 24 else 0.87
            o = obs(batch_cap=cap, admission_limit=cap + 2, max_num_seqs=128, in_flight=24,
                    running=min(24, cap), kv_usage_max=kv, now_mono=float(t))  # fmt: skip
            cap = p.decide(o, float(t)).batch_cap or cap
            out.append(cap)
        return out

    assert caps() == [128] * 60
    assert caps(deadband_above=0.0)[-1] < 24

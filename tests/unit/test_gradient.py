"""policies/gradient.py: the baseline state machine and the gradient update, exact numbers."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from policies.base import Decision, Observation, PolicyError
from policies.gradient import MEASURING, NORMAL, GradientPolicy
from tests.helpers import obs

# Most tables pin the plain Gradient2 update, one per tick (no dwell, no minimum change), where the
# arithmetic is easy to follow; the defaults (dwell, min_change) have their own tests at the end.
PLAIN = {"dwell_s": 0.0, "min_change": 0.0}


def make(**params: Any) -> GradientPolicy:
    return GradientPolicy(max_num_seqs=64, initial_limit=64, **{**PLAIN, **params})


def at(now: float, ttft: float | None, **fields: Any) -> Observation:
    """A busy engine at admission limit 64 (in_flight 64: demand) with TTFT p50 ``ttft``."""
    return obs(now_mono=now, ttft_p50_s=ttft, **{"admission_limit": 64, "in_flight": 64, **fields})


def measured(**params: Any) -> GradientPolicy:
    """Baseline 0.25 s, measured over t = 0..10; the limit is back at 64 (the loop applied it at 10)."""
    policy = make(**params)
    for now, ttft in ((0.0, 0.5), (5.0, 0.25), (10.0, 0.3)):
        decision = policy.decide(at(now, ttft, admission_limit=4), now)
        policy.applied(decision.admission_limit or 4, 32, now)
    assert decision.reason == "baseline_measured"
    assert policy.state == NORMAL
    return policy


def test_baseline_measurement_cycle() -> None:
    policy = make(baseline_window_s=10.0, baseline_interval_s=300.0)
    steps = [
        # (now, sample, limit in force, decision)
        (0.0, 0.5, 64, Decision(4, None, "measuring_baseline")),
        (5.0, 0.25, 4, Decision(4, None, "measuring_baseline")),
        (10.0, 0.3, 4, Decision(64, None, "baseline_measured")),  # min sample 0.25; back to 64
        # g = 1: L' = 64 + 8 = 72, L = 0.8 * 64 + 0.2 * 72 = 65.6
        (11.0, 0.25, 64, Decision(65, None, "latency_ok")),
        (309.0, 0.25, 65, Decision(67, None, "latency_ok")),  # L = 0.8 * 65.6 + 0.2 * (65.6 + 8.1) = 67.2
        (310.0, 0.25, 67, Decision(4, None, "measuring_baseline")),  # 300 s after the last baseline
        (315.0, None, 4, Decision(4, None, "measuring_baseline")),
        (320.0, 0.5, 4, Decision(67, None, "baseline_measured")),  # the new baseline is 0.25 again
    ]
    for now, ttft, limit, expected in steps:
        assert policy.decide(at(now, ttft, admission_limit=limit), now) == expected, now
    assert policy.terms()["baseline_s"] == 0.25


def test_measuring_waits_for_a_sample() -> None:
    policy = make()
    for now in (0.0, 10.0, 60.0):
        decision = policy.decide(at(now, None, in_flight=0, admission_limit=4), now)
        assert decision == Decision(4, None, "measuring_baseline")
    assert policy.decide(at(61.0, 0.4, admission_limit=4), 61.0) == Decision(64, None, "baseline_measured")
    assert policy.terms()["baseline_s"] == 0.4


CASES = [
    # (name, params, sample, fields, decision); baseline 0.25, tolerance 0.5, L = 64
    ("latency_ok", {}, 0.25, {}, Decision(65, None, "latency_ok")),  # 65.6
    # g = 0.375 / 0.75 = 0.5: L' = 32 + 8 = 40, L = 51.2 + 8 = 59.2
    ("latency_high", {}, 0.75, {}, Decision(59, None, "latency_high")),
    ("gradient_floor", {}, 3.0, {}, Decision(59, None, "latency_high")),  # g clamped to 0.5
    # g = 0.75: L' = 48 + 8 = 56, L = 51.2 + 11.2 = 62.4
    ("gradient_between", {}, 0.5, {}, Decision(62, None, "latency_high")),
    ("within_tolerance", {}, 0.375, {}, Decision(65, None, "latency_ok")),
    ("tolerance", {"tolerance": 0.0}, 0.375, {}, Decision(61, None, "latency_high")),  # g = 2/3
    ("smoothing", {"smoothing": 1.0}, 0.25, {}, Decision(72, None, "latency_ok")),
    ("no_demand", {}, 0.25, {"in_flight": 57}, Decision(None, None, "no_demand")),
    ("queue_is_demand", {}, 0.25, {"in_flight": 10, "queued": 1}, Decision(65, None, "latency_ok")),
    # the limit (64) does not bind 10 requests in flight: the cut starts from 10;
    # L' = 5 + 3.16, L = 8 + 1.63 = 9.63
    ("cut_from_in_flight", {}, 0.75, {"in_flight": 10}, Decision(9, None, "latency_high")),
    ("no_measurement", {}, None, {}, Decision(None, None, "no_measurement")),
    ("stale", {}, 0.25, {"stats_age_s": 9.0}, Decision(None, None, "stale_stats")),
    ("max_limit", {"max_limit": 65}, 0.25, {}, Decision(65, None, "latency_ok")),
    ("cap_follows_limit", {"cap_follows_limit": True}, 0.25, {}, Decision(65, 64, "latency_ok")),
    # the loop applied 40, not 64: L restarts at 40; L' = 40 + 6.32, L = 32 + 9.26 = 41.26
    (
        "follows_applied_limit",
        {},
        0.25,
        {"admission_limit": 40, "in_flight": 40},
        Decision(41, None, "latency_ok"),
    ),
]


@pytest.mark.parametrize(
    ("params", "sample", "fields", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_normal_state_table(
    params: dict[str, Any], sample: float | None, fields: dict[str, Any], expected: Decision
) -> None:
    assert measured(**params).decide(at(11.0, sample, **fields), 11.0) == expected


def test_latency_selects_the_sample() -> None:
    policy = make(latency="itl_p99")
    assert policy.decide(at(0.0, 9.0, itl_p99_s=0.02), 0.0).reason == "measuring_baseline"
    assert policy.decide(at(10.0, 9.0, itl_p99_s=0.03), 10.0).reason == "baseline_measured"
    assert policy.terms()["baseline_s"] == 0.02


def test_settles_where_latency_growth_balances_the_headroom() -> None:
    """TTFT grows with the limit above 32 (g = 48 / L): L * g + sqrt(L) = L settles at L = 55.9.

    The applied limit then moves 55 <-> 56 every tick: the normalize stage's tolerance or
    stabilisation window is what keeps such chatter out of the decision log."""
    policy = measured()
    limit, limits = 64, []
    for t in range(11, 200):
        ttft = 0.25 * max(1.0, limit / 32)
        decision = policy.decide(at(float(t), ttft, admission_limit=limit, in_flight=limit), float(t))
        limit = decision.admission_limit if decision.admission_limit is not None else limit
        limits.append(limit)
    assert limits[:5] == [62, 61, 60, 59, 58]
    assert set(limits[-50:]) == {55, 56}
    assert policy.terms()["limit_estimate"] == pytest.approx(55.9, abs=0.2)


def test_defaults_hold_still_where_the_plain_update_chatters() -> None:
    """The toy above (L settles at 55.9) with the defaults: one update per window (dwell_s None: the
    Observation's 10 s), and the limit moves only once the estimate is 10 % away from it. The limit
    steps between the integers around 55.9 that the band allows, once every few minutes, instead of
    every tick."""
    policy = GradientPolicy(max_num_seqs=64, initial_limit=64)
    for now, ttft in ((0.0, 0.5), (5.0, 0.25), (10.0, 0.3)):
        decision = policy.decide(at(now, ttft, admission_limit=4), now)
        policy.applied(decision.admission_limit or 4, 32, now)  # as the loop does after each tick
    limit, moves, reasons = 64, [], set()
    for t in range(11, 600):
        ttft = 0.25 * max(1.0, limit / 32)
        decision = policy.decide(at(float(t), ttft, admission_limit=limit, in_flight=limit), float(t))
        reasons.add(decision.reason)
        if decision.admission_limit is not None and decision.admission_limit != limit:
            moves.append((t, limit, decision.admission_limit, decision.reason))
        limit = decision.admission_limit if decision.admission_limit is not None else limit
        policy.applied(limit, 32, float(t))
    assert {"dwell", "below_min_change"} <= reasons
    # t = 11..20: dwell after the baseline window (the limit went 4 -> 64 at t = 10); updates at
    # t = 21, 32, 43 stay within 6.4 of 64; the one at t = 54 is not
    assert moves[0] == (54, 64, 57, "latency_high")
    assert [m[3] for m in moves[1:3]] == ["measuring_baseline", "baseline_measured"]  # t = 310, 320
    # between the integers around 55.9, twice in the next four and a half minutes
    assert moves[3:] == [(430, 52, 58, "latency_high"), (573, 58, 52, "latency_high")]


def test_a_change_below_min_change_accumulates_in_the_estimate() -> None:
    policy = measured(dwell_s=0.0, min_change=0.1)
    # g = 1: L = 65.6; floor 65 is 1 away from 64, less than 6.4: hold, the estimate keeps it
    assert policy.decide(at(11.0, 0.25), 11.0) == Decision(None, None, "below_min_change")
    assert policy.terms()["limit_estimate"] == pytest.approx(65.6)
    estimates = []
    for t in range(12, 16):
        decision = policy.decide(at(float(t), 0.25), float(t))
        estimates.append(policy.terms()["limit_estimate"])
    # 67.2, 68.9, 70.5 (held), then 72.2: floor 72 is 8 away from 64
    assert estimates == pytest.approx([67.22, 68.86, 70.52, 72.2], abs=0.01)
    assert decision == Decision(72, None, "latency_ok")


def test_dwell_waits_after_each_move_and_each_update() -> None:
    policy = measured(dwell_s=5.0, min_change=0.0)
    # the limit went 4 -> 64 at t = 10: dwell through t = 15
    assert policy.decide(at(15.0, 0.75), 15.0) == Decision(None, None, "dwell")
    assert policy.decide(at(16.0, 0.75), 16.0) == Decision(59, None, "latency_high")  # 59.2, as above
    policy.applied(59, 32, 16.0)  # the loop applies it
    for t in (17.0, 21.0):  # the sample still covers the time before this move
        assert policy.decide(at(t, 0.75, admission_limit=59, in_flight=59), t) == Decision(
            None, None, "dwell"
        )
    assert policy.decide(at(22.0, 0.75, admission_limit=59, in_flight=59), 22.0).reason == "latency_high"


def test_terms_before_any_baseline() -> None:
    terms = make().terms()
    assert terms["limit_estimate"] == 64.0
    assert math.isnan(terms["baseline_s"]) and math.isnan(terms["gradient"])
    assert terms["measuring"] == 1.0
    assert make().state == MEASURING


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"latency": "p95"}, "latency = 'p95': use one of 'ttft_p50', 'ttft_p99', 'itl_p50', 'itl_p99'"),
        ({"smoothing": 0}, "smoothing = 0: must be > 0.0 and <= 1.0"),
        ({"baseline_window_s": 300}, "baseline_interval_s = 300.0: must be longer than baseline_window_s"),
        ({"min_limit": 10, "max_limit": 5}, "max_limit = 5: must be >= 10"),
        ({"baseline_limit": 200}, "baseline_limit = 200: must be >= 1 and <= 128"),
        ({"cap_follows_limit": "yes"}, "cap_follows_limit = 'yes': must be true or false"),
        ({"dwell_s": -1}, "dwell_s = -1: must be >= 0.0"),
        ({"min_change": 1.5}, "min_change = 1.5: must be >= 0.0 and <= 1.0"),
    ],
)
def test_bad_params(params: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(message)):
        make(**params)

"""policies/hysteresis.py: tables of observations and the exact decisions they produce."""

from __future__ import annotations

import re
from typing import Any

import pytest

from policies.base import Decision, PolicyError, build_policy
from policies.hysteresis import HysteresisPolicy
from tests.helpers import obs


def make(**params: Any) -> HysteresisPolicy:
    # max_num_seqs 64: step 4, limit = cap + 2
    return HysteresisPolicy(max_num_seqs=64, initial_limit=34, **params)


CASES = [
    # (name, params, observation overrides, decision)
    ("stale", {}, {"in_flight": 5, "stats_age_s": 6.0}, Decision(None, None, "stale_stats")),
    ("never_reported", {}, {"in_flight": 5, "stats_age_s": None}, Decision(None, None, "stale_stats")),
    (
        "idle_is_not_stale",
        {},
        {"in_flight": 0, "running": 0, "stats_age_s": 100.0, "kv_usage_max": 0.0},
        Decision(None, None, "no_demand"),
    ),
    ("kv_critical_halves", {}, {"kv_usage": 0.98}, Decision(18, 16, "kv_critical")),
    ("preemptions_halve", {}, {"preemptions_per_s": 0.1}, Decision(18, 16, "preemptions")),
    ("cut_factor", {"cut_factor": 0.75}, {"kv_usage": 0.99}, Decision(26, 24, "kv_critical")),
    ("kv_high_steps_down", {}, {"kv_usage_max": 0.96}, Decision(30, 28, "kv_high")),
    ("high_is_exclusive", {}, {"kv_usage_max": 0.95}, Decision(None, None, "within_deadband")),
    ("kv_low_with_queue", {}, {"queued": 3}, Decision(38, 36, "kv_low")),
    ("kv_low_running_near_cap", {}, {"running": 29}, Decision(38, 36, "kv_low")),
    ("kv_low_without_demand", {}, {"running": 28}, Decision(None, None, "no_demand")),
    ("low_is_exclusive", {}, {"kv_usage_max": 0.70, "queued": 3}, Decision(None, None, "within_deadband")),
    ("deadband", {}, {"kv_usage_max": 0.8, "queued": 3}, Decision(None, None, "within_deadband")),
    ("at_max", {}, {"batch_cap": 64, "queued": 3}, Decision(None, None, "at_max")),
    ("at_min", {}, {"batch_cap": 1, "running": 1, "kv_usage": 0.99}, Decision(None, None, "at_min")),
    # a cut waits until the requests admitted under the old cap have drained below the new one
    (
        "cut_settling",
        {},
        {"batch_cap": 8, "running": 12, "preemptions_per_s": 0.5},
        Decision(None, None, "cut_settling"),
    ),
    ("min_cap", {"min_cap": 20}, {"kv_usage": 0.99}, Decision(22, 20, "kv_critical")),
    ("near_max", {}, {"batch_cap": 62, "queued": 3}, Decision(66, 64, "kv_low")),
    ("step", {"step": 10}, {"queued": 3}, Decision(44, 42, "kv_low")),
    ("limit_mapping", {"limit_factor": 1.5, "limit_headroom": 0}, {"queued": 3}, Decision(54, 36, "kv_low")),
    ("kv_source_latest", {"kv_source": "latest"}, {"kv_usage": 0.96}, Decision(30, 28, "kv_high")),
    ("kv_source_mean", {"kv_source": "mean"}, {"kv_usage_mean": 0.97}, Decision(30, 28, "kv_high")),
    ("default_reads_the_max", {}, {"kv_usage_mean": 0.97}, Decision(None, None, "no_demand")),
    ("gpu_off_by_default", {}, {"gpu_utilization": 1.0, "queued": 3}, Decision(38, 36, "kv_low")),
    (
        "gpu_high",
        {"gpu_low": 0.7, "gpu_high": 0.9},
        {"gpu_utilization": 0.95, "kv_usage_max": 0.8},
        Decision(30, 28, "gpu_high"),
    ),
    (
        "gpu_busy_blocks_raise",
        {"gpu_low": 0.7, "gpu_high": 0.9},
        {"gpu_utilization": 0.8, "queued": 3},
        Decision(None, None, "within_deadband"),
    ),
    (
        "gpu_idle_allows_raise",
        {"gpu_low": 0.7, "gpu_high": 0.9},
        {"gpu_utilization": 0.5, "queued": 3},
        Decision(38, 36, "kv_low"),
    ),
    ("no_gpu_reading", {"gpu_low": 0.7, "gpu_high": 0.9}, {"queued": 3}, Decision(38, 36, "kv_low")),
]


@pytest.mark.parametrize(("params", "fields", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decision_table(params: dict[str, Any], fields: dict[str, Any], expected: Decision) -> None:
    assert make(**params).decide(obs(now_mono=100.0, **fields), 100.0) == expected


def test_cooldown_between_steps() -> None:
    policy = make()
    steps = [
        # (now, cap in force, decision)
        (0.0, 32, Decision(38, 36, "kv_low")),
        (3.0, 36, Decision(None, None, "cooldown")),
        (4.9, 36, Decision(None, None, "cooldown")),
        (5.0, 36, Decision(42, 40, "kv_low")),
    ]
    for now, cap, expected in steps:
        assert policy.decide(obs(now_mono=now, batch_cap=cap, queued=1), now) == expected, now
    assert policy.terms() == {"kv_signal": 0.5, "cooldown_left_s": 5.0, "cut_cooldown_left_s": 0.0}


def test_cut_skips_step_cooldown_but_waits_for_its_own() -> None:
    policy = make()
    steps: list[tuple[float, int, dict[str, Any], Decision]] = [
        (0.0, 32, {"queued": 1}, Decision(38, 36, "kv_low")),
        (1.0, 36, {"preemptions_per_s": 0.1}, Decision(20, 18, "preemptions")),
        # the same preemption is still in the window: no second cut, and no raise either
        (7.0, 18, {"preemptions_per_s": 0.1, "queued": 1}, Decision(None, None, "cut_cooldown")),
        (8.0, 18, {"kv_usage": 0.99}, Decision(None, None, "cut_cooldown")),
        (11.0, 18, {"kv_usage": 0.99}, Decision(11, 9, "kv_critical")),
        (12.0, 9, {"kv_usage_max": 0.96}, Decision(None, None, "cooldown")),
        (16.0, 9, {"kv_usage_max": 0.96}, Decision(7, 5, "kv_high")),
    ]
    for now, cap, fields, expected in steps:
        assert (
            policy.decide(obs(now_mono=now, batch_cap=cap, running=min(cap, 20), **fields), now) == expected
        ), now


def test_hold_does_not_start_cooldown() -> None:
    policy = make()
    assert policy.decide(obs(now_mono=0.0, kv_usage_max=0.8), 0.0).reason == "within_deadband"
    assert policy.decide(obs(now_mono=0.5, batch_cap=64, queued=1), 0.5).reason == "at_max"
    assert policy.decide(obs(now_mono=1.0, queued=1), 1.0) == Decision(38, 36, "kv_low")


def test_default_step_scales_with_max_num_seqs() -> None:
    assert HysteresisPolicy(max_num_seqs=256, initial_limit=1).step == 16
    assert HysteresisPolicy(max_num_seqs=8, initial_limit=1).step == 1


def test_params_are_reported() -> None:
    params = make(step=3).params()
    assert params["step"] == 3
    assert params["low"] == 0.70
    assert params["kv_source"] == "max"
    assert params["gpu_high"] is None
    assert params["idle_restore_s"] == 60.0
    assert len(params) == 16


def test_idle_restore_returns_the_cap_to_the_ceiling_after_idle_restore_s() -> None:
    p = make(idle_restore_s=30.0)
    idle = obs(batch_cap=8, admission_limit=10, in_flight=0, queued=0, running=0, kv_usage_max=0.0)
    assert p.decide(idle, 100.0) == Decision(None, None, "no_demand")
    assert p.decide(idle, 129.0) == Decision(None, None, "no_demand")
    assert p.decide(idle, 130.0) == Decision(66, 64, "idle_restore")
    busy = obs(batch_cap=8, in_flight=1, running=1, kv_usage_max=0.0, stats_age_s=0.1)
    assert p.decide(busy, 131.0).reason != "idle_restore"  # load is back: the idle clock restarts
    assert p.decide(idle, 140.0).reason != "idle_restore"
    assert make(idle_restore_s=None).decide(idle, 1e9).reason == "no_demand"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"low": 0.9, "high": 0.8}, "need low < high <= critical"),
        ({"critical": 0.9}, "need low < high <= critical"),
        ({"high": 1.5}, "high = 1.5: out of range; use a value in [0.0, 1.0]"),
        ({"low": "a lot"}, "low = 'a lot': must be float"),
        ({"kv_source": "p99"}, "kv_source = 'p99': must be one of 'mean', 'latest', 'max'"),
        ({"gpu_low": 0.9, "gpu_high": 0.8}, "need gpu_low < gpu_high"),
        ({"step": 0}, "step = 0: out of range; use a value >= 1"),
        ({"step": True}, "step = True: must be int"),
        ({"cut_factor": 1.0}, "cut_factor = 1.0: out of range; use a value in (0.0, 0.99]"),
        ({"min_cap": 65}, "min_cap = 65: out of range; use a value in [1, 64]"),
        ({"stale_after_s": 0}, "stale_after_s = 0: out of range; use a value > 0.0"),
    ],
)
def test_bad_params(params: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(message)):
        make(**params)


def test_built_by_name_with_unknown_param() -> None:
    policy = build_policy("hysteresis", {"low": 0.5}, max_num_seqs=64, initial_limit=64)
    assert isinstance(policy, HysteresisPolicy)
    with pytest.raises(PolicyError, match=r"control.params.*'hysteresis'.*lo_w"):
        build_policy("hysteresis", {"lo_w": 0.5}, max_num_seqs=64, initial_limit=64)

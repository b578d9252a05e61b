"""policies/aimd.py: additive increase, multiplicative decrease, exact numbers."""

from __future__ import annotations

import re
from typing import Any

import pytest

from policies.aimd import AimdPolicy
from policies.base import Decision, Observation, PolicyError
from tests.helpers import obs


def make(**params: Any) -> AimdPolicy:
    return AimdPolicy(max_num_seqs=64, initial_limit=64, **params)


def at(now: float, ttft: float | None, **fields: Any) -> Observation:
    """Admission limit 64, 40 in flight (demand: 40 >= 0.5 * 64), TTFT p99 ``ttft``."""
    return obs(now_mono=now, ttft_p99_s=ttft, **{"admission_limit": 64, "in_flight": 40, **fields})


CASES = [
    # (name, params, sample, fields, decision)
    ("increase", {}, 0.5, {}, Decision(65, None, "latency_ok")),
    ("increase_step", {"increase": 4}, 0.5, {}, Decision(68, None, "latency_ok")),
    ("threshold_is_inclusive", {}, 1.0, {}, Decision(65, None, "latency_ok")),
    ("latency_high", {}, 1.5, {}, Decision(57, None, "latency_high")),  # 64 * 0.9 = 57.6
    ("backoff", {"backoff": 0.5}, 1.5, {}, Decision(32, None, "latency_high")),
    ("preemptions", {}, 0.5, {"preemptions_per_s": 0.2}, Decision(57, None, "preemptions")),
    ("preemptions_without_latency", {}, None, {"preemptions_per_s": 0.2}, Decision(57, None, "preemptions")),
    ("no_measurement", {}, None, {}, Decision(None, None, "no_measurement")),
    ("no_demand", {}, 0.5, {"in_flight": 31}, Decision(None, None, "no_demand")),
    ("queue_is_demand", {}, 0.5, {"in_flight": 3, "queued": 1}, Decision(65, None, "latency_ok")),
    ("stale", {}, 0.5, {"stats_age_s": None}, Decision(None, None, "stale_stats")),
    ("max_limit", {"max_limit": 64}, 0.5, {}, Decision(64, None, "latency_ok")),
    ("min_limit", {}, 1.5, {"admission_limit": 1, "in_flight": 1}, Decision(1, None, "latency_high")),
    ("follows_applied", {}, 0.5, {"admission_limit": 20, "in_flight": 20}, Decision(21, None, "latency_ok")),
    ("cap_follows_limit", {"cap_follows_limit": True}, 0.5, {}, Decision(65, 64, "latency_ok")),
    ("latency_choice", {"latency": "itl_p50"}, 0.5, {"itl_p50_s": 2.0}, Decision(57, None, "latency_high")),
]


@pytest.mark.parametrize(
    ("params", "sample", "fields", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_decision_table(
    params: dict[str, Any], sample: float | None, fields: dict[str, Any], expected: Decision
) -> None:
    assert make(**params).decide(at(0.0, sample, **fields), 0.0) == expected


def test_backoff_cooldown_then_additive_increase() -> None:
    policy = make()
    steps = [
        # (now, sample, limit in force, decision)
        (0.0, 1.5, 64, Decision(57, None, "latency_high")),  # L = 57.6
        (1.0, 1.5, 57, Decision(None, None, "cooldown")),  # the same overload, still in the window
        (4.9, 0.5, 57, Decision(None, None, "cooldown")),
        (5.0, 0.5, 57, Decision(58, None, "latency_ok")),  # L = 58.6
        (6.0, 0.5, 58, Decision(59, None, "latency_ok")),
        (7.0, 2.0, 59, Decision(53, None, "latency_high")),  # 59.6 * 0.9 = 53.64
    ]
    for now, ttft, limit, expected in steps:
        assert policy.decide(at(now, ttft, admission_limit=limit), now) == expected, now
    assert policy.terms() == pytest.approx({"limit_estimate": 53.64, "sample_s": 2.0})


def test_params() -> None:
    params = make().params()
    assert params["latency"] == "ttft_p99"
    assert params["backoff"] == 0.9
    assert params["max_limit"] == 128


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"backoff": 1.0}, "backoff = 1.0: must be >= 0.5 and <= 0.99"),
        ({"threshold_s": 0}, "threshold_s = 0: must be > 0.0"),
        ({"increase": 0.5}, "increase = 0.5: must be an integer"),
        ({"latency": "e2e"}, "latency = 'e2e': use one of"),
    ],
)
def test_bad_params(params: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(message)):
        make(**params)

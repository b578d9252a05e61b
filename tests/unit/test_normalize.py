"""controller/control/normalize.py: clamp, tolerance, reversal hold, stabilisation, rate limit, apply only
on change."""

from __future__ import annotations

import re
from typing import Any

import pytest

from controller.config.load import ControlConfig
from controller.control.build import normalizer_for
from controller.control.normalize import Move, Normalizer
from policies.base import Decision, build_policy
from tests.helpers import obs


def cap(want: int | None, reason: str = "r") -> Decision:
    return Decision(None, want, reason)


C, L = "batch_cap", "admission_limit"
CRIT, CRIT_RL = "kv_critical", "kv_critical:rate_limited"  # urgent by default

CASES: list[tuple[str, dict[str, Any], Decision, dict[str, Any], list[Move]]] = [
    # (name, normalizer params, decision, observation fields, moves); in force: limit 34, cap 32 of 64
    ("hold", {}, Decision(None, None, "r"), {}, []),
    ("unchanged", {}, Decision(34, 32, "r"), {}, []),
    ("limit_first", {}, Decision(40, 38, "r"), {}, [(L, 34, 40, "r"), (C, 32, 38, "r")]),
    ("clamped_max", {}, cap(100), {}, [(C, 32, 64, "r:clamped_max")]),
    ("clamped_min", {}, cap(0), {}, [(C, 32, 1, "r:clamped_min")]),
    ("limit_clamped_max", {}, Decision(500, None, "r"), {}, [(L, 34, 128, "r:clamped_max")]),
    ("cap_min", {"cap_min": 8}, cap(2), {}, [(C, 32, 8, "r:clamped_min")]),
    ("cap_min_above_max_num_seqs", {"cap_min": 80}, cap(2), {}, [(C, 32, 64, "r:clamped_min")]),
    ("limit_min", {"limit_min": 40}, Decision(20, None, "r"), {}, [(L, 34, 40, "r:clamped_min")]),
    ("clamped_to_current", {}, cap(100), {"batch_cap": 64}, []),
    ("within_tolerance", {"tolerance": 0.1}, cap(35), {}, []),  # |3| <= 3.2
    ("tolerance_down", {"tolerance": 0.1}, cap(29), {}, []),
    ("beyond_tolerance", {"tolerance": 0.1}, cap(36), {}, [(C, 32, 36, "r")]),
    ("beyond_tolerance_down", {"tolerance": 0.1}, cap(28), {}, [(C, 32, 28, "r")]),
    ("step_up_absolute", {"max_step_up": 4}, cap(40), {}, [(C, 32, 36, "r:rate_limited")]),
    ("step_up_fraction", {"max_step_up": 0.25}, cap(64), {}, [(C, 32, 40, "r:rate_limited")]),
    ("step_at_least_1", {"max_step_up": 0.1}, cap(5), {"batch_cap": 2}, [(C, 2, 3, "r:rate_limited")]),
    ("step_down_fraction", {"max_step_down": 0.5}, cap(1), {}, [(C, 32, 16, "r:rate_limited")]),
    ("step_up_not_down", {"max_step_up": 1}, cap(8), {}, [(C, 32, 8, "r")]),
    ("within_step", {"max_step_down": 4}, cap(28), {}, [(C, 32, 28, "r")]),
    ("clamp_and_step", {"max_step_up": 4}, cap(100), {}, [(C, 32, 36, "r:clamped_max:rate_limited")]),
    ("urgent", {"max_step_down": 2, "tolerance": 0.9}, cap(16, CRIT), {}, [(C, 32, 16, CRIT)]),
    ("custom_urgent", {"max_step_down": 2, "urgent_reasons": ["x"]}, cap(16, "x"), {}, [(C, 32, 16, "x")]),
    ("no_urgent", {"max_step_down": 2, "urgent_reasons": []}, cap(16, CRIT), {}, [(C, 32, 30, CRIT_RL)]),
    # a cap above a lowered max_num_seqs goes straight into bounds, whatever the step limit
    ("out_of_bounds", {"max_step_down": 2}, cap(60), {"batch_cap": 70}, [(C, 70, 60, "r")]),
]


@pytest.mark.parametrize(
    ("params", "decision", "fields", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_single_tick_table(
    params: dict[str, Any], decision: Decision, fields: dict[str, Any], expected: list[Move]
) -> None:
    assert Normalizer(limit_max=128, **params).normalize(decision, obs(**fields), 0.0) == expected


def test_last_outcome_explains_dropped_changes() -> None:
    normalizer = Normalizer(limit_max=128, tolerance=0.1)
    assert normalizer.normalize(Decision(None, 35, "kv_low"), obs(), 0.0) == []
    assert normalizer.last_outcome == {L: "kv_low:hold", C: "kv_low:within_tolerance"}
    assert normalizer.normalize(Decision(34, 100, "static"), obs(batch_cap=64), 1.0) == []
    assert normalizer.last_outcome == {
        "admission_limit": "static:unchanged",
        "batch_cap": "static:clamped_max:unchanged",
    }


def test_scale_down_stabilisation_window() -> None:
    normalizer = Normalizer(limit_max=128, stabilization_s=30.0)
    steps = [
        # (now, cap in force, wanted, moves)
        (0.0, 32, 40, [("batch_cap", 32, 40, "kv_low")]),  # scaling up is never held
        (10.0, 40, 20, []),  # the window still holds 40: stay
        (20.0, 40, 24, []),
        (30.0, 40, 16, [("batch_cap", 40, 24, "kv_high:stabilized")]),  # 40 (t = 0) is 30 s old: out
        (50.0, 24, 16, [("batch_cap", 24, 16, "kv_high")]),  # 24 (t = 20) is out too
    ]
    for now, current, wanted, expected in steps:
        reason = "kv_low" if wanted > current else "kv_high"
        assert normalizer.normalize(cap(wanted, reason), obs(batch_cap=current), now) == expected, now
    assert normalizer.last_outcome["batch_cap"] == "kv_high"


def test_stabilised_outcome_without_a_move() -> None:
    normalizer = Normalizer(limit_max=128, stabilization_s=30.0)
    normalizer.normalize(cap(40, "kv_low"), obs(), 0.0)
    assert normalizer.normalize(cap(20, "kv_high"), obs(batch_cap=40), 1.0) == []
    assert normalizer.last_outcome["batch_cap"] == "kv_high:stabilized"


def test_stabilised_then_rate_limited() -> None:
    normalizer = Normalizer(limit_max=128, stabilization_s=30.0, max_step_down=2)
    normalizer.normalize(cap(24), obs(batch_cap=40), 0.0)  # recorded, then cut to 38 by the rate limit
    moves = normalizer.normalize(cap(16), obs(batch_cap=38), 1.0)
    assert moves == [("batch_cap", 38, 36, "r:stabilized:rate_limited")]


def test_holds_are_not_recommendations_and_knobs_are_separate() -> None:
    normalizer = Normalizer(limit_max=128, stabilization_s=30.0)
    normalizer.normalize(Decision(60, None, "up"), obs(), 0.0)
    normalizer.normalize(Decision(None, None, "hold"), obs(admission_limit=60), 1.0)
    # the cap has no recommendation in the window: it goes down at once; the limit is held at 60
    moves = normalizer.normalize(Decision(40, 16, "down"), obs(admission_limit=60), 2.0)
    assert moves == [("batch_cap", 32, 16, "down")]


def test_reset_forgets_the_window() -> None:
    normalizer = Normalizer(limit_max=128, stabilization_s=30.0)
    normalizer.normalize(cap(40), obs(), 0.0)
    normalizer.reset()
    assert normalizer.last_outcome == {}
    assert normalizer.normalize(cap(20), obs(batch_cap=40), 1.0) == [("batch_cap", 40, 20, "r")]


def test_damps_the_chatter_of_a_limit_at_equilibrium() -> None:
    """A policy alternating 55/56 (a limit-moving policy at equilibrium) moves once, then never."""
    normalizer = Normalizer(limit_max=128, stabilization_s=10.0)
    limit, moves = 64, []
    for t in range(30):
        want = 55 if t % 2 else 56
        for _, old, new, _ in normalizer.normalize(Decision(want, None, "g"), obs(admission_limit=limit), t):
            moves.append((old, new))
            limit = new
    assert moves == [(64, 56)]


def test_a_quick_reversal_is_held_unless_it_halves_or_doubles_the_knob() -> None:
    normalizer = Normalizer(limit_max=128, tolerance=0.1, reverse_after_s=30.0)
    assert normalizer.normalize(cap(35), obs(), 100.0) == []  # within 10 % of 32
    assert normalizer.last_outcome[C] == "r:within_tolerance"
    assert normalizer.normalize(cap(48), obs(), 100.0) == [(C, 32, 48, "r")]
    # the cap's first move arms no hold: a move back 5 s later goes, and is the last move
    assert normalizer.normalize(cap(40), obs(batch_cap=48), 105.0) == [(C, 48, 40, "r")]
    # 5 s after a move down, a move back up is held ...
    assert normalizer.normalize(cap(46), obs(batch_cap=40), 110.0) == []
    assert normalizer.last_outcome[C] == "r:reversal_held"
    # ... unless it more than doubles the cap
    wide = {"max_num_seqs": 128}
    assert normalizer.normalize(cap(90), obs(batch_cap=40, **wide), 111.0) == [(C, 40, 90, "r")]
    # the move up is now the last: down again is held for 30 s, then goes
    assert normalizer.normalize(cap(80), obs(batch_cap=90, **wide), 140.0) == []
    assert normalizer.normalize(cap(80), obs(batch_cap=90, **wide), 141.0) == [(C, 90, 80, "r")]
    # each knob has its own last move: the limit's first move is never a reversal
    assert normalizer.normalize(Decision(20, None, "r"), obs(), 141.0) == [(L, 34, 20, "r")]


def test_the_slow_starts_first_limit_is_not_held_against_its_climb() -> None:
    # the slo policy's start: vLLM's limit -> 3, its estimate 4 a few seconds later; the first move
    # armed the hold, and the twin's shared-prefix load ran at limit 3 for 30 s
    normalizer = Normalizer(limit_max=128, tolerance=0.1, reverse_after_s=30.0)
    assert normalizer.normalize(Decision(3, None, "r"), obs(), 0.0) == [(L, 34, 3, "r")]
    assert normalizer.normalize(Decision(4, None, "r"), obs(admission_limit=3), 8.0) == [(L, 3, 4, "r")]
    assert normalizer.normalize(Decision(3, None, "r"), obs(admission_limit=4), 9.0) == []  # now held
    # the token budget's first move (a halving step on its way down) arms the hold as any other
    budget = Decision(None, None, "r", token_budget=1000)
    halved = [("token_budget", 2048, 1024, "r:rate_limited")]
    assert normalizer.normalize(budget, obs(token_budget=2048), 0.0) == halved
    budget = Decision(None, None, "r", token_budget=1500)
    assert normalizer.normalize(budget, obs(token_budget=1024), 1.0) == []


def test_a_policy_names_its_anti_flap_defaults_and_control_overrides_them() -> None:
    slo = build_policy("slo", {}, max_num_seqs=64, initial_limit=8)
    hysteresis = build_policy("hysteresis", {}, max_num_seqs=64, initial_limit=8)
    anti_flap = ("tolerance", "reverse_after_s")

    def settings(control: ControlConfig, policy: Any) -> tuple[Any, ...]:
        params = normalizer_for(control, policy).params()
        return tuple(params[key] for key in anti_flap)

    assert settings(ControlConfig(), slo) == (0.1, 30.0)
    assert settings(ControlConfig(), hysteresis) == (0.0, 0.0)
    assert settings(ControlConfig(tolerance=0.25, reverse_after_s=0.0), slo) == (0.25, 0.0)


def test_params() -> None:
    assert Normalizer(limit_max=10, max_step_up=0.5, urgent_reasons=("b", "a")).params() == {
        "limit_max": 10,
        "limit_min": 1,
        "cap_min": 1,
        "tolerance": 0.0,
        "reverse_after_s": 0.0,
        "max_step_up": 0.5,
        "max_step_down": 0.0,
        "stabilization_s": 0.0,
        "urgent_reasons": ["a", "b"],
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"limit_max": 0}, "limit_max = 0: out of range; use a value >= 1"),
        ({"limit_max": 10, "tolerance": -0.1}, "tolerance = -0.1: out of range; use a value >= 0.0"),
        (
            {"limit_max": 10, "max_step_up": 2.5},
            "max_step_up = 2.5: not a whole number; use a whole number, or a fraction below 1",
        ),
        ({"limit_max": 10, "max_step_down": True}, "max_step_down = True: must be float"),
        ({"limit_max": 10, "stabilization_s": "30s"}, "stabilization_s = '30s': must be float"),
        ({"limit_max": 10, "reverse_after_s": -1}, "reverse_after_s = -1: out of range; use a value >= 0.0"),
        ({"limit_max": 10, "cap_min": 0}, "cap_min = 0: out of range; use a value >= 1"),
        ({"limit_max": 10, "limit_min": 11}, "limit_min = 11: out of range; use a value in [1, 10]"),
    ],
)
def test_bad_params(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Normalizer(**params)

"""The fit check: the step-cost model's starting fit against its live one, over the steps served since
the start, in a bounded ring; in /state under ``cost_model.fit_check``."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.control.fitcheck import FitCheck
from controller.control.steps import EngineStep
from policies.cost import StepCoefficients

START = StepCoefficients(0.01, 0.001, 0.003, 0.0)
"""a = 10 ms, 1 ms per prefill token, 3 ms per decoding sequence, nothing per KV token."""
STEPS = [
    EngineStep.measured(1.0, 10, 0, 0, 0.025),  # predicted 0.02: 20 % off
    EngineStep.measured(2.0, 0, 5, 100, 0.02),  # predicted 0.025: 25 % off
    EngineStep.measured(3.0, 0, 0, 0, 0.5),  # nothing scheduled: not a step the model takes in
    EngineStep.measured(4.0, 5, 0, 0, 0.0),  # no time: skipped
    EngineStep.measured(5.0, 5, 0, 0, float("nan")),  # skipped
    EngineStep.measured(6.0, 20, 0, 0, 0.04),  # predicted 0.03: 25 % off
    EngineStep.measured(7.0, 0, 1, 10, 0.012),  # predicted 0.013: 1/12 off
    EngineStep.measured(8.0, 0, 2, 300, 0.014),  # predicted 0.016: 1/7 off
]
LIVE = StepCoefficients(0.01, 0.0015, 0.002, 0.0)
"""Predicts the five kept steps exactly: it is also their best fit."""


def test_each_fit_is_judged_by_its_median_relative_error_over_the_kept_steps() -> None:
    check = FitCheck()
    check.start(START)
    check.update(STEPS)
    report = check.report(LIVE)
    assert report["steps_since_start"] == report["steps_measured"] == 5
    assert report["start_fit_median_rel_error"] == pytest.approx(0.2)  # of 0.2, 0.25, 0.25, 1/12, 1/7
    assert report["live_fit_median_rel_error"] == pytest.approx(0.0)
    assert report["best_fit_median_rel_error"] == pytest.approx(0.0, abs=1e-9)
    assert list(report["best_fit"].values()) == pytest.approx(LIVE.vector(), abs=1e-9)
    prefill, decode = report["by_kind"]["prefill"], report["by_kind"]["decode_only"]
    assert prefill["steps"] == 2 and prefill["start_fit"] == pytest.approx(0.225)  # b is off
    assert decode["steps"] == 3 and decode["start_fit"] == pytest.approx(1 / 7)  # and c
    assert decode["live_fit"] == pytest.approx(0.0)


def test_the_ring_keeps_the_last_steps_only() -> None:
    check = FitCheck(capacity=2)
    check.start(START)
    check.update(STEPS)  # the last two kept: 1/12 and 1/7 off
    report = check.report(START)
    assert report["steps_since_start"] == 5 and report["steps_measured"] == 2
    assert report["start_fit_median_rel_error"] == pytest.approx((1 / 12 + 1 / 7) / 2)
    assert report["best_fit"] is None  # two steps do not determine four terms


def test_a_start_drops_what_came_before_and_no_start_fit_reports_none() -> None:
    check = FitCheck()
    check.update(STEPS)  # the warm-up's own steps, say
    check.start(None)  # the model started empty: nothing to judge but the live fit
    report = check.report(LIVE)
    assert report["steps_since_start"] == report["steps_measured"] == 0
    assert report["start_fit_median_rel_error"] is report["live_fit_median_rel_error"] is None
    check.update(STEPS[:2])
    report = check.report(START)
    assert report["start_fit_median_rel_error"] is None
    assert report["live_fit_median_rel_error"] == pytest.approx(0.225)  # of 0.2 and 0.25


def test_the_daemon_feeds_the_check_and_shows_it_in_state(tmp_path: Path) -> None:
    from controller.admin.status import state
    from controller.config.load import load_config
    from controller.lifecycle.parts import build_parts
    from tests.helpers import write_config

    path = write_config(tmp_path / "config.toml", control={"policy": "static", "cost_profile": "cpu-tiny"})
    parts = build_parts(load_config(path))
    assert parts.fit_check is not None and parts.cost is not None and parts.loop.steps is not None
    assert state(parts)["cost_model"]["fit_check"]["steps_since_start"] == 0
    parts.fit_check.start(START)  # the daemon's startup does this once the model is seeded
    for consume in parts.loop.steps.consumers:
        consume(STEPS)
    shown = state(parts)["cost_model"]["fit_check"]
    assert shown["steps_since_start"] == 5
    assert shown["start_fit_median_rel_error"] == pytest.approx(0.2)
    assert shown["live_fit_median_rel_error"] is not None  # the profile's fit after three steps

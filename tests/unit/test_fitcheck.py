"""The fit check: the step-cost model's starting fit against its live one, over the steps served since
the start, in a bounded ring; in /state under ``cost_model.fit_check``."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.control.fitcheck import FitCheck
from controller.control.steps import EngineStep

START = (0.01, 0.001, 0.002, 0.0)
"""a = 10 ms, 1 ms per prefill token, 2 ms per decoding sequence, nothing per KV token."""
STEPS = [
    EngineStep(1.0, 10, 0, 0, 0.025),  # predicted 0.02: 20 % off
    EngineStep(2.0, 0, 5, 100, 0.02),  # predicted 0.02: exact
    EngineStep(3.0, 0, 0, 0, 0.5),  # nothing scheduled: not a step the model takes in
    EngineStep(4.0, 5, 0, 0, 0.0),  # no time: skipped
    EngineStep(5.0, 5, 0, 0, float("nan")),  # skipped
    EngineStep(6.0, 20, 0, 0, 0.04),  # predicted 0.03: 25 % off
]
LIVE = (0.01, 0.0015, 0.002, 0.0)
"""Predicts the three kept steps exactly (0.025, 0.02, 0.04)."""


def test_both_fits_are_judged_by_their_median_relative_error_over_the_kept_steps() -> None:
    check = FitCheck()
    check.start(START)
    check.update(STEPS)
    assert check.seen == 3
    assert check.report(LIVE) == {
        "steps_since_start": 3,
        "steps_measured": 3,
        "start_fit_median_rel_error": pytest.approx(0.2),  # median of 0.2, 0, 0.25
        "live_fit_median_rel_error": pytest.approx(0.0),
    }


def test_the_ring_keeps_the_last_steps_only() -> None:
    check = FitCheck(capacity=2)
    check.start(START)
    check.update(STEPS)  # the first kept step (20 % off) is overwritten by the third
    report = check.report(START)
    assert report["steps_since_start"] == 3 and report["steps_measured"] == 2
    assert report["start_fit_median_rel_error"] == pytest.approx(0.125)  # median of 0, 0.25


def test_a_start_drops_what_came_before_and_no_start_fit_reports_none() -> None:
    check = FitCheck()
    check.update(STEPS)  # the warm-up's own steps, say
    check.start(None)  # the model started empty: nothing to judge but the live fit
    assert check.report(LIVE) == {
        "steps_since_start": 0,
        "steps_measured": 0,
        "start_fit_median_rel_error": None,
        "live_fit_median_rel_error": None,
    }
    check.update(STEPS[:2])
    assert check.report(START)["start_fit_median_rel_error"] is None
    assert check.report(START)["live_fit_median_rel_error"] == pytest.approx(0.1)  # median of 0.2, 0


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
    assert shown["steps_since_start"] == 3
    assert shown["start_fit_median_rel_error"] == pytest.approx(0.2)
    assert shown["live_fit_median_rel_error"] is not None  # the profile's fit after three steps

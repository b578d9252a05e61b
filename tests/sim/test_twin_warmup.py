"""The twin warms up as the daemon does (``lifecycle/warm.py``): with no ``cost_profile`` named, the
warm-up's phases run on the twin's engine before the workload, and the step-cost model starts from
their fit; a named profile seeds it instead, and ``warmup_s = 0`` leaves it empty."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller.config.load import AdmissionConfig, ControlConfig
from controller.control.stepcost import StepCostModel
from controller.sim.twin import build_simulation
from tests.sim.scenarios import COST, PROFILE, uniform


def _run(control: ControlConfig) -> tuple[dict[str, Any] | None, StepCostModel]:
    sim = build_simulation(PROFILE, control, AdmissionConfig(limit=PROFILE.engine.max_num_seqs))
    seed = sim.cost.estimate(0.0)  # before the run: nothing is seeded yet
    assert seed.samples == 0
    result = asyncio.run(sim.run(uniform(5.0, 20.0)))
    return result.extra["warm_up"], sim.cost


def test_without_a_profile_the_twin_starts_from_the_warm_up_fit() -> None:
    warm, model = _run(ControlConfig(policy="slo"))
    assert warm is not None
    # every phase of the plan for max_num_seqs 128, 2048 tokens a step, 4096 of length, in order
    assert warm["phases"] == [
        "1x64+1", "1x16+16", "1x256+1", "2x64+16", "4x64+16", "8x16+16", "16x16+16", "32x16+16",
        "128x16+8", "1x1024+1", "4x512+16",
    ]  # fmt: skip
    assert 0 < warm["seconds"] < 20.0
    # the mean model's steps are the profile's linear cost: the fit recovers it
    assert warm["median_rel_error"] == pytest.approx(0.0, abs=1e-6)
    assert model.prior is not None and model.prior.name.startswith("warm-up: ")
    assert model.prior.coefficients.vector() == pytest.approx(COST.vector(), rel=1e-3)


def test_a_named_profile_or_no_budget_runs_no_warm_up() -> None:
    assert _run(ControlConfig(policy="slo", cost_profile="cpu-tiny"))[0] is None
    assert _run(ControlConfig(policy="slo", warmup_s=0.0))[0] is None

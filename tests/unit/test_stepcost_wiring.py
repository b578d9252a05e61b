"""The step-cost model in the daemon: seeded from [control] cost_profile, fed by the loop's step feed,
read into the Observation at the observation's time, shown in /state and as metrics, reseeded on a
reload that names another profile.

Loading a config imports vLLM (the [engine] names are checked against it): a few seconds, once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from controller.admission.classes import PriorityClass
from controller.config.load import load_config
from controller.control.stepcost import CostPrior, CostReader, StepCostModel
from controller.control.steps import EngineStep
from policies.cost import StepCoefficients
from tests.helpers import write_config


async def test_the_daemon_seeds_the_cost_model_and_shows_it(tmp_path: Path) -> None:
    from controller.admin.status import state
    from controller.lifecycle.parts import build_parts
    from controller.lifecycle.reload import Reloader

    path = write_config(tmp_path / "config.toml", control={"policy": "static", "cost_profile": "cpu-tiny"})
    parts = build_parts(load_config(path))
    assert parts.cost is not None
    shown = state(parts)["cost_model"]
    assert shown["seed"] == "cpu-tiny" and shown["samples"] == 0 and shown["ready"] is True
    assert shown["a_s"] == pytest.approx(0.003305747546144464)  # cpu-tiny's [cost] a_s
    coefficient = parts.registry.get_sample_value("autopilot_cost_model_coefficient", {"term": "a_s"})
    assert coefficient == pytest.approx(0.003305747546144464)
    assert parts.registry.get_sample_value("autopilot_cost_model_samples") == 0
    assert parts.registry.get_sample_value("autopilot_cost_model_ready") == 1
    assert parts.registry.get_sample_value("autopilot_cost_model_rel_error") is None
    assert parts.observer.observe().cost == parts.cost.model.estimate(parts.observer.observe().now_mono)
    ports = {"server": {"port": parts.config.server.port}, "admin": {"port": parts.config.admin.port}}
    write_config(path, **ports, control={"policy": "static"})
    assert (await Reloader(parts)._reload())["ok"]
    assert parts.cost.model.prior is None  # a reload naming no profile starts the fit from nothing


def test_the_observer_carries_the_estimate_at_the_observation_time() -> None:
    from controller.admission.gate import AdmissionGate
    from controller.clock import FakeClock
    from controller.control.observe import Observer
    from controller.control.samplers import FakeHostSource
    from controller.control.telemetry import TelemetryWindow

    @dataclasses.dataclass
    class Knobs:
        batch_cap: int = 8
        max_num_seqs: int = 16
        token_budget: int = 512
        max_num_batched_tokens: int = 2048
        token_budget_min: int = 16

    class NoGpu:
        def read(self) -> None:
            return None

    clock = FakeClock(100.0)
    model = StepCostModel(prior=CostPrior(StepCoefficients(0.003, 8e-6, 5e-5, 1e-7)))
    model.update([EngineStep.measured(99.0, 0, 4, 400, 0.0033)])
    gate = AdmissionGate(8, 16, [PriorityClass("default")], aging_s=0.0)
    observer = Observer(TelemetryWindow(10.0, clock), gate, Knobs(), NoGpu(), FakeHostSource(), model)
    cost = observer.observe().cost
    assert cost is not None and cost.samples == 1 and cost.age_s == pytest.approx(1.0)
    assert cost == CostReader(model, clock).current()
    assert cost.ready and cost.reason == "ready"  # a seeded fit is trusted from its first step
    unseeded = StepCostModel()
    unseeded.update([EngineStep.measured(99.0, 0, 4, 400, 0.0033)])
    assert unseeded.estimate(100.0).reason == "cost model: 1 samples < 50"

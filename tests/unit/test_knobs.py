"""The knobs: one name each across the policy's ask, the observation and the loop's setters; their
bounds and clamp, shared by the normalize stage, the engine, the twin and the policies."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.config.scheduler import SchedulerConfig

from controller.admin.metrics import GAUGES
from controller.control.knobs import KNOBS, Bounds, budget_bounds, cap_bounds, setters
from policies.base import Decision, Observation


def test_each_knob_is_a_field_of_the_ask_and_of_the_observation_by_its_one_name() -> None:
    names = [knob.name for knob in KNOBS]
    assert set(names) <= {f.name for f in dataclasses.fields(Decision)}
    assert set(names) <= {f.name for f in dataclasses.fields(Observation)}
    assert len(set(names)) == len(names) == 3


def test_each_knob_names_vllms_setting_and_a_gauge_the_daemon_exports() -> None:
    vllm_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert {knob.vllm for knob in KNOBS if knob.vllm is not None} <= vllm_fields
    assert {knob.gauge for knob in KNOBS} <= set(GAUGES)


class Recorder:
    """The actuator's three setters; the engine's two take half of what they are asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def set_admission_limit(self, limit: int) -> None:
        self.calls.append(("admission_limit", limit))

    async def set_batch_cap(self, cap: int) -> int:
        self.calls.append(("batch_cap", cap))
        return cap // 2

    async def set_token_budget(self, budget: int) -> int:
        self.calls.append(("token_budget", budget))
        return budget // 2


async def test_the_loop_moves_each_knob_by_its_name_and_gets_the_value_in_force() -> None:
    actuator = Recorder()
    found = setters(actuator)
    assert list(found) == [knob.name for knob in KNOBS]
    taken = [await found[knob.name](10) for knob in KNOBS]
    assert taken == [10, 5, 5]
    assert actuator.calls == [(knob.name, 10) for knob in KNOBS]


@pytest.mark.parametrize(
    ("bounds", "value", "expected"),
    [
        (cap_bounds(64), 0, 1),
        (cap_bounds(64), 65, 64),
        (cap_bounds(64), 17, 17),
        (cap_bounds(64, floor=8), 3, 8),
        (cap_bounds(4, floor=8), 3, 4),  # a floor above max_num_seqs yields to it
        (budget_bounds(2048, 16), 8, 16),
        (budget_bounds(2048, 16), 4096, 2048),
        (budget_bounds(8, 16), 4, 8),  # a ceiling under the floor: the ceiling
        (Bounds(2, 10), 11, 10),
    ],
)
def test_clamp_moves_a_value_into_its_bounds(bounds: Bounds, value: int, expected: int) -> None:
    assert bounds.clamp(value) == expected

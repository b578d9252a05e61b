"""The twin honours the token budget knob as the engine does, and reports its steps as EngineSteps."""

from __future__ import annotations

import dataclasses

from controller.config.load import ControlConfig
from controller.control.steps import EngineStep, StepCost, costs
from controller.load.workload import poisson
from controller.profiles.load import EngineLimits
from controller.sim.engine import SimEngine, SimRequest
from controller.sim.run import ControlSettings, Simulation
from policies.base import Decision, Observation, Policy
from policies.cost import StepCoefficients
from tests.sim.scenarios import PROFILE

COST = StepCoefficients(
    a_s=0.01, b_s_per_prefill_token=0.001, c_s_per_decode_seq=0.002, d_s_per_kv_token=1e-5
)
LIMITS = EngineLimits(
    max_num_seqs=8, max_num_batched_tokens=512, block_size=16, kv_cache_tokens=4096, max_model_len=1024
)


def test_a_lower_budget_splits_a_prompt_into_more_steps_and_each_step_is_recorded() -> None:
    e = SimEngine(LIMITS, COST)
    assert e.set_token_budget(100) == 100
    e.add(SimRequest(1, 10, 20, 0, arrival_t=0.0))
    scheduled, steps = [], []
    for t in range(1, 6):
        plan = e.plan()
        scheduled.append(sum(n for _, n in plan.scheduled))
        steps.append(e.finish_step(plan, float(t), step_s=0.5 if t == 1 else None)[0])
        if t == 1:
            e.add(SimRequest(2, 250, 2, 0, arrival_t=1.0))
    # the first prompt alone, then the second in chunks beside the first one's decodes, then two decodes
    assert scheduled == [10, 100, 100, 53, 2]
    assert (steps[0].t_mono, steps[0].cost) == (1.0, StepCost(10, 0, 10, 0.5))  # the driver's draw, if any
    assert all(s.stats is not None for s in steps)  # the twin knows both parts of each step
    assert [(s.prefill_tokens, s.decode_seqs, s.kv_tokens) for _, s in costs(steps[1:5])] == [
        (99, 1, 11 + 99),
        (99, 1, 12 + 198),
        (52, 1, 13 + 250),
        (0, 2, 14 + 251),
    ]
    assert steps[1].cost is not None
    assert steps[1].cost.step_s == COST.step_s(99, 1, 110)  # else the cost model's mean
    assert len(costs(steps)) == 5


def test_a_step_of_prefill_alone_takes_up_to_max_num_batched_tokens() -> None:
    """No stream decodes, so none stalls: the budget does not chunk the prompt (the engine's rule,
    controller/engine/runtime/scheduler.py)."""
    e = SimEngine(LIMITS, COST)
    e.set_token_budget(100)
    e.add(SimRequest(1, 250, 2, 0, arrival_t=0.0))
    e.add(SimRequest(2, 300, 2, 0, arrival_t=0.0))
    plan = e.plan()
    assert [n for _, n in plan.scheduled] == [250, 262]  # 512 in all: the ceiling


def test_the_budget_is_clamped_like_the_engines() -> None:
    e = SimEngine(LIMITS, COST)
    assert (e.set_token_budget(1), e.set_token_budget(10_000)) == (16, 512)
    whole = SimEngine(dataclasses.replace(LIMITS, enable_chunked_prefill=False, max_model_len=512), COST)
    assert whole.set_token_budget(64) == 512  # without chunked prefill a whole prompt must fit


class HalveBudget(Policy):
    """Asks for a quarter of the ceiling; records the budget and the steps the loop saw."""

    name = "halve"

    def __init__(self, **_engine: int) -> None:
        self.budgets: list[int] = []

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        self.budgets.append(obs.token_budget)
        return Decision(None, None, "test", token_budget=obs.max_num_batched_tokens // 4)


async def test_the_twins_loop_moves_the_budget_and_feeds_its_steps() -> None:
    control = ControlConfig(policy=f"{__name__}:HalveBudget", limit_max=128)  # a plug-in, by its path
    sim = Simulation(PROFILE, ControlSettings(control=control))
    policy = sim.loop.policy
    assert isinstance(policy, HalveBudget)
    seen: list[EngineStep] = []
    assert sim.loop.steps is not None
    sim.loop.steps.subscribe(seen.extend)
    await sim.run(poisson(2.0, 5.0, prompt_tokens=200, output_tokens=20, seed=3))
    assert policy.budgets[0] == 2048 and policy.budgets[-1] == 512  # halved twice (the rate limit)
    assert sim.engine.token_budget == 512
    assert seen and sim.loop.steps.total == len(seen)
    cost = [s for _, s in costs(seen)]
    assert len(cost) == len(seen) and all(s.step_s > 0 for s in cost)
    assert max(s.prefill_tokens for s in cost) <= 2048 and sum(s.prefill_tokens for s in cost) > 0

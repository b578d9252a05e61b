"""The token budget knob: its bounds, the normalize stage, the loop's apply stage, the engine host."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from controller.clock import FakeClock
from controller.control.actuator import Actuator
from controller.control.knobs import TOKEN_BUDGET_MIN, token_budget_bounds
from controller.control.loop import ControlLoop
from controller.control.normalize import Move, Normalizer
from controller.control.steps import EngineStep, StepFeed
from policies.base import Decision, Observation, Policy
from tests.helpers import obs

B = "token_budget"


def budget(want: int | None, reason: str = "r") -> Decision:
    return Decision(None, None, reason, token_budget=want)


def bobs(**fields: Any) -> Observation:
    """In force: budget 2048 of 8192, floor 16."""
    return obs(**{"token_budget": 2048, "max_num_batched_tokens": 8192, "token_budget_min": 16, **fields})


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((8192, True, 4096), (TOKEN_BUDGET_MIN, 8192)),
        ((8192, True, 4096, 31), (32, 8192)),  # a spec decode's draft tokens fit one step
        ((8192, False, 4096), (4096, 8192)),  # no chunked prefill: never below a whole prompt
        ((8, True, 4096), (8, 8)),  # a ceiling under the floor: the ceiling
    ],
)
def test_bounds(args: tuple[Any, ...], expected: tuple[int, int]) -> None:
    assert token_budget_bounds(*args) == expected


CASES: list[tuple[str, Decision, dict[str, Any], list[Move]]] = [
    ("hold", budget(None), {}, []),
    ("unchanged", budget(2048), {}, []),
    ("down", budget(1500), {}, [(B, 2048, 1500, "r")]),
    ("halve_at_most", budget(512), {}, [(B, 2048, 1024, "r:rate_limited")]),
    ("double_at_most", budget(8192), {}, [(B, 2048, 4096, "r:rate_limited")]),
    ("clamped_min", budget(4), {"token_budget": 20}, [(B, 20, 16, "r:clamped_min")]),
    ("clamped_max", budget(10_000), {"token_budget": 6000}, [(B, 6000, 8192, "r:clamped_max")]),
    ("urgent_not_rate_limited", budget(256, "kv_critical"), {}, [(B, 2048, 256, "kv_critical")]),
    ("out_of_bounds_moves_at_once", budget(1000), {"max_num_batched_tokens": 1024}, [(B, 2048, 1000, "r")]),
    ("no_chunked_prefill_floor", budget(64), {"token_budget_min": 2048}, []),
]


@pytest.mark.parametrize(
    ("decision", "fields", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_normalize(decision: Decision, fields: dict[str, Any], expected: list[Move]) -> None:
    assert Normalizer(limit_max=128).normalize(decision, bobs(**fields), 0.0) == expected


def test_normalize_tolerance_and_stabilisation_apply_to_the_budget() -> None:
    n = Normalizer(limit_max=128, tolerance=0.1, stabilization_s=30.0)
    assert n.normalize(budget(2200), bobs(), 0.0) == []  # |152| <= 204.8
    assert n.last_outcome[B] == "r:within_tolerance"
    assert n.normalize(budget(4000), bobs(), 1.0) == [(B, 2048, 4000, "r")]
    # the window still holds 4000: a cut to 1024 is held at the budget in force
    assert n.normalize(budget(1024), bobs(token_budget=4000), 2.0) == []
    assert n.last_outcome[B] == "r:stabilized"


def test_a_policy_that_never_steers_the_budget_has_no_outcome_for_it() -> None:
    n = Normalizer(limit_max=128)
    n.normalize(Decision(None, 40, "r"), bobs(), 0.0)
    assert B not in n.last_outcome
    n.normalize(budget(1024), bobs(), 1.0)
    n.normalize(Decision(None, None, "steady"), bobs(), 2.0)
    assert n.last_outcome[B] == "steady:hold"


# -- the apply stage --------------------------------------------------------------------------------


class Engine:
    """The engine host as the actuator sees it: clamps the budget like the engine, records calls."""

    def __init__(self, ceiling: int = 8192) -> None:
        self.budget, self.ceiling, self.cap = 2048, ceiling, 32
        self.calls: list[tuple[str, int]] = []
        self.steps: list[EngineStep] = []
        self.fail_drain = False

    async def set_batch_cap(self, cap: int) -> int:
        self.calls.append(("batch_cap", cap))
        self.cap = cap
        return cap

    async def set_token_budget(self, budget: int) -> int:
        self.calls.append((B, budget))
        self.budget = min(budget, self.ceiling)
        return self.budget

    async def drain_steps(self) -> list[EngineStep]:
        if self.fail_drain:
            raise RuntimeError("engine died")
        out, self.steps = self.steps, []
        return out


class Gate:
    def __init__(self) -> None:
        self.limit = 34

    def set_limit(self, limit: int) -> None:
        self.limit = limit


class Scripted(Policy):
    name = "scripted"

    def __init__(self, *decisions: Decision) -> None:
        self.decisions = list(decisions)
        self.seen: list[Observation] = []

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        self.seen.append(obs)
        return self.decisions.pop(0)


def loop_over(engine: Engine, policy: Policy, clock: FakeClock) -> tuple[ControlLoop, list[Any]]:
    gate, pulled = Gate(), []

    def observe() -> Observation:
        return bobs(
            now_mono=clock(), admission_limit=gate.limit, batch_cap=engine.cap, token_budget=engine.budget
        )

    feed = StepFeed(engine, [pulled.append])
    return ControlLoop(policy, Normalizer(limit_max=128), observe, Actuator(gate, engine), steps=feed), pulled


async def test_the_loop_applies_a_budget_through_the_actuator() -> None:
    clock, engine = FakeClock(5.0), Engine(ceiling=3000)
    loop, _ = loop_over(engine, Scripted(Decision(None, 16, "slo", token_budget=4096)), clock)
    changes = await loop.tick()
    assert engine.calls == [("batch_cap", 16), (B, 4096)]
    # the engine's own clamp is what the change records
    assert [(c.knob, c.old, c.new, c.reason) for c in changes] == [
        ("batch_cap", 32, 16, "slo"),
        (B, 2048, 3000, "slo"),
    ]
    assert loop.recent()[-1]["knob"] == B


async def test_each_tick_pulls_the_steps_before_it_observes() -> None:
    clock, engine = FakeClock(0.0), Engine()
    policy = Scripted(Decision(None, None, "hold"), Decision(None, None, "hold"))
    loop, pulled = loop_over(engine, policy, clock)
    step = EngineStep.measured(1.0, 128, 2, 300, 0.02)
    engine.steps = [step]
    await loop.tick()
    assert pulled == [[step]] and loop.steps is not None and loop.steps.total == 1
    engine.fail_drain = True  # a failed drain loses those steps, never the tick
    assert await loop.tick() == [] and len(policy.seen) == 2 and pulled == [[step], []]


# -- the engine host ----------------------------------------------------------------------------------


class Core:
    """The EngineCore's utility calls as the host makes them; the budget clamps as the scheduler does.
    ``rows`` are each engine's steps (several engines with data parallelism)."""

    def __init__(self, *rows: list[list[Any]]) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.rows = rows

    async def call_utility_async(self, name: str, *args: Any) -> Any:
        return (await self.call_utility_all_async(name, *args))[0]  # the first engine's answer

    async def call_utility_all_async(self, name: str, *args: Any) -> list[Any]:
        self.calls.append((name, args))
        if name == "autopilot_drain_steps":
            return list(self.rows)
        if name == "autopilot_set_token_budget":
            return [max(16, min(args[0], 4096))] * len(self.rows)
        return [args[0]] * len(self.rows)

    def shutdown(self, timeout: float = 0.0) -> None:
        pass


def fake_llm(max_scheduled: int | None = None) -> Any:
    sched = SimpleNamespace(
        max_num_batched_tokens=4096, enable_chunked_prefill=True, max_num_scheduled_tokens=max_scheduled
    )
    cfg = SimpleNamespace(
        scheduler_config=sched,
        model_config=SimpleNamespace(max_model_len=2048),
        num_speculative_tokens=0,
        shutdown_timeout=1.0,
        cache_config=None,
    )
    return SimpleNamespace(
        errored=False,
        output_handler=None,
        engine_core=Core([[1.5, 100, 3, 900, 0.04, 0.001]]),
        vllm_config=cfg,
        renderer=SimpleNamespace(shutdown=lambda: None),
        output_processor=SimpleNamespace(request_states={}, abort_requests=lambda *_a, **_k: None),
        shutdown=lambda timeout=0.0: None,
    )


def make_host(*llms: Any) -> Any:
    from controller.engine.runtime.host import EngineHost

    queue = list(llms)
    args = argparse.Namespace(max_num_seqs=8, kv_cache_memory_bytes=1 << 20, model="m")
    return EngineHost(args, StepFeed(), builder=lambda _a: queue.pop(0), two_engines_fit=True)


async def test_host_reads_the_engines_budget_moves_it_and_drains_its_steps() -> None:
    llm = fake_llm(max_scheduled=1024)
    host = make_host(llm)
    await host.start()
    assert (host.token_budget, host.max_num_batched_tokens, host.token_budget_min) == (1024, 4096, 16)
    assert await host.set_token_budget(1) == 16
    assert await host.set_token_budget(100_000) == 4096
    assert ("autopilot_set_token_budget", (4096,)) in llm.engine_core.calls
    assert await host.drain_steps() == [EngineStep.measured(1.5, 100, 3, 900, 0.04, 0.001)]


async def test_host_drains_every_data_parallel_engines_steps_in_time_order() -> None:
    llm = fake_llm()
    first = [[1.0, 0, 2, 40, 0.01, 0.0], [3.0, 0, 2, 44, 0.01, 0.0]]
    llm.engine_core = Core(first, [[2.0, 64, 0, 64, 0.02, 0.0]])
    host = make_host(llm)
    await host.start()
    assert [step.t_mono for step in await host.drain_steps()] == [1.0, 2.0, 3.0]


async def test_a_restarted_engine_gets_the_cap_and_the_budget_in_force() -> None:
    old, new = fake_llm(), fake_llm()
    host = make_host(old, new)
    await host.start()
    assert host.token_budget == 4096  # never moved: the engine's own initial value
    await host.set_batch_cap(3)
    await host.set_token_budget(512)
    await host.restart({"kv_cache_memory_bytes": 1 << 21}, build_first=True)
    assert host.llm is new
    assert ("autopilot_set_batch_cap", (3,)) in new.engine_core.calls
    assert ("autopilot_set_token_budget", (512,)) in new.engine_core.calls
    assert (host.batch_cap, host.token_budget) == (3, 512)

"""controller/control/loop.py: the normalize stage and the tick (observe -> decide -> normalize -> apply).

The engine is a small fake system: an actuator that records each call and moves the values the next
observation reports, so a change that was applied is not applied again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

from controller.clock import FakeClock
from controller.control.loop import Change, ControlLoop
from controller.control.normalize import Normalizer
from policies.base import Decision, Observation, Policy
from policies.static import StaticPolicy
from tests.helpers import idle_obs

MAX_NUM_SEQS = 64


def observation(**overrides: Any) -> Observation:
    """An unremarkable tick; ``overrides`` set the fields a case is about."""
    return idle_obs(
        **{"admission_limit": 100, "batch_cap": MAX_NUM_SEQS, "max_num_seqs": MAX_NUM_SEQS, **overrides}
    )


@pytest.mark.parametrize(
    ("decision", "obs", "expected"),
    [
        (Decision(None, None, "hold"), observation(), []),
        (Decision(100, MAX_NUM_SEQS, "steady"), observation(), []),  # no change, no move
        (Decision(50, None, "kv_high"), observation(), [("admission_limit", 100, 50, "kv_high")]),
        (Decision(None, 16, "kv_high"), observation(), [("batch_cap", 64, 16, "kv_high")]),
        (
            Decision(10, 16, "preemptions"),
            observation(),
            [("admission_limit", 100, 10, "preemptions"), ("batch_cap", 64, 16, "preemptions")],
        ),
        (
            Decision(0, None, "latency_high"),
            observation(),
            [("admission_limit", 100, 1, "latency_high:clamped_min")],
        ),
        (
            Decision(-7, None, "latency_high"),
            observation(),
            [("admission_limit", 100, 1, "latency_high:clamped_min")],
        ),
        (
            Decision(None, 0, "kv_high"),
            observation(batch_cap=32),
            [("batch_cap", 32, 1, "kv_high:clamped_min")],
        ),
        (
            Decision(None, 500, "latency_ok"),
            observation(batch_cap=32),
            [("batch_cap", 32, 64, "latency_ok:clamped_max")],
        ),
        # clamped onto the value in force: no move
        (Decision(None, 500, "latency_ok"), observation(batch_cap=64), []),
        (Decision(0, 0, "kv_high"), observation(admission_limit=1, batch_cap=1), []),
        # the admission limit has no ceiling of its own
        (
            Decision(100_000, None, "latency_ok"),
            observation(),
            [("admission_limit", 100, 10_000, "latency_ok:clamped_max")],
        ),
    ],
)
def test_normalize(decision: Decision, obs: Observation, expected: list[tuple[str, int, int, str]]) -> None:
    assert Normalizer(limit_max=10_000).normalize(decision, obs, obs.now_mono) == expected


class FakeSystem:
    """The gate and the engine as the loop sees them: ``observe`` reports what the actuator last set.

    ``engine_max`` plays the engine's own clamp of the batch cap; ``set_batch_cap`` returns the value
    that took effect, as the real one does.
    """

    def __init__(
        self, clock: FakeClock, limit: int = 100, cap: int = MAX_NUM_SEQS, engine_max: int = 1000
    ) -> None:
        self.clock = clock
        self.limit = limit
        self.cap = cap
        self.engine_max = engine_max
        self.calls: list[tuple[str, int]] = []
        self.observed = 0
        self.cap_gate: asyncio.Event | None = None
        """When set, set_batch_cap waits for it (to hold a tick in the middle of apply)."""

    def observe(self) -> Observation:
        self.observed += 1
        return observation(now_mono=self.clock(), admission_limit=self.limit, batch_cap=self.cap)

    def set_admission_limit(self, limit: int) -> None:
        self.calls.append(("admission_limit", limit))
        self.limit = limit

    async def set_batch_cap(self, cap: int) -> int:
        self.calls.append(("batch_cap", cap))
        if self.cap_gate is not None:
            await self.cap_gate.wait()
        self.cap = min(cap, self.engine_max)
        return self.cap

    async def set_token_budget(self, budget: int) -> int:
        self.calls.append(("token_budget", budget))
        return budget


class ScriptedPolicy(Policy):
    """Returns the given decisions in turn and records what it was shown."""

    name = "scripted"

    def __init__(self, decisions: Iterable[Decision]) -> None:
        self._decisions = list(decisions)
        self.seen: list[tuple[Observation, float]] = []

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        self.seen.append((obs, now_mono))
        return self._decisions.pop(0)


def moves(changes: Iterable[Change]) -> list[tuple[str, int, int, str, float]]:
    """A change without its wall-clock time (the loop reads time.time() for logs)."""
    return [(c.knob, c.old, c.new, c.reason, c.t_mono) for c in changes]


def make_loop(policy: Policy, system: FakeSystem, history: int = 50) -> tuple[ControlLoop, list[Change]]:
    notified: list[Change] = []

    def subscriber(_obs: Observation, changes: list[Change]) -> None:
        notified.extend(changes)

    loop = ControlLoop(
        policy, Normalizer(limit_max=10_000), system.observe, system, [subscriber], history=history
    )
    return loop, notified


async def test_tick_applies_only_changes() -> None:
    clock = FakeClock(start=1000.0)
    system = FakeSystem(clock)
    policy = StaticPolicy(max_num_seqs=MAX_NUM_SEQS, initial_limit=100, preset="interactive")
    loop, notified = make_loop(policy, system)
    assert loop.last_reason == "not_started"

    changes = await loop.tick()
    expected = [("admission_limit", 100, 32, "static", 1000.0), ("batch_cap", 64, 32, "static", 1000.0)]
    assert moves(changes) == expected
    assert system.calls == [("admission_limit", 32), ("batch_cap", 32)]
    assert moves(notified) == expected
    assert moves(loop.history) == expected
    assert loop.last_reason == "static"

    clock.advance(1.0)
    assert await loop.tick() == []  # the values are in force now: nothing to apply
    assert system.calls == [("admission_limit", 32), ("batch_cap", 32)]
    assert moves(notified) == expected
    assert moves(loop.history) == expected
    assert system.observed == 2


async def test_change_records_the_value_the_engine_took() -> None:
    clock = FakeClock(start=1000.0)
    system = FakeSystem(clock, engine_max=40)
    loop, notified = make_loop(ScriptedPolicy([Decision(None, 48, "latency_ok")]), system)
    changes = await loop.tick()
    assert moves(changes) == [("batch_cap", 64, 40, "latency_ok", 1000.0)]
    assert system.calls == [("batch_cap", 48)]
    assert notified == changes


async def test_history_keeps_reasons_and_is_bounded() -> None:
    clock = FakeClock(start=1000.0)
    system = FakeSystem(clock)
    policy = ScriptedPolicy(
        [
            Decision(0, 500, "kv_high"),  # limit clamped up to 1; cap clamped down to 64 = no move
            Decision(None, None, "within_deadband"),
            Decision(8, 0, "latency_ok"),
            Decision(9, None, "latency_ok"),
        ]
    )
    loop, notified = make_loop(policy, system, history=2)

    assert moves(await loop.tick()) == [("admission_limit", 100, 1, "kv_high:clamped_min", 1000.0)]
    clock.advance(1.0)
    assert await loop.tick() == []
    assert loop.last_reason == "within_deadband"  # a hold still says why
    clock.advance(1.0)
    assert moves(await loop.tick()) == [
        ("admission_limit", 1, 8, "latency_ok", 1002.0),
        ("batch_cap", 64, 1, "latency_ok:clamped_min", 1002.0),
    ]
    clock.advance(1.0)
    assert moves(await loop.tick()) == [("admission_limit", 8, 9, "latency_ok", 1003.0)]

    assert len(notified) == 4
    assert moves(loop.history) == [
        ("batch_cap", 64, 1, "latency_ok:clamped_min", 1002.0),
        ("admission_limit", 8, 9, "latency_ok", 1003.0),
    ]
    recent = loop.recent()
    assert [(r["knob"], r["old"], r["new"], r["reason"], r["t_mono"]) for r in recent] == moves(loop.history)
    # the policy saw each observation with its own time
    assert [(obs.now_mono, now) for obs, now in policy.seen] == [
        (t, t) for t in (1000.0, 1001.0, 1002.0, 1003.0)
    ]
    assert [obs.admission_limit for obs, _ in policy.seen] == [100, 1, 1, 8]


async def test_ticks_never_overlap() -> None:
    clock = FakeClock(start=1000.0)
    system = FakeSystem(clock)
    system.cap_gate = asyncio.Event()
    policy = ScriptedPolicy([Decision(50, 16, "kv_high"), Decision(40, None, "kv_high")])
    loop, _ = make_loop(policy, system)

    first = asyncio.create_task(loop.tick())
    for _ in range(5):
        await asyncio.sleep(0)
    assert system.calls == [("admission_limit", 50), ("batch_cap", 16)]  # held inside apply

    assert await loop.tick() == []  # the first tick still runs: this one does nothing
    assert system.observed == 1
    assert len(policy.seen) == 1

    system.cap_gate.set()
    assert moves(await first) == [
        ("admission_limit", 100, 50, "kv_high", 1000.0),
        ("batch_cap", 64, 16, "kv_high", 1000.0),
    ]
    clock.advance(1.0)
    assert moves(await loop.tick()) == [("admission_limit", 50, 40, "kv_high", 1001.0)]  # free again
    assert system.observed == 2


async def test_subscribers_see_each_tick_after_apply() -> None:
    clock = FakeClock(start=1000.0)
    system = FakeSystem(clock)
    seen: list[tuple[float, list[tuple[str, int]], list[tuple[str, int, int, str, float]]]] = []

    def subscriber(obs: Observation, changes: list[Change]) -> None:
        seen.append((obs.now_mono, list(system.calls), moves(changes)))

    policy = ScriptedPolicy([Decision(50, None, "kv_high"), Decision(None, None, "hold")])
    loop = ControlLoop(policy, Normalizer(limit_max=10_000), system.observe, system, [subscriber])
    await loop.tick()
    clock.advance(1.0)
    await loop.tick()
    assert seen == [
        (1000.0, [("admission_limit", 50)], [("admission_limit", 100, 50, "kv_high", 1000.0)]),
        (1001.0, [("admission_limit", 50)], []),  # a tick without changes is still seen
    ]


class LearningPolicy(ScriptedPolicy):
    """Holds every tick; a tick in ``lessons`` adds a lesson to ``learned``."""

    def __init__(self, ticks: int, lessons: dict[int, str]) -> None:
        super().__init__([Decision(None, None, "hold")] * ticks)
        self.lessons = lessons
        self._learned: list[dict[str, Any]] = []

    def decide(self, obs: Observation, now_mono: float) -> Decision:
        if len(self.seen) in self.lessons:
            self._learned.append({"reason": self.lessons[len(self.seen)]})
        return super().decide(obs, now_mono)

    def learned(self) -> list[dict[str, Any]]:
        return list(self._learned)


async def test_each_lesson_of_the_policy_is_logged_once_though_no_knob_moves() -> None:
    """A margin look that holds moves no knob: ``policy_learned`` carries its reason, once."""
    from structlog.testing import capture_logs

    clock = FakeClock(start=1000.0)
    loop, _ = make_loop(
        LearningPolicy(4, {1: "margin 0.70: 0 of 50", 3: "margin 0.70 -> 0.74"}), FakeSystem(clock)
    )
    with capture_logs() as logs:
        for _ in range(4):
            assert await loop.tick() == []
            clock.advance(1.0)
    said = [(e["policy"], e["reason"]) for e in logs if e["event"] == "policy_learned"]
    assert said == [("scripted", "margin 0.70: 0 of 50"), ("scripted", "margin 0.70 -> 0.74")]

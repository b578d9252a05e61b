"""controller/control/steps.py: the one route of the engine's steps. A watcher gets each step as it
is published or pulled, a subscriber every step since the last tick in time order, each exactly
once; a new engine resets what the watchers keep."""

from __future__ import annotations

from collections.abc import Sequence

from controller.clock import FakeClock
from controller.control.steps import EngineStep, StepFeed, StepStats
from controller.control.telemetry import TelemetryWindow


def reported(t: float, running: int = 1) -> EngineStep:
    return EngineStep(t, stats=StepStats(running, 0, 0.1, 0, 1, (), (), 0))


class Ring:
    """The EngineCore's ring: steps wait there until a tick drains them."""

    def __init__(self) -> None:
        self.steps: list[EngineStep] = []

    async def drain_steps(self) -> list[EngineStep]:
        out, self.steps = self.steps, []
        return out


class Seen:
    def __init__(self) -> None:
        self.calls: list[list[EngineStep]] = []

    def __call__(self, steps: Sequence[EngineStep]) -> None:
        self.calls.append(list(steps))


async def test_watchers_get_each_step_at_once_and_subscribers_each_tick_in_time_order() -> None:
    ring, watched, ticked = Ring(), Seen(), Seen()
    feed = StepFeed(ring)
    feed.watch(watched)
    feed.subscribe(ticked)
    a, b = reported(1.0), reported(3.0)
    measured = EngineStep.measured(2.0, 16, 1, 40, 0.01)
    feed.publish([a])
    feed.publish([b])
    assert watched.calls == [[a], [b]] and ticked.calls == []
    ring.steps = [measured]
    assert await feed.pull() == [a, measured, b]
    assert watched.calls == [[a], [b], [measured]]  # the pulled steps too, once
    assert ticked.calls == [[a, measured, b]] and feed.total == 3
    assert await feed.pull() == [] and ticked.calls[-1] == [] and feed.total == 3


async def test_a_failed_drain_keeps_the_published_steps_for_the_tick() -> None:
    class Dead:
        async def drain_steps(self) -> list[EngineStep]:
            raise RuntimeError("engine died")

    ticked = Seen()
    feed = StepFeed(Dead(), [ticked])
    step = reported(1.0)
    feed.publish([step])
    assert await feed.pull() == [step] and ticked.calls == [[step]]


def test_the_window_watches_the_feed_and_a_new_engine_resets_it() -> None:
    clock = FakeClock(10.0)
    window, feed = TelemetryWindow(10.0, clock), StepFeed(clock=clock)
    feed.watch(window.update, window.reset)
    feed.publish([reported(feed.now(), running=3), EngineStep.measured(9.5, 0, 3, 30, 0.01)])
    snap = window.snapshot()
    assert (snap.steps, snap.running) == (1, 3)  # the EngineCore's figures are none of the window's
    feed.engine_started()
    assert window.snapshot().steps == 0 and window.last_step_age_s() is None

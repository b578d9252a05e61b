"""controller/control/telemetry.py: the rolling window of engine steps and its summary, on a fake clock."""

from __future__ import annotations

import pytest

from controller.clock import FakeClock
from controller.control.steps import EngineStep, StepStats
from controller.control.telemetry import EngineStats, TelemetryWindow
from controller.percentile import percentile


def step(
    t_mono: float,
    *,
    running: int = 0,
    waiting: int = 0,
    kv_usage: float = 0.0,
    preempted: int = 0,
    generated_tokens: int = 0,
    ttft_s: tuple[float, ...] = (),
    itl_s: tuple[float, ...] = (),
    finished: int = 0,
) -> EngineStep:
    stats = StepStats(
        running=running,
        waiting=waiting,
        kv_usage=kv_usage,
        preempted=preempted,
        generated_tokens=generated_tokens,
        ttft_s=ttft_s,
        itl_s=itl_s,
        finished=finished,
    )
    return EngineStep(t_mono, stats=stats)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([7.0], 0, 7.0),
        ([7.0], 99, 7.0),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),  # rank max(1, ceil(0)) = 1
        ([4.0, 1.0, 3.0, 2.0], 25, 1.0),  # ceil(1.0) = 1
        ([4.0, 1.0, 3.0, 2.0], 26, 2.0),  # ceil(1.04) = 2
        ([4.0, 1.0, 3.0, 2.0], 50, 2.0),  # ceil(2.0) = 2: nearest rank, no interpolation
        ([4.0, 1.0, 3.0, 2.0], 75, 3.0),
        ([4.0, 1.0, 3.0, 2.0], 99, 4.0),  # ceil(3.96) = 4
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([float(v) for v in range(1, 101)], 99, 99.0),  # ceil(99.0) = 99
        ([float(v) for v in range(1, 101)], 50, 50.0),
        ([float(v) for v in range(1, 201)], 99, 198.0),  # ceil(198.0) = 198
        ([float(v) for v in range(1, 11)], 99, 10.0),  # ceil(9.9) = 10
        ([float(v) for v in range(1, 11)], 90, 9.0),  # ceil(9.0) = 9
    ],
)
def test_percentile_nearest_rank(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q, "nearest_rank") == expected


def test_empty_window_snapshot() -> None:
    clock = FakeClock(start=500.0)
    window = TelemetryWindow(window_s=10.0, clock=clock)
    assert window.snapshot() == EngineStats(
        now_mono=500.0,
        window_s=10.0,
        steps=0,
        running=0,
        running_max=0,
        waiting=0,
        kv_usage=0.0,
        kv_usage_mean=0.0,
        kv_usage_max=0.0,
        preemptions=0,
        preemptions_per_s=0.0,
        generated_tokens_per_s=0.0,
        finished_per_s=0.0,
        ttft_p50_s=None,
        ttft_p99_s=None,
        itl_p50_s=None,
        itl_p99_s=None,
        last_step_age_s=None,
    )
    assert window.max_running_since(0.0) == 0


def test_snapshot_math() -> None:
    clock = FakeClock(start=1000.0)
    window = TelemetryWindow(window_s=4.0, clock=clock)
    window.record(
        step(
            1000.0,
            running=2,
            waiting=5,
            kv_usage=0.25,
            preempted=1,
            generated_tokens=10,
            ttft_s=(0.5, 0.125),
            itl_s=(0.25,),
            finished=1,
        )
    )
    window.record(
        step(1001.0, running=6, waiting=3, kv_usage=0.75, generated_tokens=30, itl_s=(0.5, 0.125), finished=2)
    )
    window.record(
        step(1002.0, running=4, waiting=1, kv_usage=0.5, preempted=3, generated_tokens=20, ttft_s=(0.25,))
    )
    clock.advance(2.5)
    assert window.snapshot() == EngineStats(
        now_mono=1002.5,
        window_s=4.0,
        steps=3,
        running=4,  # the latest step's values
        running_max=6,
        waiting=1,
        kv_usage=0.5,
        kv_usage_mean=0.5,  # (0.25 + 0.75 + 0.5) / 3
        kv_usage_max=0.75,
        preemptions=4,
        preemptions_per_s=1.0,  # 4 / 4 s of window, not of the span of the steps
        generated_tokens_per_s=15.0,  # 60 / 4
        finished_per_s=0.75,  # 3 / 4
        ttft_p50_s=0.25,  # [0.125, 0.25, 0.5]: rank ceil(1.5) = 2
        ttft_p99_s=0.5,
        itl_p50_s=0.25,  # [0.125, 0.25, 0.5]
        itl_p99_s=0.5,
        last_step_age_s=0.5,
    )
    assert (window.total_steps, window.total_preemptions, window.total_generated_tokens) == (3, 4, 60)


@pytest.mark.parametrize(
    ("now", "steps_left", "running"),
    [
        # steps at 1000, 1001, 1002 with running 1, 2, 3; window 4 s keeps steps at or after now - 4
        (1002.0, 3, 3),
        (1004.0, 3, 3),  # horizon 1000.0: a step exactly at the horizon stays
        (1004.5, 2, 3),
        (1005.5, 1, 3),
        (1006.0, 1, 3),
        (1006.5, 0, 0),
    ],
)
def test_window_trims_old_steps(now: float, steps_left: int, running: int) -> None:
    clock = FakeClock(start=1000.0)
    window = TelemetryWindow(window_s=4.0, clock=clock)
    for i in range(3):
        window.record(step(1000.0 + i, running=i + 1, generated_tokens=8))
    clock.advance(now - clock.now)
    stats = window.snapshot()
    assert (stats.steps, stats.running, stats.generated_tokens_per_s) == (
        steps_left,
        running,
        steps_left * 2.0,
    )
    assert window.total_steps == 3  # the totals never forget


def test_last_step_age() -> None:
    clock = FakeClock(start=1000.0)
    window = TelemetryWindow(window_s=10.0, clock=clock)
    assert window.snapshot().last_step_age_s is None  # before the first step
    window.record(step(1000.0))
    clock.advance(3.0)
    window.record(step(1003.0))
    assert window.snapshot().last_step_age_s == 0.0
    clock.advance(7.5)
    assert window.snapshot().last_step_age_s == 7.5
    # an idle engine reports nothing: the age keeps growing after the step left the window
    clock.advance(50.0)
    stats = window.snapshot()
    assert (stats.steps, stats.last_step_age_s) == (0, 57.5)
    window.reset()  # a new engine starts from nothing
    assert window.snapshot().last_step_age_s is None


def test_max_running_since() -> None:
    clock = FakeClock(start=1000.0)
    window = TelemetryWindow(window_s=10.0, clock=clock)
    for t, running in ((1000.0, 5), (1001.0, 9), (1002.0, 3), (1003.0, 4)):
        window.record(step(t, running=running))
    assert window.max_running_since(1000.0) == 9
    assert window.max_running_since(1001.0) == 9  # at or after
    assert window.max_running_since(1001.5) == 4
    assert window.max_running_since(1003.0) == 4
    assert window.max_running_since(1003.1) == 0


def test_max_steps_bounds_memory() -> None:
    clock = FakeClock(start=1000.0)
    window = TelemetryWindow(window_s=10.0, clock=clock, max_steps=2)
    for i in range(5):
        window.record(step(1000.0, running=i))
    stats = window.snapshot()
    assert (stats.steps, stats.running, window.total_steps) == (2, 4, 5)
    assert window.max_running_since(0.0) == 4


def test_data_parallel_engines_are_summed_not_mixed() -> None:
    """Two engines report into one window: running and waiting are the sum of each engine's latest
    step, KV usage the fullest engine's, not whichever engine happened to report last."""
    clock = FakeClock(start=100.0)
    window = TelemetryWindow(window_s=10.0, clock=clock)
    for t, engine, running, waiting, kv in [
        (95.0, 0, 6, 2, 0.50),
        (96.0, 1, 4, 1, 0.25),
        (97.0, 0, 7, 0, 0.625),
        (98.0, 1, 3, 3, 0.125),
    ]:
        stats = StepStats(running, waiting, kv, 0, running, (), (), 0)
        window.record(EngineStep(t, stats=stats, engine_idx=engine))
    snap = window.snapshot()
    assert (snap.running, snap.waiting, snap.kv_usage) == (10, 3, 0.625)
    assert snap.running_max == 11  # engine 0 at 7 beside engine 1 at 4 (t = 97)
    assert window.max_running_since(96.0) == 7  # one engine's count

"""The gate's prefill term counts what the prefix cache leaves to compute: the telemetry window's
share of recent prompt tokens served from the cache (control/telemetry.py), applied by the cost
reader (control/stepcost.py) to a new prompt, read at most once a second."""

from __future__ import annotations

import pytest

from controller.clock import FakeClock
from controller.control.stepcost import CostPrior, CostReader, StepCostModel
from controller.control.steps import EngineStep, StepStats
from controller.control.telemetry import TelemetryWindow
from policies.cost import StepCoefficients


def sample(t: float, prompt: int, prefill: int) -> EngineStep:
    return EngineStep(t, stats=StepStats(1, 0, 0.1, 0, 10, (), (), 1, prefill, 10, prompt))


def test_the_window_reports_the_share_of_prompt_tokens_the_cache_served() -> None:
    clock = FakeClock(100.0)
    window = TelemetryWindow(10.0, clock)
    assert window.finished_mix().cached_share is None
    window.record(sample(100.0, prompt=300, prefill=100))
    window.record(sample(100.0, prompt=100, prefill=100))
    mix = window.finished_mix()
    assert mix.cached_share == pytest.approx(0.5)  # 200 of 400 prompt tokens from the cache
    assert mix.prefill_tokens == 100  # the mean computed prefill, the cache's hits left out


def model() -> StepCostModel:
    m = StepCostModel(prior=CostPrior(StepCoefficients(0.01, 0.001, 0.002, 0.0), name="test"))
    m.update([EngineStep.measured(1.0, 100, 0, 0, 0.11)])  # one step: a seeded fit is trusted
    return m


def test_a_prompt_is_predicted_at_the_tokens_the_cache_leaves_and_the_share_is_read_once_a_second() -> None:
    clock = FakeClock(100.0)
    share = [0.75]
    reads = []

    def cached() -> float:
        reads.append(clock())
        return share[0]

    m = model()
    with_cache = CostReader(m, clock, cached_share=cached)
    plain = CostReader(m, clock)
    assert with_cache.prefill_s(1000) == pytest.approx(plain.prefill_s(250))
    share[0] = 0.0
    assert with_cache.prefill_s(1000) == pytest.approx(plain.prefill_s(250))  # the same second
    clock.advance(1.0)
    assert with_cache.prefill_s(1000) == pytest.approx(plain.prefill_s(1000))
    assert reads == [100.0, 101.0]


def test_a_fully_cached_prompt_still_computes_a_token() -> None:
    clock = FakeClock(0.0)
    m = model()
    assert CostReader(m, clock, cached_share=lambda: 1.0).prefill_s(500) == pytest.approx(
        CostReader(m, clock).prefill_s(1)
    )


def test_a_requests_own_uncached_tokens_stand_in_for_the_share_where_known() -> None:
    """The TTFT check sets a residual against the prefill of the tokens the cache left the request
    (vLLM's ``num_cached_tokens``), not the recent share (``admission/ttft.TtftBounds.cache_miss_s``)."""
    clock = FakeClock(0.0)
    m = model()
    reader, plain = CostReader(m, clock, cached_share=lambda: 0.75), CostReader(m, clock)
    assert reader.uncached_tokens(1000) == 250 and plain.uncached_tokens(1000) == 1000
    assert reader.prefill_s(1000, uncached=1000) == pytest.approx(plain.prefill_s(1000))
    assert reader.prefill_s(1000, uncached=0) == pytest.approx(plain.prefill_s(1))  # one token computes

"""controller/control/capacity.py: the SLO capacity and the saturation an autoscaler reads, from a
fake step-cost fit, a fake gate and the real telemetry window on a fake clock; and the two gauges."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controller.admin.metrics import Metrics
from controller.clock import FakeClock
from controller.control.capacity import CapacityMeter, fit_capacity
from controller.control.steps import EngineStep, StepFeed, StepStats
from controller.control.telemetry import FinishedMix, TelemetryWindow
from policies.base import Policy
from policies.cost import CostEstimate
from policies.slo_policy import SloPolicy
from policies.slo_targets import SloBound, SloTargets
from policies.static import StaticPolicy
from tests.helpers import EngineKnobsInForce, GateTotals, PolicyHolder, Steering, obs, write_config

COST = CostEstimate(
    a_s=0.010, b_s_per_prefill_token=1e-4, c_s_per_decode_seq=1e-3, d_s_per_kv_token=1e-6,
    samples=500, rejected=0, rel_error=0.05, r2=0.9, age_s=0.1, ready=True, reason="ready",
    kv_tokens_per_seq=1000.0,
)  # fmt: skip
SLO = SloTargets(SloBound(ttft_s=2.0, tpot_s=0.050))
MIX = FinishedMix(finished=20, prefill_tokens=200.0, output_tokens=100.0)

# By hand: x = c + d*k + b*p/o = 1e-3 + 1e-6*1000 + 1e-4*200/100 = 2.2e-3 s per running sequence;
# D* = floor((0.050 - 0.010) / 2.2e-3) = floor(18.18) = 18; s(18) = 0.010 + 18 * 2.2e-3 = 0.0496 s;
# capacity = 18 / (100 * 0.0496) = 3.6290 requests/s. The same from the engine's time per request:
# o*a/D + o*(c + d*k) + b*p = 1/18 + 0.2 + 0.02 = 0.27556 s, and 1 / 0.27556 = 3.6290.
CAPACITY_RPS = 18 / (100 * 0.0496)


def test_capacity_matches_the_hand_computation() -> None:
    fit = fit_capacity(COST, 0.050, MIX, kv_batch=None, max_num_seqs=64)
    assert not isinstance(fit, str)
    assert (fit.batch, fit.bound) == (18, "tpot")
    assert fit.mean_step_s == pytest.approx(0.0496)
    assert fit.capacity_rps == pytest.approx(CAPACITY_RPS) == pytest.approx(1 / (1 / 18 + 0.2 + 0.02))


def test_the_fit_is_counted_at_the_engines_pace() -> None:
    """A wall-clock step 1.25x the fit's: a = 0.0125, x = 2.75e-3, D* = floor(0.0375 / 2.75e-3) = 13,
    s(13) = 0.0125 + 13 * 2.75e-3 = 0.04825 s, capacity 13 / (100 * 0.04825) = 2.6943 requests/s."""
    paced = dataclasses.replace(COST, pace=1.25)
    fit = fit_capacity(paced, 0.050, MIX, kv_batch=None, max_num_seqs=64)
    assert not isinstance(fit, str)
    assert (fit.batch, fit.bound, fit.pace) == (13, "tpot", 1.25)
    assert fit.mean_step_s == pytest.approx(0.04825)
    assert fit.capacity_rps == pytest.approx(13 / (100 * 0.04825))
    unmeasured = fit_capacity(dataclasses.replace(COST, pace=None), 0.050, MIX, None, 64)
    assert not isinstance(unmeasured, str) and unmeasured.capacity_rps == pytest.approx(CAPACITY_RPS)


def test_kv_and_the_engine_ceiling_bound_the_batch() -> None:
    kv = fit_capacity(COST, 0.050, MIX, kv_batch=12, max_num_seqs=64)
    assert not isinstance(kv, str) and (kv.batch, kv.bound) == (12, "kv")
    assert kv.capacity_rps == pytest.approx(12 / (100 * (0.010 + 12 * 2.2e-3)))
    ceiling = fit_capacity(COST, 0.050, MIX, kv_batch=None, max_num_seqs=8)
    assert not isinstance(ceiling, str) and (ceiling.batch, ceiling.bound) == (8, "max_num_seqs")


def test_a_bound_that_not_one_sequence_fits_is_capacity_zero() -> None:
    fit = fit_capacity(COST, 0.011, MIX, kv_batch=None, max_num_seqs=64)
    assert not isinstance(fit, str) and (fit.batch, fit.capacity_rps) == (0, 0.0)


def _gauges(meter: CapacityMeter, gate: GateTotals) -> CollectorRegistry:
    """A registry whose gauges read ``meter`` (and the fakes) at each scrape, as the daemon's do."""
    registry = CollectorRegistry()
    live = Metrics(registry).live
    live.read_from(gate, EngineKnobsInForce(), PolicyHolder(StaticPolicy(max_num_seqs=64, initial_limit=8)))
    live.read_capacity(meter)
    return registry


def _finish(window: TelemetryWindow, t: float, n: int, prefill: int = 200, output: int = 100) -> None:
    stats = StepStats(8, 0, 0.3, 0, n * output, (), (), n, n * prefill, n * output)
    window.record(EngineStep(t, stats=stats))


def _meter(
    clock: FakeClock, slo: SloTargets | None = SLO, policy: Policy | None = None
) -> tuple[CapacityMeter, GateTotals, TelemetryWindow]:
    window, gate = TelemetryWindow(10.0, clock), GateTotals()
    steering = Steering(slo, policy or StaticPolicy(max_num_seqs=64, initial_limit=8))
    return CapacityMeter(window, gate, steering), gate, window


def test_saturation_crosses_one_as_the_offered_load_rises() -> None:
    """Offered 2, 3, 4, 5 requests/s against a capacity of 3.63: below 1, then above."""
    clock = FakeClock(100.0)
    meter, gate, window = _meter(clock)
    registry = _gauges(meter, gate)
    seen = []
    for rate in (2, 3, 4, 5):
        for _ in range(20):  # 20 ticks of 1 s: the 10 s window holds this rate alone
            clock.advance(1.0)
            gate.arrive(rate, refused=max(0, rate - 3))
            _finish(window, clock(), 1)
            meter.on_tick(obs(now_mono=clock(), running=2, kv_usage=0.1, cost=COST), [])
        last = meter.last
        assert last.reason == "ok" and last.offered_rps == pytest.approx(rate)
        assert last.capacity_rps == pytest.approx(CAPACITY_RPS)
        assert registry.get_sample_value("autopilot_capacity_rps") == pytest.approx(CAPACITY_RPS)
        seen.append(registry.get_sample_value("autopilot_saturation"))
    assert seen == pytest.approx([r / CAPACITY_RPS for r in (2, 3, 4, 5)])
    assert seen[1] < 1 < seen[2]  # the refused requests count: demand past what the engine takes


def test_too_few_samples_leave_the_gauges_without_a_sample() -> None:
    clock = FakeClock(100.0)
    meter, gate, window = _meter(clock)
    registry = _gauges(meter, gate)
    gate.arrive(2)  # requests before the first tick: no rate until a second tick spans them
    meter.on_tick(obs(now_mono=clock(), cost=COST), [])
    assert meter.last.reason == "offered rate: one tick so far"
    unready = dataclasses.replace(COST, ready=False, reason="cost model: 12 samples < 50", samples=12)
    clock.advance(1.0)
    gate.arrive(3)
    _finish(window, clock(), 5)
    meter.on_tick(obs(now_mono=clock(), cost=unready), [])
    assert meter.last.reason == "cost model: 12 samples < 50"
    assert meter.last.capacity_rps is None and meter.last.saturation is None
    assert registry.get_sample_value("autopilot_saturation") is None
    assert registry.get_sample_value("autopilot_capacity_rps") is None
    clock.advance(20.0)  # the finished requests leave the window
    gate.arrive(3)
    meter.on_tick(obs(now_mono=clock(), cost=COST), [])
    assert meter.last.reason == "mix: 0 requests finished in 10 s < 3" and meter.last.saturation is None


def test_nothing_offered_reads_zero_even_without_a_capacity() -> None:
    clock = FakeClock(100.0)
    meter, _gate, _window = _meter(clock)
    for _ in range(2):
        meter.on_tick(obs(now_mono=clock(), cost=None), [])
        clock.advance(1.0)
    assert (meter.last.saturation, meter.last.capacity_rps) == (0.0, None)
    assert meter.last.reason == "no step-cost model"


def test_without_slo_there_is_no_capacity() -> None:
    clock = FakeClock(100.0)
    meter, gate, _window = _meter(clock, slo=None)
    for _ in range(2):
        gate.arrive(2)
        meter.on_tick(obs(now_mono=clock(), cost=COST), [])
        clock.advance(1.0)
    assert meter.last.capacity_rps is None and meter.last.reason.startswith("no [slo] table")


def test_without_slo_the_slo_policy_counts_capacity_at_its_throughput_knee() -> None:
    clock = FakeClock(100.0)
    meter, gate, window = _meter(clock, None, SloPolicy(max_num_seqs=64, initial_limit=8, knee_share=0.2))
    for _ in range(2):
        gate.arrive(2)
        _finish(window, clock(), 3)
        meter.on_tick(obs(now_mono=clock(), running=2, kv_usage=0.1, cost=COST), [])
        clock.advance(1.0)
    # D_knee = ceil(0.010 * 0.8 / (0.2 * 2.2e-3)) = ceil(18.18) = 19: 80 % of the peak 1 / (o * x)
    assert (meter.last.reason, meter.last.batch, meter.last.bound) == ("ok", 19, "knee")
    assert meter.last.step_bound_s is None
    assert meter.last.capacity_rps == pytest.approx(19 / (100 * (0.010 + 19 * 2.2e-3)))
    assert meter.last.saturation == pytest.approx(2 / meter.last.capacity_rps)


@pytest.mark.parametrize(("kv_usage", "batch", "bound"), [(0.3, 18, "tpot"), (0.5, 8, "kv")])
def test_the_kv_bounds_the_capacity_once_half_full(kv_usage: float, batch: int, bound: str) -> None:
    """4 running: at KV 0.3 (a shared prefix's blocks are held once, the mean share over-reads them)
    the TPOT bound's 18 stands; at 0.5 the cache holds floor(4 / 0.5) = 8."""
    clock = FakeClock(100.0)
    meter, gate, window = _meter(clock)
    for _ in range(2):
        gate.arrive(2)
        _finish(window, clock(), 3)
        meter.on_tick(obs(now_mono=clock(), running=4, kv_usage=kv_usage, cost=COST), [])
        clock.advance(1.0)
    assert (meter.last.reason, meter.last.batch, meter.last.bound) == ("ok", batch, bound)


def test_the_slo_policy_plans_the_mean_step_to_its_mean_margin() -> None:
    policy = SloPolicy(max_num_seqs=64, initial_limit=8, slo=SLO, mean_margin=0.5)
    static = StaticPolicy(max_num_seqs=64, initial_limit=8)
    assert policy.mean_step_share == 0.5 and static.mean_step_share == 1
    clock = FakeClock(100.0)
    meter, gate, window = _meter(clock, SLO, policy)
    for _ in range(2):
        gate.arrive(2)
        _finish(window, clock(), 3)
        meter.on_tick(obs(now_mono=clock(), running=2, kv_usage=0.1, cost=COST), [])
        clock.advance(1.0)
    # D* = floor((0.025 - 0.010) / 2.2e-3) = 6
    assert (meter.last.batch, meter.last.step_bound_s) == (6, 0.025)
    assert meter.last.capacity_rps == pytest.approx(6 / (100 * (0.010 + 6 * 2.2e-3)))


def test_the_window_measures_the_mix_of_the_requests_that_finished_in_it() -> None:
    clock = FakeClock(0.0)
    window = TelemetryWindow(10.0, clock)
    assert window.finished_mix() == FinishedMix(0, None, None)
    _finish(window, 1.0, 2, prefill=100, output=50)
    _finish(window, 5.0, 1, prefill=400, output=20)
    clock.advance(6.0)
    assert window.finished_mix() == FinishedMix(3, 200.0, 40.0)
    clock.advance(5.5)  # the first step left the window
    assert window.finished_mix() == FinishedMix(1, 400.0, 20.0)


async def test_the_daemon_computes_it_each_tick_and_shows_it(tmp_path: Path) -> None:
    """The wiring: a loop subscriber that reads [slo] and the policy in force, a reload's too; /state's
    ``capacity`` block and the gauges read it. (Loading a config imports vLLM: a few seconds.)"""
    from controller.admin.status import state
    from controller.config.load import load_config
    from controller.lifecycle.parts import build_parts
    from controller.lifecycle.reload import Reloader

    slo = {"ttft_s": 2.0, "tpot_s": 0.05}
    path = write_config(tmp_path / "config.toml", control={"policy": "slo"}, slo=slo)
    parts = build_parts(load_config(path))
    meter = parts.capacity
    assert meter is not None and meter.slo == parts.config.slo
    assert meter.policy is parts.loop.policy
    assert meter.policy.mean_step_share == 0.7  # where the margin starts
    assert meter.on_tick in parts.loop._subscribers
    assert state(parts)["capacity"]["reason"] == "not started"
    meter.on_tick(obs(now_mono=1.0), [])
    meter.on_tick(obs(now_mono=2.0), [])  # nothing arrived at the gate in between
    assert state(parts)["capacity"]["saturation"] == 0.0
    assert parts.registry.get_sample_value("autopilot_saturation") == 0.0
    assert parts.registry.get_sample_value("autopilot_capacity_rps") is None  # no cost model ready
    ports = {"server": {"port": parts.config.server.port}, "admin": {"port": parts.config.admin.port}}
    write_config(path, **ports, control={"policy": "static"})
    assert (await Reloader(parts)._reload())["ok"]
    assert meter.slo is None and meter.policy is not None and meter.policy.mean_step_share == 1.0


def test_the_stat_logger_records_each_finished_requests_tokens() -> None:
    """vLLM's own stats types in, the window's mix out: prompts less their prefix-cache hits."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    from controller.engine.runtime.stats import stat_logger_factory

    clock = FakeClock(5.0)
    window, feed = TelemetryWindow(10.0, clock), StepFeed(clock=clock)
    feed.watch(window.update)
    it = IterationStats()
    it.finished_requests = [
        FinishedRequestStats(
            FinishReason.LENGTH, num_prompt_tokens=300, num_cached_tokens=100, num_generation_tokens=50
        ),
        FinishedRequestStats(FinishReason.STOP, num_prompt_tokens=200, num_generation_tokens=10),
    ]
    logger = stat_logger_factory(feed)(None, 0)  # type: ignore[arg-type]  # the factory reads no config
    logger.record(SchedulerStats(num_running_reqs=3, kv_cache_usage=0.2), it)
    assert window.finished_mix() == FinishedMix(2, 200.0, 30.0, pytest.approx(100 / 500))

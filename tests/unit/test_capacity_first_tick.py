"""The capacity meter's first tick: a replica that nothing has reached since the meter started reads
offered 0 and saturation 0 at once (an autoscaler sees a sample from the first tick, with or without
``[slo]``); one that requests have reached has no rate until a second tick spans them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from controller.admin.metrics import Metrics
from controller.clock import FakeClock
from controller.control.capacity import CapacityMeter
from controller.control.telemetry import TelemetryWindow
from policies.cost import CostEstimate
from policies.slo_targets import SloBound, SloTargets
from policies.static import StaticPolicy
from tests.helpers import EngineKnobsInForce, GateTotals, PolicyHolder, Steering, obs

SLO = SloTargets(SloBound(ttft_s=2.0, tpot_s=0.050))
POLICY = StaticPolicy(max_num_seqs=64, initial_limit=8)
COST = CostEstimate(
    a_s=0.010, b_s_per_prefill_token=1e-4, c_s_per_decode_seq=1e-3, d_s_per_kv_token=1e-6,
    samples=500, rejected=0, rel_error=0.05, r2=0.9, age_s=0.1, ready=True, reason="ready",
    kv_tokens_per_seq=1000.0,
)  # fmt: skip


def _meter(gate: GateTotals, slo: SloTargets | None) -> tuple[CapacityMeter, CollectorRegistry]:
    meter = CapacityMeter(TelemetryWindow(10.0, FakeClock(100.0)), gate, Steering(slo, POLICY))
    registry = CollectorRegistry()
    live = Metrics(registry).live  # the gauges read at each scrape, as the daemon's do
    live.read_from(gate, EngineKnobsInForce(), PolicyHolder(POLICY))
    live.read_capacity(meter)
    return meter, registry


def test_the_first_tick_of_an_idle_replica_reads_saturation_zero_with_slo() -> None:
    meter, registry = _meter(GateTotals(), SLO)
    meter.on_tick(obs(now_mono=100.0, cost=COST), [])
    assert (meter.last.offered_rps, meter.last.saturation, meter.last.capacity_rps) == (0.0, 0.0, None)
    assert meter.last.reason == "mix: 0 requests finished in 10 s < 3"
    assert registry.get_sample_value("autopilot_saturation") == 0.0
    assert registry.get_sample_value("autopilot_capacity_rps") is None


def test_the_first_tick_of_an_idle_replica_reads_saturation_zero_without_slo() -> None:
    """Drop-in mode without --slo-ttft/--slo-tpot: no [slo], no cost model yet."""
    meter, registry = _meter(GateTotals(), None)
    meter.on_tick(obs(now_mono=100.0, cost=None), [])
    assert (meter.last.offered_rps, meter.last.saturation) == (0.0, 0.0)
    assert meter.last.reason.startswith("no [slo] table")
    assert registry.get_sample_value("autopilot_saturation") == 0.0


def test_totals_the_gate_had_before_the_meter_started_are_not_arrivals() -> None:
    """A meter built over a gate that already counted requests (a rebuilt loop) starts from them."""
    meter, _registry = _meter(GateTotals(admitted=40, rejected=2, queued=1), SLO)
    meter.on_tick(obs(now_mono=100.0, cost=COST), [])
    assert (meter.last.offered_rps, meter.last.saturation) == (0.0, 0.0)


def test_a_request_before_the_first_tick_leaves_the_rate_to_the_second() -> None:
    gate = GateTotals()
    meter, registry = _meter(gate, SLO)
    gate.queued = 1  # one request waits in the gate at the first tick
    meter.on_tick(obs(now_mono=100.0, cost=COST), [])
    assert (meter.last.offered_rps, meter.last.saturation) == (None, None)
    assert meter.last.reason == "offered rate: one tick so far"
    assert registry.get_sample_value("autopilot_saturation") is None
    gate.queued, gate.admitted, gate.rejected = 0, 3, 1  # it and three more: 3 in the next 2 s
    meter.on_tick(obs(now_mono=102.0, cost=COST), [])
    assert meter.last.offered_rps == 1.5


def test_an_idle_second_tick_still_reads_zero() -> None:
    meter, registry = _meter(GateTotals(), SLO)
    for t in (100.0, 101.0):
        meter.on_tick(obs(now_mono=t, cost=COST), [])
    assert (meter.last.offered_rps, meter.last.saturation) == (0.0, 0.0)
    assert registry.get_sample_value("autopilot_saturation") == 0.0

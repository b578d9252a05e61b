"""autopilot_saturation on the twin (deterministic, virtual time): the daemon's capacity meter, wired
into the twin's loop as in the daemon, reads below 1 at a load the slo policy serves whole and above 1
at one past what it serves, and its capacity is near the goodput measured at that overload."""

from __future__ import annotations

import asyncio
import statistics

from controller.config.load import AdmissionConfig, ControlConfig
from controller.sim.twin import build_simulation, slo_for
from tests.sim.scenarios import PROFILE, shape

SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.05


def run(rate: float) -> tuple[float, float, float]:
    """Median saturation and capacity over the steady part of 120 s of Poisson load, and the goodput."""
    admission = AdmissionConfig(limit=PROFILE.engine.max_num_seqs)
    slo = slo_for(admission, SLO_TTFT_S, SLO_TPOT_S)
    sim = build_simulation(PROFILE, ControlConfig(policy="slo"), admission, slo=slo)
    result = asyncio.run(sim.run(shape(rate, 120.0, seed=3)))
    steady = [c for t, c in sim.capacity.history if 30.0 <= t <= 120.0]
    assert steady and all(c.reason == "ok" for c in steady), {c.reason for c in steady}
    saturation = statistics.median(c.saturation for c in steady if c.saturation is not None)
    capacity = statistics.median(c.capacity_rps for c in steady if c.capacity_rps is not None)
    goodput = float(result.summary(SLO_TTFT_S, SLO_TPOT_S)["goodput_rps"])
    print(f"{rate:g}/s: saturation {saturation:.2f}, capacity {capacity:.1f}/s, goodput {goodput:.1f}/s")
    return saturation, capacity, goodput


def test_saturation_crosses_one_where_goodput_stops_following_the_load() -> None:
    light_saturation, _, light_goodput = run(10.0)
    heavy_saturation, capacity, heavy_goodput = run(30.0)
    assert light_saturation < 1.0 < heavy_saturation
    assert light_goodput > 0.95 * 10.0  # below 1: the replica serves what it is offered, within the SLO
    assert heavy_goodput < 0.7 * 30.0  # above 1: it cannot
    # the model's capacity is what the replica serves at overload, give or take its planning margins
    assert 0.8 <= capacity / heavy_goodput <= 1.3

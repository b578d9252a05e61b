"""Control quality of the slo policy on the twin (deterministic, virtual time): it holds its knobs
still at a steady load and settles within 10 s after a 2x step in load."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from controller.config.load import AdmissionConfig, ControlConfig
from controller.control.knobs import KNOBS
from controller.control.loop import Change
from controller.load.workload import RequestSpec
from controller.sim.run import SimResult
from controller.sim.twin import build_simulation, slo_for
from tests.sim.scenarios import PROFILE, uniform, uniform_step

STEP_AT, END = 60.0, 180.0


def run(specs: Sequence[RequestSpec]) -> SimResult:
    admission = AdmissionConfig(limit=PROFILE.engine.max_num_seqs)
    control = ControlConfig(policy="slo")
    sim = build_simulation(PROFILE, control, admission, slo=slo_for(admission, 1.0, 0.05))
    return asyncio.run(sim.run(specs))


def reversals_per_minute(changes: Sequence[Change], knob: str, t_from: float, t_to: float) -> list[int]:
    """Direction changes of ``knob`` in each whole minute of ``[t_from, t_to)``."""
    counts = [0] * int((t_to - t_from) // 60)
    last = 0
    for c in changes:
        if c.knob != knob:
            continue
        direction = 1 if c.new > c.old else -1
        k = int((c.t_mono - t_from) // 60)
        if last and direction != last and 0 <= k < len(counts):
            counts[k] += 1
        last = direction
    return counts


def test_at_a_steady_load_each_knob_reverses_at_most_twice_a_minute() -> None:
    for rate in (10.0, 30.0):  # light, and past what the engine serves within the TPOT bound
        result = run(uniform(rate, 245.0))
        for knob in (k.name for k in KNOBS):
            # from 5 s: the start runs one request until the first ones say what they ask, then
            # opens (a slow start, ``SloPolicy._concurrency``), a reversal that is no oscillation
            per_minute = reversals_per_minute(result.changes, knob, 5.0, 245.0)
            moves = sum(1 for c in result.changes if c.knob == knob and c.t_mono >= 60.0)
            print(f"slo at {rate:g}/s {knob}: reversals per minute {per_minute}, moves after 60 s {moves}")
            assert max(per_minute) <= 2


def test_after_a_2x_step_the_knobs_settle_within_10s() -> None:
    result = run(uniform_step(10.0, STEP_AT, END - STEP_AT))
    after = [c for c in result.changes if STEP_AT < c.t_mono <= END]  # the drain after END is no load
    for c in after:
        print(f"{c.t_mono:.0f} s {c.knob} {c.old} -> {c.new}: {c.reason}")
    last = max((c.t_mono for c in after), default=STEP_AT)
    assert last - STEP_AT <= 10.0, f"a knob still moved {last - STEP_AT:.0f} s after the step"
    assert result.preemptions == 0


def test_the_twin_judges_each_served_request_as_the_daemons_ledger_does() -> None:
    """The slo policy's mean margin learns from the served and missed totals: the twin counts them
    with the daemon's ledger, so its margin moves as the daemon's would on the same outcomes."""
    from controller.results.records import meets_slo

    admission = AdmissionConfig(limit=PROFILE.engine.max_num_seqs)
    sim = build_simulation(PROFILE, ControlConfig(policy="slo"), admission, slo=slo_for(admission, 1.0, 0.05))
    result = asyncio.run(sim.run(uniform(30.0, 120.0)))
    served = [r for r in result.records if r.status == "ok"]
    missed = [r for r in served if not meets_slo(r, 1.0, 0.05)]
    assert (sim.outcomes.served_total, sim.outcomes.missed_total) == (len(served), len(missed))
    assert sim.observe().served_total == len(served) > 0
    margins = {c.reason.split("margin ")[1].split(":")[0] for c in result.changes if "margin " in c.reason}
    print(f"served {len(served)}, missed {len(missed)}; margins in the decisions: {sorted(margins)}")

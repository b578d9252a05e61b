"""The front end under load: tables by requests in flight, their place in a profile, how the twin picks
one, and how ``bench calibrate`` measures them (open-loop phases replayed through the twin)."""

from __future__ import annotations

import argparse
import dataclasses
import random

import pytest

from controller.bench.calibrate.measure import LoadPhase, load_workload
from controller.bench.calibrate.run import (
    LOAD_RAMP_S,
    in_flight_at_send,
    in_flight_list,
    loaded_delays,
    prompt_list,
)
from controller.load.workload import RequestSpec
from controller.profiles.load import (
    Profile,
    ProfileError,
    Variance,
    dump_profile,
    load_profile,
    parse_profile,
)
from controller.profiles.quantiles import LoadTables, QuantileTable, parse_load_tables
from tests.sim.scenarios import COST, LIMITS, PROFILE, simulate


def flat(v: float) -> QuantileTable:
    return QuantileTable((v, v), samples=100)


def test_a_request_gets_the_table_of_its_load_level() -> None:
    tables = LoadTables((1, 4, 8), (flat(0.01), flat(0.02), flat(0.03)))
    picked = [tables.table_for(n).values[0] for n in (0, 1, 3, 4, 7, 8, 500)]
    assert picked == [0.01, 0.01, 0.01, 0.02, 0.02, 0.03, 0.03]
    with pytest.raises(ValueError, match="ascending"):
        LoadTables((4, 1), (flat(0.01), flat(0.02)))
    with pytest.raises(ValueError, match=">= 1"):
        LoadTables((0,), (flat(0.01),))
    with pytest.raises(ValueError, match="one quantile table per level"):
        LoadTables((1, 2), (flat(0.01),))


def test_levels_short_of_samples_join_their_neighbours() -> None:
    pairs = [(1, 0.001)] * 30 + [(2, 0.002)] * 80 + [(5, 0.005)] * 120 + [(40, 0.04)] * 10
    tables = LoadTables.from_samples(pairs, edges=(1, 2, 4, 8, 16, 32, 64), min_samples=100)
    assert tables is not None
    # 1-3 in flight: 30 + 80 = 110 delays; 4 and up: 120, plus the 10 at 40 (too few alone)
    assert tables.levels == (1, 4)
    assert [t.samples for t in tables.tables] == [110, 130]
    assert tables.tables[1].values[-1] == 0.04
    assert (
        LoadTables.from_samples([(3, 0.1)] * 99 + [(0, 0.1)] * 500, (1, 2), 100) is None
    )  # idle ones don't count


def test_profile_round_trip_with_load_tables_and_their_errors() -> None:
    loaded = LoadTables((1, 8), (QuantileTable((0.004, 0.006, 0.02), 150), QuantileTable((0.01, 0.05), 300)))
    profile = dataclasses.replace(PROFILE, variance=Variance(frontend=flat(0.005), frontend_loaded=loaded))
    text = dump_profile(profile)
    assert "[variance.frontend_loaded]" in text
    back = parse_profile(text, "x")
    assert back.variance == profile.variance
    assert "frontend_loaded" in back.variance.as_dict()
    with pytest.raises(ProfileError, match="levels, samples and quantiles must be lists of the same length"):
        parse_profile(text.replace("levels = [1, 8]", "levels = [1]"), "x")
    with pytest.raises(ProfileError, match="ascending"):
        parse_profile(text.replace("levels = [1, 8]", "levels = [8, 1]"), "x")
    with pytest.raises(ValueError, match="write it as levels"):
        parse_load_tables({"levels": [1]}, "x")


def test_the_shipped_cpu_profile_measured_the_front_end_under_load() -> None:
    loaded = load_profile("cpu-tiny").variance.frontend_loaded
    assert loaded is not None and loaded.levels[0] == 1
    assert all(t.samples >= 100 for t in loaded.tables)


IDLE_S, BUSY_S = 0.004, 0.050


def two_tables() -> Profile:
    loaded = LoadTables((1,), (flat(BUSY_S),))
    return dataclasses.replace(PROFILE, variance=Variance(frontend=flat(IDLE_S), frontend_loaded=loaded))


def test_only_a_request_that_finds_others_in_flight_draws_from_the_load_table() -> None:
    # request 0 alone; 1 arrives while 0 is still decoding (200 tokens take about a second); 2 arrives
    # after both ended
    specs = [RequestSpec(0, 0.0, 100, 200), RequestSpec(1, 0.1, 100, 4), RequestSpec(2, 30.0, 100, 4)]
    idle_only = dataclasses.replace(PROFILE, variance=Variance(frontend=flat(IDLE_S)))
    base = {r.index: r.ttft_s for r in simulate(specs, "static", profile=idle_only).records}
    loaded = {r.index: r.ttft_s for r in simulate(specs, "static", profile=two_tables()).records}
    assert loaded[0] == pytest.approx(base[0]) and loaded[2] == pytest.approx(base[2])
    # request 1 enters the engine BUSY_S - IDLE_S later; its first token waits for the step then running
    assert loaded[1] is not None and base[1] is not None
    assert loaded[1] - base[1] == pytest.approx(BUSY_S - IDLE_S, abs=0.02)
    assert loaded[1] - base[1] > 0.03


def test_requests_still_in_their_front_end_count_as_in_flight() -> None:
    # two requests 1 ms apart: the second finds the first in its front end (not yet in the engine)
    specs = [RequestSpec(0, 0.0, 100, 4), RequestSpec(1, 0.001, 100, 4)]
    result = {r.index: r.ttft_s for r in simulate(specs, "static", profile=two_tables()).records}
    assert result[0] is not None and result[1] is not None
    assert result[1] > BUSY_S > result[0]


def test_requests_parked_in_the_gate_do_not_load_the_front_end() -> None:
    # 0 and 1 decode about a second each; 2 arrives while 0 runs and 1 waits in the gate (limit 1):
    # two requests in flight, one busy in the front end and engine, one an awaited future
    specs = [RequestSpec(0, 0.0, 100, 200), RequestSpec(1, 0.1, 100, 200), RequestSpec(2, 0.3, 100, 4)]
    slow_s = 5.0
    loaded = LoadTables((1, 2), (flat(BUSY_S), flat(slow_s)))
    profile = dataclasses.replace(PROFILE, variance=Variance(frontend=flat(IDLE_S), frontend_loaded=loaded))
    gated_run = simulate(specs, "static", {"admission_limit": 1}, profile=profile)
    gated = {r.index: r.ttft_s for r in gated_run.records}
    # 2 draws the one-busy table: it enters the gate at 0.3 s + BUSY_S and is served after 0 and 1,
    # about 2 s later
    assert gated[2] is not None and gated[2] < slow_s
    # with the gate open (limit at max_num_seqs) both others are in the engine: 2 draws the two-busy table
    open_gate = {r.index: r.ttft_s for r in simulate(specs, "static", profile=profile).records}
    assert open_gate[2] is not None and open_gate[2] > slow_s


def test_load_tables_keep_runs_deterministic_per_seed() -> None:
    loaded = LoadTables((1, 4), (QuantileTable((0.002, 0.01, 0.04), 100), QuantileTable((0.01, 0.1), 100)))
    profile = dataclasses.replace(PROFILE, variance=Variance(frontend=flat(IDLE_S), frontend_loaded=loaded))
    specs = [RequestSpec(k, k * 0.02, 100, 30) for k in range(100)]
    one, two = (
        simulate(specs, "static", profile=profile, seed=5),
        simulate(specs, "static", profile=profile, seed=5),
    )
    other = simulate(specs, "static", profile=profile, seed=6)
    assert one.records == two.records and one.records != other.records
    assert one.summary(None, None)["variance"] == ["frontend", "frontend_loaded"]


def test_in_flight_at_send_counts_the_others_sent_and_not_ended() -> None:
    specs = tuple(RequestSpec(k, t, 10, 10) for k, t in enumerate((0.0, 0.1, 0.2, 0.5)))
    phase = LoadPhase(specs, {k: 0.01 for k in range(4)}, {0: 0.3, 1: 0.05, 2: 0.4, 3: 0.1})
    # at 0.1: request 0 (0.0-0.3); at 0.2: request 0 (1 ended at 0.15); at 0.5: request 2 (0.2-0.6)
    assert in_flight_at_send(phase) == {0: 0, 1: 1, 2: 1, 3: 1}


def test_loaded_delays_are_what_the_engine_model_does_not_explain() -> None:
    # "measured" = the twin itself with a constant 12 ms front end: every entry shifts by 12 ms, so
    # the replay without a front end must find exactly 12 ms per request
    rng = random.Random(3)
    specs = load_workload(COST, LIMITS, in_flight=6, requests=120, rng=rng)
    measured = simulate(
        specs,
        "static",
        profile=dataclasses.replace(PROFILE, frontend_s=0.012),
    )
    ok = [r for r in measured.records if r.ttft_s is not None and r.e2e_s is not None]
    phase = LoadPhase(
        tuple(specs), {r.index: r.ttft_s for r in ok if r.ttft_s}, {r.index: r.e2e_s for r in ok if r.e2e_s}
    )
    pairs = loaded_delays(COST, LIMITS, phase, ramp_s=0.0)
    assert len(pairs) == len(ok) == 120
    assert [d for _, d in pairs] == pytest.approx([0.012] * 120, abs=1e-9)
    assert max(n for n, _ in pairs) >= 2  # the phase did load the twin
    # the default leaves out the ramp-up: requests sent in the phase's first LOAD_RAMP_S seconds
    after_ramp = [s for s in specs if s.arrival_s >= LOAD_RAMP_S]
    assert 0 < len(after_ramp) < 120
    assert len(loaded_delays(COST, LIMITS, phase)) == len(after_ramp)


def test_load_workload_rate_follows_the_in_flight_target() -> None:
    light = load_workload(COST, LIMITS, in_flight=2, requests=300, rng=random.Random(1))
    heavy = load_workload(COST, LIMITS, in_flight=20, requests=300, rng=random.Random(1))
    assert len(light) == len(heavy) == 300
    assert heavy[-1].arrival_s < light[-1].arrival_s / 5  # about 10x the rate (a bit less: longer steps)
    assert all(16 <= s.prompt_tokens <= 1024 and 1 <= s.output_tokens <= 128 for s in light + heavy)
    assert all(s.prompt_tokens + s.output_tokens <= LIMITS.max_model_len for s in heavy)
    assert [s.index for s in heavy] == list(range(300))
    short = load_workload(COST, LIMITS, in_flight=2, requests=300, rng=random.Random(1), max_prompt=256)
    assert max(s.prompt_tokens for s in short) <= 256 < max(s.prompt_tokens for s in light)


def test_the_load_in_flight_option() -> None:
    assert in_flight_list("2,6, 12") == (2, 6, 12)
    assert in_flight_list("") == ()
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
        in_flight_list("0,4")
    with pytest.raises(argparse.ArgumentTypeError, match="like 2,6,12,24"):
        in_flight_list("two")


def test_the_prefill_prompts_option() -> None:
    assert prompt_list("256, 16,64,16") == (16, 64, 256)  # sorted, once each
    for bad, why in (("16", "at least two"), ("0,16", ">= 1"), ("16,x", "prompt lengths like")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            prompt_list(bad)

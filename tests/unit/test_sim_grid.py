"""The alternating load (bench/workload.alternate) and simulate --grid's parsing and configurations."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config.load import AdmissionConfig, ControlConfig
from controller.load.workload import RequestSpec, WorkloadError, alternate, parse_alternate, trace_load
from controller.sim.grid import parse_grid, runs


def load(times: list[float], tokens: int) -> list[RequestSpec]:
    return [RequestSpec(i, t, tokens, 1) for i, t in enumerate(times)]


def test_phases_alternate_and_each_load_plays_on_from_where_it_stopped() -> None:
    a = load([0.0, 4.0, 11.0, 15.0], 100)  # wraps after 15 + 15 / 4 = 18.75 s
    b = load([1.0, 2.0, 9.0], 200)  # wraps after 9 + 8 / 3 s
    out = alternate([a, b], phase_s=10.0, total_s=40.0)
    got = [(round(s.arrival_s, 3), s.prompt_tokens) for s in out]
    assert got == [
        (0.0, 100), (4.0, 100),  # phase 0: a [0, 10)
        (11.0, 200), (12.0, 200), (19.0, 200),  # phase 1: b [0, 10)
        (21.0, 100), (25.0, 100), (28.75, 100),  # phase 2: a [10, 20), its start again at 18.75
        (32.667, 200), (33.667, 200),  # phase 3: b [10, 20) from its start at 11.667
    ]  # fmt: skip
    assert [s.index for s in out] == list(range(len(out)))
    with pytest.raises(WorkloadError):
        alternate([a, []], 10.0, 40.0)


def test_an_alternate_trace_names_its_scale_and_optionally_its_start(tmp_path: Path) -> None:
    assert parse_alternate("code.csv:2") == (Path("code.csv"), 2.0, 0.0)
    assert parse_alternate("traces/code.csv:0.5:600") == (Path("traces/code.csv"), 0.5, 600.0)
    assert parse_alternate("/a:b/code.csv:3") == (Path("/a:b/code.csv"), 3.0, 0.0)
    with pytest.raises(WorkloadError, match="TRACE:SCALE or TRACE:SCALE:START"):
        parse_alternate("code.csv")
    conv, code = tmp_path / "conv.csv", tmp_path / "code.csv"
    rows = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:00:{s:02d}.000000,{{n}},10\n" for s in range(0, 40, 2)
    )
    conv.write_text(rows.replace("{n}", "100"))
    code.write_text(rows.replace("{n}", "2000"))
    specs, desc = trace_load(conv, start_s=10.0, duration_s=None, time_scale=2.0, token_scale=0.5,
                             alternates=[f"{code}:1:20"], phase_s=4.0, total_s=8.0)  # fmt: skip
    # conv from 10 s at 2x: one request a second; code from 20 s at 1x: one every 2 s
    assert [(s.arrival_s, s.prompt_tokens) for s in specs] == [
        (0.0, 50), (1.0, 50), (2.0, 50), (3.0, 50), (4.0, 1000), (6.0, 1000)
    ]  # fmt: skip
    assert desc.endswith("alternating every 4 s for 8 s")


def test_the_grid_needs_every_axis_and_runs_policy_defaults_then_points() -> None:
    grid = parse_grid(["limit=24,48", "budget=1024", "deadline=0.8,5"])
    assert grid == {"limit": [24, 48], "budget": [1024], "deadline": [0.8, 5.0]}
    with pytest.raises(ValueError, match="deadline missing"):
        parse_grid(["limit=24", "budget=1024"])
    with pytest.raises(ValueError, match="KEY one of limit, budget, deadline"):
        parse_grid(["limt=24"])
    todo = runs(grid, ControlConfig(policy="slo"), AdmissionConfig(limit=1024))
    assert [r.name for r in todo] == [
        "slo", "defaults", "static L24 B1024 D0.8", "static L24 B1024 D5", "static L48 B1024 D0.8",
        "static L48 B1024 D5",
    ]  # fmt: skip
    point = todo[2]
    assert point.control.policy == "static"
    assert point.control.params == {"admission_limit": 24, "max_num_scheduled_tokens": 1024}
    assert {c.queue_deadline_s for c in point.admission.classes} == {0.8}
    assert todo[1].admission == AdmissionConfig(limit=1024)


def test_the_bench_slo_becomes_the_daemons_when_the_config_has_none() -> None:
    import argparse

    from controller.bench.targets import steer_to_slo

    args = argparse.Namespace(slo_ttft=1.0, slo_tpot=0.05)
    base: dict[str, dict[str, float]] = {}
    steer_to_slo(base, args)
    assert base["slo"] == {"ttft_s": 1.0, "tpot_s": 0.05}
    own = {"slo": {"ttft_s": 2.5, "tpot_s": 0.07}}
    steer_to_slo(own, args)
    assert own["slo"] == {"ttft_s": 2.5, "tpot_s": 0.07}  # the config's own [slo] stands
    steer_to_slo(none := {}, argparse.Namespace(slo_ttft=1.0, slo_tpot=None))
    assert none == {}


def test_simulate_steers_to_its_slo_when_the_config_has_none() -> None:
    from controller.profiles.load import load_profile
    from controller.sim.twin import with_config

    _, control, admission, slo = with_config(load_profile("cpu-tiny"), None, "slo", {}, (1.0, 0.05))
    assert slo is not None and slo.for_class("interactive") == (1.0, 0.05)
    assert [name for name, _ in slo.by_class] == [c.name for c in admission.classes]
    assert control.policy == "slo"

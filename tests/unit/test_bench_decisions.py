"""Tables, recommendations and verdicts of compare / sweep / soak, on made-up summaries and series."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from controller.bench.experiments import compare, soak, sweep
from controller.bench.targets import Bench, parse_assignments, parse_value
from controller.results import tables
from controller.results.records import SeriesPoint


def summary(target: str, goodput: float, tok: float, ttft99: float | None = 1.0, **kw: Any) -> dict[str, Any]:
    base = {
        "target": target, "goodput_rps": goodput, "throughput_tok_s": tok, "ttft_p99": ttft99,
        "requests": 10, "ok": 10, "refused": 0, "failed": 0, "duration_s": 100.0,
    }  # fmt: skip
    return {**base, **kw}


def test_best_static_is_the_static_server_with_the_most_goodput() -> None:
    runs = [
        summary("vllm-serve", 9.0, 900.0),  # not static: never the reference
        summary("static:interactive", 5.0, 400.0),
        summary("static:throughput", 5.0, 600.0),  # same goodput, more throughput
        summary("policy:pid", 6.0, 500.0),
    ]
    assert tables.best_static(runs)["target"] == "static:throughput"  # type: ignore[index]
    text = tables.table(runs)
    row = next(line for line in text.splitlines() if line.startswith("| policy:pid"))
    # ratios to static:throughput: 500/600 tok/s, 6/5 goodput, 1/1 TTFT p99
    assert row.endswith("| 0.83 | 1.20 | 1.00 |")
    assert "static:throughput (best static)" in text
    assert tables.best_static([summary("vllm-serve", 1.0, 1.0)]) is None


def test_table_cells_for_missing_values() -> None:
    text = tables.table([summary("static:small", 0.0, 0.0, ttft99=None)])
    row = text.splitlines()[2]
    assert "| - |" in row  # no TTFT: a dash, and no ratio against a zero goodput


def test_twin_table_joins_p50_and_p99_and_dashes_what_is_unknown() -> None:
    row = {
        "config": "slo",
        "goodput_rps": 1.7,
        "slo_attainment": 0.312,
        "throughput_tok_s": 86.6,
        "ttft_p50": 0.6806,
        "ttft_p99": None,
        "tpot_p99": 0.0851,
        "engine_preemptions": 0,
        "limit_changes": 21,
        "queue_depth_max": None,
    }
    head, rule, line = tables.render_table(tables.SIM_COLUMNS, [row]).splitlines()
    assert line == "| slo | 1.70 | 31.2% | 87 | 0.681 / - | 85 | 0 | 21 | - |"
    assert head.count("|") == rule.count("|") == len(tables.SIM_COLUMNS) + 1


def test_cell_scales_seconds_to_milliseconds_and_puts_the_unit_only_after_a_figure() -> None:
    assert tables.cell(0.0851, "ms") == "85.1"
    assert tables.cell(0.0851, "ms.0f", " ms") == "85 ms"
    assert tables.cell(None, "ms.0f", " ms") == "-"


def _args(**kw: Any) -> argparse.Namespace:
    base = {"targets": "all", "best": None, "best_from": None, "policy_param": None}
    return argparse.Namespace(**{**base, **kw})


def _bench() -> Bench:
    engine = {"model": "/m", "max_num_seqs": 256, "max_num_batched_tokens": 512, "kv_cache_memory_bytes": 1}
    return Bench({"engine": engine, "admission": {"limit": 64}}, [], None, _args())  # type: ignore[arg-type]


def test_compare_servers_expand_in_a_fixed_order() -> None:
    specs = compare.servers(_bench(), _args(best=["max_num_seqs=32"], policy_param=["pid.setpoint=0.9"]))
    names = [s.name for s in specs]
    assert names[0] == "vllm-serve"
    assert names[1:5] == [f"static:{p}" for p in compare.presets()]
    assert names[5] == "best:static:max_num_seqs=32"
    assert names[6:] == [f"policy:{p}" for p in compare.policies()]
    baseline = specs[0]
    assert baseline.kind == "vllm-serve" and "max_num_seqs" not in baseline.engine  # vLLM's defaults
    assert "max_num_batched_tokens" not in baseline.engine and baseline.engine["kv_cache_memory_bytes"] == 1
    best = specs[5]
    assert best.engine["max_num_seqs"] == 32 and best.admission["limit"] == 32
    assert best.control == {"policy": "static", "params": {}}
    pid = next(s for s in specs if s.name == "policy:pid")
    assert pid.control == {"policy": "pid", "params": {"setpoint": 0.9}}
    assert [s.name for s in compare.servers(_bench(), _args())][5] == "policy:hysteresis"  # no best: skipped


def test_compare_daemon_and_vllm_serve_with_the_same_engine() -> None:
    daemon, serve = compare.servers(_bench(), _args(targets="daemon,vllm-serve:engine"))
    assert daemon.kind == "daemon" and daemon.admission["limit"] == 256  # = max_num_seqs: nothing queues
    assert daemon.control == {"policy": "static", "params": {}}
    assert serve.kind == "vllm-serve" and serve.engine == _bench().engine  # tuned settings kept


def test_the_best_of_a_vllm_serve_sweep_runs_as_vllm_serve(tmp_path: Path) -> None:
    rec = {"setting": {"max_num_seqs": 4, "max_num_batched_tokens": 64}, "goodput_rps": 0.3}
    (tmp_path / "sweep.json").write_text(json.dumps({"server": "vllm-serve", "recommendation": rec}))
    (best,) = compare.servers(_bench(), _args(targets="best", best_from=tmp_path))
    assert best.name == "best:vllm-serve:max_num_seqs=4,max_num_batched_tokens=64"
    assert best.kind == "vllm-serve" and best.engine["max_num_batched_tokens"] == 64
    (tmp_path / "sweep.json").write_text(json.dumps({"recommendation": rec}))  # a daemon sweep's
    (best,) = compare.servers(_bench(), _args(targets="best", best_from=tmp_path))
    assert best.kind == "daemon" and best.admission["limit"] == 4


def test_compare_target_errors() -> None:
    with pytest.raises(ValueError, match="no such preset; use one of"):
        compare.servers(_bench(), _args(targets="static:huge"))
    with pytest.raises(ValueError, match="names a server twice"):
        compare.servers(_bench(), _args(targets="vllm-serve,vllm-serve"))
    with pytest.raises(ValueError, match="--targets 'nginx'"):
        compare.servers(_bench(), _args(targets="nginx"))
    with pytest.raises(ValueError, match=r"POLICY\.KEY=VALUE"):
        compare.policy_params(["setpoint=1"])


def test_assignments_and_values() -> None:
    assert parse_value("32") == 32 and parse_value("0.9") == 0.9 and parse_value("true") is True
    assert parse_value("priority") == "priority"
    assert parse_assignments(["a=1", " b = x "], "--engine") == {"a": 1, "b": "x"}
    with pytest.raises(ValueError, match="--engine 'oops': write KEY=VALUE"):
        parse_assignments(["oops"], "--engine")


def test_sweep_settings_grid_and_recommendation() -> None:
    sets = sweep.parse_sets(["max_num_seqs=8,16", "max_num_batched_tokens=256,512"])
    combos = sweep.settings(sets)
    assert combos[0] == {"max_num_seqs": 8, "max_num_batched_tokens": 256} and len(combos) == 4
    with pytest.raises(ValueError, match="one or two settings"):
        sweep.parse_sets(["a=1", "b=2", "c=3"])
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        sweep.parse_sets(["max_num_seqs="])
    runs = [
        summary("s8", 2.0, 100.0, sweep={"max_num_seqs": 8}, rss_max_bytes=100),
        summary("s16", 3.0, 150.0, sweep={"max_num_seqs": 16}, rss_max_bytes=300),
        summary(
            "s32", 3.0, 170.0, sweep={"max_num_seqs": 32}, rss_max_bytes=200
        ),  # same goodput, less memory
    ]
    rec = sweep.recommend(runs)
    assert rec is not None and rec["setting"] == {"max_num_seqs": 32}
    assert sweep.recommend([summary("s", 0.0, 0.0, sweep={})]) is None


def _series(tok: list[float], rss: list[int] | None = None, ttft: float = 0.1) -> list[SeriesPoint]:
    rss = rss or [1000] * len(tok)
    return [
        SeriesPoint(t_s=float(i + 1), output_tok_s=t, rss_bytes=r, ttft_p50_s=ttft)
        for i, (t, r) in enumerate(zip(tok, rss, strict=True))
    ]


LIMITS = soak.SoakVerdictLimits(
    window_s=10.0, max_decay=0.2, max_ttft_growth=3.0, max_rss_growth=0.1, max_failed=0.01
)


def test_soak_passes_a_steady_run() -> None:
    ok, reasons, figures = soak.verdict(summary("s", 1, 1, duration_s=40.0, server_alive_at_end=True),
                                        _series([100.0] * 40), LIMITS)  # fmt: skip
    assert ok and reasons == []
    assert figures["throughput_first_tok_s"] == 100.0 and figures["rss_growth"] == pytest.approx(0.0)


def test_soak_fails_on_decay_rss_growth_restarts_failures_and_exit() -> None:
    tok = [100.0] * 30 + [70.0] * 10  # last window 30 % below the first
    rss = [1000 + 10 * i for i in range(40)]  # +10 per s: line from 1100 at t=11 to 1390 at t=40, +26.4 %
    s = summary("s", 1, 1, duration_s=40.0, failed=2, engine_restarts=1.0, server_alive_at_end=False,
                exit_code=-9)  # fmt: skip
    ok, reasons, figures = soak.verdict(s, _series(tok, rss), LIMITS, log_text="")
    assert not ok
    assert figures["rss_growth"] == pytest.approx(290 / 1100)
    assert reasons == [
        "server exited during the run (exit code -9); looks like an OOM kill",
        "1 engine restart(s) during the run",
        "20.0% of requests failed (limit 1.0%)",
        "throughput decayed from 100 to 70 tok/s (limit -20%)",
        "resident memory grew 26.4% over the run (limit 10%)",
    ]


def test_soak_ttft_growth() -> None:
    series = _series([100.0] * 20) + [
        SeriesPoint(t_s=float(21 + i), output_tok_s=100.0, rss_bytes=1000, ttft_p50_s=0.5) for i in range(20)
    ]
    ok, reasons, _ = soak.verdict(summary("s", 1, 1, duration_s=40.0), series, LIMITS)
    assert not ok and reasons == ["median TTFT grew from 0.100 to 0.500 s (limit x3)"]

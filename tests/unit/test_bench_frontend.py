"""``bench frontend``: figures of a burst, ratios of a pair, medians over pairs, the two command lines."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

from controller.bench.experiments import frontend, frontend_layers
from controller.results.records import RequestRecord, Status


def _record(index: int, ttft: float, e2e: float, out: int = 4, status: Status = "ok") -> RequestRecord:
    ok = status == "ok"
    return RequestRecord(
        index=index, priority=0, prompt_tokens=8, output_tokens_requested=4, arrival_s=0.0,
        output_tokens=out if ok else 0, status=status, http_status=200 if ok else 500,
        ttft_s=ttft if ok else None, tpot_s=(e2e - ttft) / (out - 1) if ok else None, e2e_s=e2e,
    )  # fmt: skip


def test_burst_figures_count_tokens_over_the_wall_and_latencies_of_ok_streams() -> None:
    records = [_record(0, 0.1, 0.4), _record(1, 0.3, 0.6), _record(2, 0.0, 0.0, status="failed")]
    b = frontend.burst_figures(records, wall_s=2.0)
    assert b.output_tok_s == pytest.approx(4.0)  # 8 tokens over 2 s
    assert b.ttft_p50_s == pytest.approx(0.2)
    assert b.tpot_p50_s == pytest.approx(0.1)
    assert (b.ok, b.failed) == (2, 1)


def _figures(tok_s: float, ttft: float) -> dict[str, float | None]:
    return {"wall_s": 100 / tok_s, "output_tok_s": tok_s, "ttft_p50_s": ttft, "ttft_p99_s": ttft,
            "tpot_p50_s": None}  # fmt: skip


def test_pair_ratio_is_daemon_over_vllm_serve_and_none_where_a_figure_is_missing() -> None:
    ratio = frontend.pair_ratios(_figures(100.0, 0.2), _figures(90.0, 0.3))
    assert ratio["output_tok_s"] == pytest.approx(0.9)
    assert ratio["ttft_p50_s"] == pytest.approx(1.5)
    assert ratio["tpot_p50_s"] is None


def test_summary_takes_the_median_of_the_pair_ratios_not_the_ratio_of_medians() -> None:
    pairs = []
    for v, d in ((100.0, 50.0), (10.0, 10.0), (200.0, 220.0)):
        vf, df = _figures(v, 0.1), _figures(d, 0.1)
        pairs.append({"vllm-serve": vf, "daemon": df, "ratio": frontend.pair_ratios(vf, df)})
    out = frontend.summary(pairs)
    assert out["median_ratio"]["output_tok_s"] == pytest.approx(1.0)  # 0.5, 1.0, 1.1
    assert out["median"]["daemon"]["output_tok_s"] == pytest.approx(50.0)


def test_run_figures_are_medians_over_bursts() -> None:
    bursts = [frontend.Burst(w, 100 / w, 0.1, 0.2, 0.01, 4, 0) for w in (1.0, 3.0, 2.0)]
    assert frontend.run_figures(bursts)["wall_s"] == 2.0


def test_order_alternates_so_neither_server_always_runs_second() -> None:
    assert [frontend.order(i)[0] for i in range(4)] == ["vllm-serve", "daemon"] * 2


def test_both_servers_get_the_same_engine_flags() -> None:
    engine = {"model": "/m", **frontend.ENGINE_DEFAULTS}
    plain = frontend.server_argv(frontend.VLLM_SERVE, engine, 8000, 9000)
    ours = frontend.server_argv(frontend.DAEMON, engine, 8000, 9000)
    assert plain[plain.index("serve") :] == ours[ours.index("serve") : -2]  # the daemon adds its admin port
    assert ours[-2:] == ["--admin-port", "9000"]
    assert "--dtype" in plain and "--kv-cache-memory-bytes" in plain
    with_file = frontend.server_argv(frontend.DAEMON, engine, 8000, 9000, ["--config=x.toml"])
    assert with_file[-1] == "--config=x.toml"


def test_the_parser_is_registered_and_main_refuses_zero_pairs(tmp_path: Path) -> None:
    from controller.bench.cli import add_bench_commands

    parser = argparse.ArgumentParser()
    add_bench_commands(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["frontend", "--out", str(tmp_path), "--pairs", "0"])
    assert args.streams == 64 and args.output_tokens == 64
    with pytest.raises(ValueError, match="--pairs"):
        frontend.main(args)


def test_table_shows_each_run_its_pair_ratio_and_the_medians() -> None:
    vf, df = _figures(100.0, 0.2), _figures(90.0, 0.3)
    pairs = [{"pair": 0, "order": ["vllm-serve", "daemon"], "vllm-serve": vf, "daemon": df,
              "ratio": frontend.pair_ratios(vf, df)}]  # fmt: skip
    text = frontend.table(pairs, frontend.summary(pairs))
    assert "| 0 | daemon / vllm serve | 1.11x | 0.90x | 1.50x | 1.50x | - |" in text
    assert "| median | daemon | 1.11 | 90.0 | 300.0 | 300.0 | - |" in text


API = 'process 1:"python -m controller serve"'
STACKS = "\n".join([
    f"{API};<module> (controller/__main__.py:3);generate (controller/engine/frontend/client.py:91);"
    "encode (json/encoder.py:10) 30",
    f"{API};<module> (controller/__main__.py:3);run (asyncio/runners.py:1) 10",
    f'{API};process 2:"python -c spawn";EngineCoreProc.run_engine_core (vllm/v1/engine/core.py:9);'
    "schedule (controller/engine/runtime/scheduler.py:80);schedule (vllm/v1/core/sched/scheduler.py:5) 20",
    f'{API};process 3:"python -c spawn";WorkerProc.worker_main (vllm/worker.py:1) 40',
    f'{API};process 4:"python -c tracker";main (resource_tracker.py:1) 1',
])  # fmt: skip


def test_profile_summary_names_processes_by_role_and_counts_ms_per_request() -> None:
    from controller.bench import pyspy

    out = pyspy.summarize(STACKS, requests=10, rate_hz=100)["roles"]
    # 40 samples at 100 Hz over 10 requests: 40 ms per request in the API server
    assert out["api-server"]["cpu_ms_per_request"] == pytest.approx(40.0)
    assert out["engine-core"]["cpu_ms_per_request"] == pytest.approx(20.0)
    assert out["worker"]["cpu_ms_per_request"] == pytest.approx(40.0)
    assert out["other"]["cpu_ms_per_request"] == pytest.approx(1.0)
    ours = dict((label, ms) for label, ms in out["api-server"]["ours"])
    assert ours == {
        "<module> (controller/__main__.py)": 40.0,
        "generate (controller/engine/frontend/client.py)": 30.0,
    }
    engine = dict((label, ms) for label, ms in out["engine-core"]["top"])
    assert engine["schedule (vllm/v1/core/sched/scheduler.py)"] == pytest.approx(20.0)


# -- --layers: the request path's layers over a fake engine ------------------------------------------


@pytest.mark.parametrize("stack", frontend_layers.STACKS)
async def test_every_layered_stack_serves_every_output_of_every_stream(stack: str) -> None:
    app = frontend_layers.build(stack, streams=3, outputs=5)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await asyncio.gather(*(app(dict(frontend_layers.SCOPE), receive, send) for _ in range(3)))
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert statuses == [200] * 3 and len(bodies) == 3 * (5 + 1)


def test_the_layers_figures_name_each_stack_and_the_scheduler_step() -> None:
    stacks = frontend_layers.measure_stacks(streams=2, outputs=3, bursts=1, rounds=1)
    step = frontend_layers.measure_step(streams=4, steps=10, rounds=1)
    assert set(stacks) == set(frontend_layers.STACKS) and all(v > 0 for v in stacks.values())
    assert set(step) == {"vllm_stub_us", "subclass_us"}

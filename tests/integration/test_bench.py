"""``vllm-autopilot bench run`` end to end against the real daemon and engine.

The daemon runs in the test's event loop; the bench CLI runs as a subprocess against it, exactly as a user
runs it. A 2 MiB KV cache (4096 tokens) holds about 13 requests of 300 tokens, so the scraped series shows
KV usage well above zero (0.48 at most in a run here; 65 s for the module). What must hold: every request
completes with exactly the requested prompt length (as the server's own tokenizer counts it) and output
length, the files parse, the summary's counts match the records, and the scraped knobs are the daemon's.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller.lifecycle.daemon import Daemon
from controller.results.records import read_records, read_series
from tests.helpers import ROOT, running_daemon, write_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPT, OUTPUT = 200, 100


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> AsyncIterator[Daemon]:
    path = write_config(
        tmp_path_factory.mktemp("cfg") / "config.toml",
        engine={"kv_cache_memory_bytes": 2 << 20, "max_num_seqs": 64},
        admission={"limit": 48, "max_queue": 512},
    )
    async with running_daemon(path) as d:
        yield d


async def test_bench_run_against_the_daemon(daemon: Daemon, tmp_path: Path) -> None:
    base = f"http://{daemon.config.server.host}:{daemon.config.server.port}"
    admin = f"http://{daemon.config.admin.host}:{daemon.config.admin.port}"
    out = tmp_path / "run"
    argv = [
        sys.executable, "-m", "controller", "bench", "run",
        "--url", base, "--admin-url", admin, "--out", str(out),
        "--rate", "6", "--duration", "8", "--prompt-tokens", str(PROMPT), "--output-tokens", str(OUTPUT),
        "--priority-mix", "0:0.5,1:0.5", "--slo-ttft", "2", "--slo-tpot", "0.2", "--no-progress",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    print(stdout.decode())
    assert proc.returncode == 0

    records = read_records(out / "records.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    series = read_series(out / "timeseries.jsonl")
    assert summary["requests"] == len(records) >= 20  # Poisson at 6/s over 8 s
    assert all(r.status == "ok" for r in records), [r.error for r in records if r.status != "ok"]
    assert {(r.prompt_tokens, r.output_tokens) for r in records} == {(PROMPT, OUTPUT)}
    assert all(r.ttft_s is not None and r.tpot_s is not None and len(r.itl_s) >= 1 for r in records)
    assert summary["output_tokens"] == OUTPUT * len(records)
    assert set(summary["by_priority"]) == {"0", "1"}
    assert 0 < summary["goodput_rps"] <= summary["request_rps"]
    assert summary["kv_usage_max"] is not None and summary["kv_usage_max"] > 0
    assert summary["preemptions"] is not None
    assert summary["rss_max_bytes"] is None  # bench run against a URL knows no pid
    assert {p.admission_limit for p in series} == {48} and {p.batch_cap for p in series} == {64}
    assert any(p.running for p in series)
    print(
        f"bench run: {summary['throughput_tok_s']:.0f} tok/s, TTFT p99 {summary['ttft_p99']:.3f} s, "
        f"KV max {summary['kv_usage_max']:.2f}, preemptions {summary['preemptions']}"
    )

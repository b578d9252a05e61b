"""Benchmark: the daemon with and without ``[server] engine_poll_sleep_s`` (controller/engine/runtime/ipc.py).

Two measurements, each setting on a freshly started daemon (run under the engine lock):

* ``overload``: the overload test's config and mix (tests/integration/test_overload.py: limit 8, half
  reserved for interactive, 30% 16-token interactive streams, 70% 512-token batch jobs) for 40 s at
  ``--rate`` requests/s (0: 3x the sustained rate measured first), per setting: interactive requests
  within 0.5 s and 1 s, refused, TTFT p50/p99, batch served/refused, and the CPU seconds each process of
  the daemon (API server, EngineCore, worker) and this load generator used during the replay.
* ``throughput``: closed loop of 128-token streams at ``--concurrency`` requests, 5 s warm-up then
  ``--seconds``, per setting and round: generated tokens/s.

    flock /tmp/engine.lock .venv/bin/python bench/poll_sleep.py overload --rate 13 --sleep 0 0.0002
    flock /tmp/engine.lock .venv/bin/python bench/poll_sleep.py throughput --rounds 2 --sleep 0 0.0002
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import percentile
from bench.openloop import INTERACTIVE, Mix, capacity, run_mix, unloaded_ttft
from tests.integration import test_overload as overload_test
from tests.integration.procs import daemon_process


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def overload(sleep_s: float, rate: float, workdir: Path) -> dict[str, Any]:
    t = overload_test
    base, admin = t.write_overload_config(workdir / "config.toml", sleep_s)
    with daemon_process(workdir / "config.toml", admin) as popen:
        unloaded = await unloaded_ttft(base, "tiny")
        shape = Mix(rate_per_s=1.0, duration_s=t.DURATION_S, **t.SHAPES)
        sustained = await capacity(base, "tiny", shape, concurrency=t.LIMIT, duration_s=12.0)
        offered = rate or t.OVERLOAD * sustained
        mix = Mix(rate_per_s=offered, duration_s=t.DURATION_S, timeout_s=60.0, **t.SHAPES)
        procs = [psutil.Process(popen.pid), *psutil.Process(popen.pid).children(recursive=True)]
        before = {p.pid: _cpu_s(p) for p in procs}
        client0 = resource.getrusage(resource.RUSAGE_SELF)
        outcomes = await run_mix(base, "tiny", mix)
        client1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = {f"{p.name()} {p.pid}": round(_cpu_s(p) - before[p.pid], 1) for p in procs}
    cpu["load generator"] = round(
        client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime, 1
    )
    inter = [o for o in outcomes if o.cls == INTERACTIVE]
    batch = [o for o in outcomes if o.cls != INTERACTIVE]
    ttfts = sorted(o.ttft_s for o in inter if o.served and o.ttft_s is not None)
    return {
        "engine_poll_sleep_s": sleep_s,
        "unloaded_ttft_ms": round(1000 * unloaded, 1),
        "sustained_per_s": round(sustained, 2),
        "offered_per_s": round(offered, 2),
        "interactive_sent": len(inter),
        "interactive_within_0.5s": sum(1 for x in ttfts if x <= 0.5),
        "interactive_within_1s": sum(1 for x in ttfts if x <= 1.0),
        "interactive_refused": sum(1 for o in inter if o.status == 429),
        "interactive_ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1) if ttfts else None,
        "interactive_ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1) if ttfts else None,
        "batch_served": sum(1 for o in batch if o.served),
        "batch_refused": sum(1 for o in batch if o.status == 429),
        "cpu_s": cpu,
    }


async def throughput(sleep_s: float, concurrency: int, seconds: float, workdir: Path) -> float:
    base, admin = overload_test.write_daemon_config(workdir / "config.toml", sleep_s, concurrency)
    tokens = 128
    shape = Mix(rate_per_s=1.0, duration_s=1.0, interactive_share=1.0, interactive_tokens=tokens)
    with daemon_process(workdir / "config.toml", admin):
        await capacity(base, "tiny", shape, concurrency=concurrency, duration_s=5.0)  # warm-up
        return tokens * await capacity(base, "tiny", shape, concurrency=concurrency, duration_s=seconds)


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for sleep_s in args.sleep:
            with tempfile.TemporaryDirectory(prefix="poll-sleep-") as tmp:
                if args.what == "overload":
                    row = {"round": rnd, **await overload(sleep_s, args.rate, Path(tmp))}
                else:
                    tps = await throughput(sleep_s, args.concurrency, args.seconds, Path(tmp))
                    row = {"round": rnd, "engine_poll_sleep_s": sleep_s, "tok_s": round(tps, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("overload", "throughput"))
    p.add_argument("--sleep", type=float, nargs="+", default=[0.0, 0.0002], help="settings to compare")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rate", type=float, default=0.0, help="overload: offered req/s (0: 3x sustained)")
    p.add_argument("--concurrency", type=int, default=16, help="throughput: requests in flight")
    p.add_argument("--seconds", type=float, default=25.0, help="throughput: measured seconds")
    p.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    return p.parse_args(argv)


if __name__ == "__main__":
    ns = parse_args()
    result = asyncio.run(main(ns))
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")

"""Benchmark: static presets against the closed-loop policies, on a load that changes phase.

Run from the repository root (about 15 minutes):

    .venv/bin/python bench/phases.py

For each configuration (the four static presets, then each policy) the daemon starts with the same
engine (the default config's, with a KV cache small enough that large batches preempt), and the same
seeded open-loop Poisson schedule is replayed against it:

1. ``interactive_burst``: many short requests (priority 0);
2. ``long_batch``: long requests (priority 1) near the engine's capacity;
3. ``mixed``: both at once.

Goodput counts the requests that arrived in a phase and met both SLOs (TTFT and TPOT); refused and
failed requests are misses, so shedding cannot game it. Printed per phase and overall, with ratios to
the best static preset of the same run; the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import RequestResult, completion_payload, make_prompt, percentile, stream_completion
from bench.serve_vs_daemon import HOST, ROOT, Server, load_base_config, running, to_toml


@dataclass(frozen=True)
class Stream:
    rate_per_s: float
    max_tokens: int
    priority: int


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    streams: tuple[Stream, ...]


PHASES = (
    Phase("interactive_burst", 15.0, (Stream(16.0, 32, 0),)),
    Phase("long_batch", 30.0, (Stream(5.0, 400, 1),)),
    Phase("mixed", 20.0, (Stream(6.0, 32, 0), Stream(3.0, 400, 1))),
)

TUNED = {"tick_seconds": 0.5, "window_seconds": 3.0}
CONFIGS: dict[str, dict[str, Any]] = {
    "static:interactive": {"policy": "static", "params": {"preset": "interactive"}},
    "static:throughput": {"policy": "static", "params": {"preset": "throughput"}},
    "static:mixed": {"policy": "static", "params": {"preset": "mixed"}},
    "static:small": {"policy": "static", "params": {"preset": "small"}},
    "hysteresis": {**TUNED, "policy": "hysteresis", "params": {
        "kv_source": "max", "step": 2, "cut_factor": 0.5, "cooldown_s": 2.0, "cut_cooldown_s": 3.5,
        "low": 0.75, "high": 0.97, "critical": 0.995}},
    "pid": {**TUNED, "policy": "pid", "tolerance": 0.25, "params": {
        "kv_source": "max", "setpoint": 0.9, "kp": 0.2, "ki": 0.2, "output_scale": "log"}},
    "gradient": {**TUNED, "policy": "gradient", "params": {}},
    "aimd": {**TUNED, "policy": "aimd", "params": {}},
}  # fmt: skip


@dataclass(frozen=True)
class Arrival:
    t_s: float
    phase: str
    stream: Stream
    index: int


def schedule(seed: int) -> list[Arrival]:
    """The same Poisson arrival times for every configuration."""
    rng = random.Random(seed)
    out: list[Arrival] = []
    start = 0.0
    for phase in PHASES:
        for stream in phase.streams:
            t = start + rng.expovariate(stream.rate_per_s)
            while t < start + phase.duration_s:
                out.append(Arrival(t, phase.name, stream, len(out)))
                t += rng.expovariate(stream.rate_per_s)
        start += phase.duration_s
    return sorted(out, key=lambda a: a.t_s)


def good(r: RequestResult, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    if not r.ok or r.ttft_s is None or r.ttft_s > slo_ttft_s:
        return False
    tpot = (r.latency_s - r.ttft_s) / max(1, r.output_tokens - 1)
    return tpot <= slo_tpot_s


def preemptions(admin_url: str) -> float:
    with urllib.request.urlopen(admin_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(m.group(1)) for m in re.finditer(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", text, re.M)
    )


async def replay(
    base_url: str, admin_url: str, arrivals: list[Arrival]
) -> tuple[list[tuple[Arrival, RequestResult]], dict[str, float]]:
    results: list[tuple[Arrival, RequestResult]] = []
    preempt: dict[str, float] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(a: Arrival) -> None:
            payload = completion_payload("tiny", make_prompt(a.index), a.stream.max_tokens)
            payload["priority"] = a.stream.priority
            results.append((a, await stream_completion(session, base_url + "/v1/completions", payload)))

        t0 = time.monotonic()
        tasks = []
        boundaries = iter(_phase_ends())
        next_end = next(boundaries)
        before = preemptions(admin_url)
        for a in arrivals:
            while a.t_s >= next_end[1]:
                now = preemptions(admin_url)
                preempt[next_end[0]], before = now - before, now
                next_end = next(boundaries, ("", float("inf")))
            await asyncio.sleep(max(0.0, t0 + a.t_s - time.monotonic()))
            tasks.append(asyncio.create_task(one(a)))
        await asyncio.gather(*tasks)
        preempt[next_end[0]] = preemptions(admin_url) - before
    return results, preempt


def _phase_ends() -> list[tuple[str, float]]:
    ends, t = [], 0.0
    for phase in PHASES:
        t += phase.duration_s
        ends.append((phase.name, t))
    return ends


def summarize(
    results: list[tuple[Arrival, RequestResult]], preempt: dict[str, float], args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    total_s = sum(p.duration_s for p in PHASES)
    for name, duration in [*((p.name, p.duration_s) for p in PHASES), ("overall", total_s)]:
        rs = [r for a, r in results if name == "overall" or a.phase == name]
        ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
        out[name] = {
            "requests": len(rs),
            "failed": sum(not r.ok for r in rs),
            "goodput_rps": sum(good(r, args.slo_ttft, args.slo_tpot) for r in rs) / duration,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else float("nan"),
            "preemptions": sum(preempt.values()) if name == "overall" else preempt.get(name, 0.0),
        }
    return out


def daemon_server(name: str, control: dict[str, Any], args: argparse.Namespace, workdir: Path) -> Server:
    base = load_base_config(args.config)
    engine = {**base["engine"], "max_num_seqs": args.max_num_seqs, "kv_cache_memory_bytes": args.kv_bytes}
    data = {
        "engine": engine,
        "server": {"host": HOST, "port": args.port, "shutdown_timeout_s": 10.0},
        "admin": {"host": HOST, "port": args.admin_port},
        "admission": {"limit": args.max_num_seqs, "max_queue": 4096},
        "control": control,
    }
    path = workdir / f"{name.replace(':', '_')}.toml"
    path.write_text(to_toml(data))
    argv = [args.python, "-m", "controller", "serve", "--config", str(path)]
    base_url = f"http://{HOST}:{args.port}"
    admin = f"http://{HOST}:{args.admin_port}"
    return Server(name, argv, base_url, (admin + "/healthz", base_url + "/health"))


def report(all_results: dict[str, dict[str, Any]]) -> str:
    statics = [k for k in all_results if k.startswith("static:")]
    lines = [f"{'config':22}" + "".join(f"{p:>34}" for p in [*(p.name for p in PHASES), "overall"])]
    lines.append(f"{'':22}" + "   goodput/s  p99 TTFT s  preempt" * (len(PHASES) + 1))
    for name, res in all_results.items():
        row = "".join(
            f"{res[p]['goodput_rps']:12.2f}{res[p]['ttft_p99_s']:12.2f}{res[p]['preemptions']:9.0f}"
            for p in [*(p.name for p in PHASES), "overall"]
        )
        lines.append(f"{name:22}{row}")
    best = max(statics, key=lambda k: all_results[k]["overall"]["goodput_rps"])
    lines.append(f"best static preset (overall goodput): {best}")
    for name, res in all_results.items():
        if name.startswith("static:"):
            continue
        ratios = []
        for p in [*(p.name for p in PHASES), "overall"]:
            b = all_results[best][p]["goodput_rps"]
            ratios.append(f"{p} {res[p]['goodput_rps'] / b:.2f}x" if b else f"{p} n/a")
        lines.append(f"{name} / {best}: " + ", ".join(ratios))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "config.toml", help="engine settings come from here")
    p.add_argument(
        "--kv-bytes", type=int, default=4 << 20, help="KV cache (default 4 MiB: large batches preempt)"
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="seconds per output token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", help="configuration names to run (default: all)")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--admin-port", type=int, default=9600)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "phases.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arrivals = schedule(args.seed)
    workdir = args.out.parent
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name, control in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        server = daemon_server(name, control, args, workdir)
        print(f"{name}: starting", flush=True)
        with running(server, workdir / "logs" / f"phases-{name.replace(':', '_')}.log", 240.0, 60.0):
            raw, preempt = asyncio.run(
                replay(server.base_url, server.health_urls[0].rsplit("/", 1)[0], arrivals)
            )
        results[name] = summarize(raw, preempt, args)
        print(f"  overall goodput {results[name]['overall']['goodput_rps']:.2f}/s", flush=True)
    text = report(results)
    print(text)
    args.out.write_text(
        json.dumps(
            {
                "settings": {k: str(v) for k, v in vars(args).items()},
                "phases": [asdict(p) for p in PHASES],
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

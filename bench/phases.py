"""Benchmark: static presets against the closed-loop policies, on a load that changes phase.

Run from the repository root, one configuration (or a few) per command so that each holds the
engine lock a short while; the report compares the files of one results directory:

    .venv/bin/python bench/phases.py --only static:interactive static:throughput
    .venv/bin/python bench/phases.py --only static:mixed static:small
    .venv/bin/python bench/phases.py --only hysteresis pid
    .venv/bin/python bench/phases.py --only gradient aimd
    .venv/bin/python bench/phases.py --report

For each configuration (the four static presets, then each policy) the daemon starts with the same
engine (the default config's, with a KV cache small enough that large batches preempt), and the same
seeded open-loop Poisson schedule is replayed against it:

1. ``interactive_burst``: many short requests (priority 0);
2. ``long_batch``: long requests (priority 1), more than the engine serves within the SLOs;
3. ``mixed``: both at once.

Goodput counts the requests that arrived in a phase and met both SLOs (TTFT and TPOT); refused and
failed requests are misses, so shedding cannot game it. Printed per phase and overall, with ratios to
the best static preset among the files of the results directory, and the ceiling (every arrival
good), and ``others``: the cores other processes (not the daemon, not this script) used while it
ran; a row with others above ~0.1 ran on a shared CPU and is noisy. Each configuration's file
keeps its per-request records and the batch cap over time. The report refuses files measured with
other settings (schedule, SLOs, engine) than the first one.
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
from bench.serve_vs_daemon import (
    HOST,
    ROOT,
    Server,
    _cpu_seconds_outside,
    load_base_config,
    other_load,
    running,
    to_toml,
)


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
    Phase("interactive_burst", 20.0, (Stream(16.0, 32, 0),)),
    Phase("long_batch", 40.0, (Stream(5.0, 400, 1),)),
    Phase("mixed", 40.0, (Stream(6.0, 32, 0), Stream(3.0, 400, 1))),
)

# Settings that must match for two result files to be compared.
SAME_RUN_KEYS = ("config", "kv_bytes", "max_num_seqs", "slo_ttft", "slo_tpot", "seed", "phases")


def configs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The contenders. Policies run with the defaults an operator gets, except what scales with the
    window: a tick and a window short enough for phases of 20-40 s (0.5 s and 3 s, not 1 s and 10 s),
    hysteresis's waits between steps and cuts (2 s and 3.5 s, not 5 s and 10 s), and the normalize
    stage's tolerance band for pid (its +-1 jitter). A latency target is the benchmark's own SLO."""
    fast = {"tick_seconds": 0.5, "window_seconds": 3.0}
    hysteresis = {"cooldown_s": 2.0, "cut_cooldown_s": 3.5}
    return {
        "static:interactive": {"policy": "static", "params": {"preset": "interactive"}},
        "static:throughput": {"policy": "static", "params": {"preset": "throughput"}},
        "static:mixed": {"policy": "static", "params": {"preset": "mixed"}},
        "static:small": {"policy": "static", "params": {"preset": "small"}},
        "hysteresis": {**fast, "policy": "hysteresis", "params": hysteresis},
        "pid": {**fast, "policy": "pid", "tolerance": 0.25, "params": {}},
        "pid:itl": {
            **fast,
            "policy": "pid",
            "tolerance": 0.25,
            "params": {"target": "itl_p99", "setpoint": args.slo_tpot},
        },
        "gradient": {**fast, "policy": "gradient", "params": {}},
        "aimd": {**fast, "policy": "aimd", "params": {"threshold_s": args.slo_ttft}},
    }


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


def tpot(r: dict[str, Any]) -> float | None:
    if not r["ok"] or r["ttft_s"] is None:
        return None
    return float((r["latency_s"] - r["ttft_s"]) / max(1, r["output_tokens"] - 1))


def good(r: dict[str, Any], slo_ttft_s: float, slo_tpot_s: float) -> bool:
    t = tpot(r)
    return t is not None and r["ttft_s"] <= slo_ttft_s and t <= slo_tpot_s


SCRAPED = {
    "preemptions": "vllm:num_preemptions_total",
    "batch_cap": "autopilot_batch_cap",
    "in_flight": "autopilot_in_flight_requests",
    "gate_queue": "autopilot_queue_depth",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
}
"""What each scrape keeps: a sample name of /metrics, summed over its label sets (NaN if absent)."""


def scrape(admin_url: str) -> dict[str, float]:
    """One reading of SCRAPED from the control plane's /metrics."""
    with urllib.request.urlopen(admin_url + "/metrics", timeout=5) as resp:
        return parse_metrics(resp.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for key, metric in SCRAPED.items():
        pattern = rf"^{re.escape(metric)}(?:\{{[^}}]*\}})? (\S+)$"
        values = [float(m.group(1)) for m in re.finditer(pattern, text, re.M)]
        out[key] = sum(values) if values else float("nan")
    return out


async def replay(base_url: str, admin_url: str, arrivals: list[Arrival]) -> dict[str, Any]:
    """Replay the schedule; the records of every request, and the scrapes taken each second."""
    records: list[dict[str, Any]] = []
    scrapes: list[dict[str, float]] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(a: Arrival) -> None:
            payload = completion_payload("tiny", make_prompt(a.index), a.stream.max_tokens)
            payload["priority"] = a.stream.priority
            r: RequestResult = await stream_completion(session, base_url + "/v1/completions", payload)
            records.append({"t_s": a.t_s, "phase": a.phase, "priority": a.stream.priority, **asdict(r)})

        async def sample(stop: asyncio.Event) -> None:
            while not stop.is_set():
                s = await asyncio.to_thread(scrape, admin_url)
                scrapes.append({"t_s": time.monotonic() - t0, **s})
                await asyncio.sleep(1.0)

        t0 = time.monotonic()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(stop))
        tasks = []
        for a in arrivals:
            await asyncio.sleep(max(0.0, t0 + a.t_s - time.monotonic()))
            tasks.append(asyncio.create_task(one(a)))
        await asyncio.gather(*tasks)
        stop.set()
        await sampler
        scrapes.append({"t_s": time.monotonic() - t0, **scrape(admin_url)})
    return {"records": sorted(records, key=lambda r: r["t_s"]), "scrapes": scrapes}


def phase_bounds() -> list[tuple[str, float, float]]:
    out, t = [], 0.0
    for phase in PHASES:
        out.append((phase.name, t, t + phase.duration_s))
        t += phase.duration_s
    return out


def preemptions_between(scrapes: list[dict[str, float]], t_from: float, t_to: float) -> float:
    """Preemptions counted between the scrapes nearest the phase's start and end (the last
    phase runs to the end of the replay: its requests finish after its arrivals stop)."""

    def at(t: float) -> float:
        before = [s["preemptions"] for s in scrapes if s["t_s"] <= t]
        return before[-1] if before else scrapes[0]["preemptions"]

    return at(t_to) - at(t_from)


def summarize(run: dict[str, Any], slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bounds = phase_bounds()
    total_s = bounds[-1][2]
    for name, t_from, t_to in [*bounds, ("overall", 0.0, total_s)]:
        rs = [r for r in run["records"] if name == "overall" or r["phase"] == name]
        ttfts = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        tpots = [t for t in map(tpot, rs) if t is not None]
        last = name == bounds[-1][0] or name == "overall"
        out[name] = {
            "requests": len(rs),
            "failed": sum(not r["ok"] for r in rs),
            "ceiling_rps": len(rs) / (t_to - t_from),
            "goodput_rps": sum(good(r, slo_ttft_s, slo_tpot_s) for r in rs) / (t_to - t_from),
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else float("nan"),
            "tpot_p99_s": percentile(tpots, 99) if tpots else float("nan"),
            "preemptions": preemptions_between(run["scrapes"], t_from, float("inf") if last else t_to),
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
    path = workdir / f"{_file(name)}.toml"
    path.write_text(to_toml(data))
    argv = [args.python, "-m", "controller", "serve", "--config", str(path)]
    base_url = f"http://{HOST}:{args.port}"
    admin = f"http://{HOST}:{args.admin_port}"
    return Server(name, argv, base_url, (admin + "/healthz", base_url + "/health"))


def _file(name: str) -> str:
    return name.replace(":", "_")


def run_settings(args: argparse.Namespace) -> dict[str, str]:
    settings = {k: str(v) for k, v in vars(args).items() if k in SAME_RUN_KEYS}
    settings["phases"] = json.dumps([asdict(p) for p in PHASES])
    return settings


def load_results(outdir: Path) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """Every configuration's summary from ``outdir``; all must share the first file's settings."""
    files = sorted(outdir.glob("*.json"), key=lambda p: json.loads(p.read_text())["measured_at"])
    if not files:
        raise SystemExit(f"no results in {outdir}: run some configurations first (--only NAME ...)")
    first = json.loads(files[0].read_text())
    results: dict[str, dict[str, Any]] = {}
    for f in files:
        data = json.loads(f.read_text())
        if data["settings"] != first["settings"]:
            raise SystemExit(f"{f} was measured with other settings than {files[0]}: use another --out")
        results[data["name"]] = data["summary"]
    return first["settings"], results


def report(results: dict[str, dict[str, Any]]) -> str:
    names = [*(p.name for p in PHASES), "overall"]
    statics = [k for k in results if k.startswith("static:")]
    lines = [f"{'config':20}" + "".join(f"{p:>44}" for p in names)]
    lines.append(f"{'':20}" + "   goodput/s  p99 TTFT s  p99 TPOT s  preempt" * len(names))
    for name, res in [("ceiling", None), *results.items()]:
        if res is None:
            any_res = next(iter(results.values()))
            row = "".join(f"{any_res[p]['ceiling_rps']:12.2f}{'':32}" for p in names)
        else:
            row = "".join(
                f"{res[p]['goodput_rps']:12.2f}{res[p]['ttft_p99_s']:12.2f}"
                f"{res[p]['tpot_p99_s']:12.3f}{res[p]['preemptions']:8.0f}"
                for p in names
            )
        others = "" if res is None else f"   others {res.get('others_cores', float('nan')):.2f} cores"
        lines.append(f"{name:20}{row}{others}")
    if not statics:
        return "\n".join(lines)
    best = max(statics, key=lambda k: results[k]["overall"]["goodput_rps"])
    lines.append(f"best static preset (overall goodput): {best}")
    for name, res in [("ceiling", None), *results.items()]:
        if name.startswith("static:"):
            continue
        ratios = []
        for p in names:
            b = results[best][p]["goodput_rps"]
            v = results[best][p]["ceiling_rps"] if res is None else res[p]["goodput_rps"]
            ratios.append(f"{p} {v / b:.2f}x" if b else f"{p} n/a")
        lines.append(f"{name} / {best}: " + ", ".join(ratios))
    return "\n".join(lines)


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The report as two markdown tables: figures per phase, and goodput ratios to the best static preset."""
    names = [*(p.name for p in PHASES), "overall"]
    head = ["config", *(f"{p} {m}" for p in names for m in ("goodput/s", "p99 TTFT s", "preempt")), "others"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    any_res = next(iter(results.values()))
    ceiling = [f"{any_res[p]['ceiling_rps']:.2f}" if i == 0 else "" for p in names for i in range(3)]
    lines.append("| ceiling (every arrival good) | " + " | ".join(ceiling) + " | |")
    for name, res in results.items():
        cells = [
            f"{res[p]['goodput_rps']:.2f} | {res[p]['ttft_p99_s']:.2f} | {res[p]['preemptions']:.0f}"
            for p in names
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {res.get('others_cores', float('nan')):.2f} |")
    statics = [k for k in results if k.startswith("static:")]
    if not statics:
        return "\n".join(lines)
    best = max(statics, key=lambda k: results[k]["overall"]["goodput_rps"])
    lines += ["", f"| goodput / {best} | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    rows = [("ceiling", {p: {"goodput_rps": any_res[p]["ceiling_rps"]} for p in names})]
    for name, res in [*rows, *((k, v) for k, v in results.items() if k != best)]:
        ratios = [f"{res[p]['goodput_rps'] / results[best][p]['goodput_rps']:.2f}x" for p in names]
        lines.append(f"| {name} | " + " | ".join(ratios) + " |")
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
    p.add_argument("--report", action="store_true", help="only print the report of --out's files")
    p.add_argument("--markdown", action="store_true", help="print the report as markdown tables")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--admin-port", type=int, default=9600)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "phases", help="a directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    contenders = configs(args)
    unknown = sorted(set(args.only or ()) - set(contenders))
    if unknown:
        raise SystemExit(f"unknown configuration {unknown}: use some of {', '.join(contenders)}")
    args.out.mkdir(parents=True, exist_ok=True)
    arrivals = schedule(args.seed)
    for name, control in contenders.items():
        if args.report or (args.only and name not in args.only):
            continue
        server = daemon_server(name, control, args, args.out)
        print(f"{name}: starting", flush=True)
        with running(server, args.out / "logs" / f"{_file(name)}.log", 240.0, 60.0) as proc:
            before, start = _cpu_seconds_outside(proc.pgid), time.monotonic()
            run = asyncio.run(replay(server.base_url, server.health_urls[0].rsplit("/", 1)[0], arrivals))
            others = other_load(before, _cpu_seconds_outside(proc.pgid), time.monotonic() - start)
        summary = {**summarize(run, args.slo_ttft, args.slo_tpot), "others_cores": others}
        print(f"  overall goodput {summary['overall']['goodput_rps']:.2f}/s", flush=True)
        data = {"name": name, "control": control, "measured_at": time.time(), "settings": run_settings(args)}
        (args.out / f"{_file(name)}.json").write_text(json.dumps({**data, "summary": summary, **run}))
    _, results = load_results(args.out)
    print(markdown(results) if args.markdown else report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

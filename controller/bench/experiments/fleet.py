"""``bench fleet``: whether the fleet's saturation tracks its load. Two daemons with the same config
behind ``vllm-router`` (``round_robin`` over a fixed worker list, the recipe's breaker: docs/fleet.md).

First the pair's capacity ``C``: a closed loop of ``--probe-requests`` requests, ``--probe-concurrency``
at a time, through the router; ``C`` is the sum of the two daemons' ``autopilot_capacity_rps`` (each
daemon's ``/metrics``, as Prometheus scrapes it) averaged over the probe's second half, the modelled
capacity (``--capacity model``), or the requests per second the probe got served (``--capacity
served``: with enough requests in flight to keep both engines full, what the pair serves). Then Poisson
arrivals at each ``--shares`` x ``C`` for ``--step-seconds`` each, through the router, while both
daemons' ``/metrics`` are read every second over the step's last ``--tail`` share: the table gives the
sum of their ``autopilot_saturation`` (what KEDA's trigger sums, deploy/k8s), each daemon's, the sum of
their capacities, the tries that reached the gates (the router retries a 429 on the other replica, up
to 5 attempts) and of those the retries each gate recognised by the request's ``X-Request-Id`` (a try
of a request it refused itself, which its offered rate leaves out), and what the clients got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.bench.router import routed
from controller.bench.runner import Endpoints, RunConfig, run_workload
from controller.bench.servers import Launched, ServerSpec, launched, served_model
from controller.bench.targets import add_config_args, base_config
from controller.load.client import Target
from controller.load.prompts import PromptBuilder, load_tokenizer
from controller.load.workload import RequestSpec, poisson
from controller.results.tables import cell

RESULT = "fleet.json"
Figures = dict[str, float]
"""``saturation`` and ``capacity_rps`` of one daemon's page; a key is absent while the gauge has no sample."""


def add_parser(cmds: Any) -> None:
    p = cmds.add_parser("fleet", help="two daemons behind vllm-router: summed saturation against load")
    add_config_args(p)
    p.add_argument("--out", type=Path, required=True, help="directory for fleet.json, the runs and logs")
    p.add_argument("--shares", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.25, 1.5])
    p.add_argument("--step-seconds", type=float, default=50.0, help="seconds of arrivals per step")
    p.add_argument("--tail", type=float, default=0.4, help="share of each step the saturation is read over")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--probe-requests", type=int, default=96, help="requests of the capacity probe")
    p.add_argument("--probe-concurrency", type=int, default=16, help="requests in flight during the probe")
    p.add_argument("--capacity", choices=("model", "served"), default="model", help="what C is (see above)")
    p.add_argument("--seed", type=int, default=0)


def autopilot_figures(page: str) -> Figures:
    """``autopilot_saturation`` and ``autopilot_capacity_rps`` of a Prometheus text page."""
    names = {"autopilot_saturation": "saturation", "autopilot_capacity_rps": "capacity_rps"}
    return {
        names[s.name]: float(s.value)
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name in names
    }


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Step:
    """One offered load and what the two daemons and the clients made of it."""

    share: float
    """Offered rate over the pair's capacity ``C``."""
    offered_rps: float
    saturation_sum: float | None
    """Mean over the tail's readings of the sum over daemons with a sample (Prometheus' ``sum``)."""
    saturation: list[float | None]
    """Each daemon's mean over the tail."""
    capacity_sum: float | None
    tries_rps: float
    """Requests that reached the gates per second (router retries included)."""
    retries_rps: float
    """Of ``tries_rps``, the tries of a request the same gate had refused (``retries_total``): what
    the gates' offered rates leave out."""
    sent: int
    ok: int
    good: int
    refused: int
    failed: int
    tail: list[list[Figures]] = field(default_factory=list)
    """The readings the means come from, one list of the daemons' figures a second."""


def summarize_readings(readings: list[list[Figures]], key: str) -> tuple[float | None, list[float | None]]:
    """From readings (one list of daemons' figures per second): the mean of the per-reading sum over
    the daemons with a sample, and each daemon's mean."""
    sums = [sum(d[key] for d in r if key in d) for r in readings if any(key in d for d in r)]
    daemons = len(readings[0]) if readings else 0
    each = [mean([r[i][key] for r in readings if key in r[i]]) for i in range(daemons)]
    return mean(sums), each


async def read_pages(session: aiohttp.ClientSession, urls: list[str]) -> list[Figures]:
    """Each daemon's figures; none for a daemon whose page did not come (a missed scrape)."""
    pages = []
    for url in urls:
        try:
            async with session.get(url) as r:
                pages.append(autopilot_figures(await r.text()))
        except (TimeoutError, aiohttp.ClientError):
            pages.append({})
    return pages


async def sample(urls: list[str], start_s: float, end_s: float) -> list[list[Figures]]:
    """Every daemon's figures once a second from ``start_s`` to ``end_s`` (seconds from now)."""
    t0, readings = time.monotonic(), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        await asyncio.sleep(start_s)
        while time.monotonic() - t0 < end_s:
            readings.append(await read_pages(session, urls))
            await asyncio.sleep(1.0)
    return readings


def gate_tries(daemons: list[Launched]) -> tuple[int, int]:
    """Tries that reached the daemons' gates so far, each counted once (the gates' own
    ``arrivals_total``), and of those the retries of a request the same gate refused
    (``retries_total``)."""
    tries = retries = 0
    for d in daemons:
        with urllib.request.urlopen(str(d.state_url), timeout=5) as r:
            gate = json.load(r)["gate"]
        tries, retries = tries + int(gate["arrivals_total"]), retries + int(gate["retries_total"])
    return tries, retries


@dataclass(frozen=True)
class Fleet:
    """Where the load goes and where the figures come from."""

    target: Target
    """The router, and the model to ask for."""
    builder: PromptBuilder
    slo: tuple[float | None, float | None]
    """The daemons' ``[slo]`` (TTFT, TPOT): a request within both is good."""
    metrics: list[str]
    """Each daemon's control-plane ``/metrics``."""
    daemons: list[Launched]


async def offer(
    fleet: Fleet, specs: list[RequestSpec], window: tuple[float, float], out: Path
) -> tuple[dict[str, Any], list[list[Figures]]]:
    """Run ``specs`` through the router while sampling the daemons over ``window``."""
    for spec in specs:  # prompts first: tokenizing is not the load's time
        fleet.builder.for_spec(spec)
    ttft, tpot = fleet.slo
    cfg = RunConfig(out, ttft, tpot, warmup=0, timeout_s=180.0, progress=False)
    run = run_workload(fleet.target, specs, fleet.builder, cfg, Endpoints(None), label=out.name)
    summary, readings = await asyncio.gather(run, sample(fleet.metrics, *window))
    return summary, readings


def main(args: argparse.Namespace) -> int:
    base = base_config(args)
    engine, slo = base["engine"], base.get("slo") or {}
    tables = {"control": dict(base.get("control") or {}), "admission": dict(base.get("admission") or {})}
    logs = args.out / "logs"
    with ExitStack() as stack:
        daemons = [
            stack.enter_context(
                launched(
                    ServerSpec(name, "daemon", engine, **tables),
                    base,
                    logs,
                    startup_timeout_s=args.startup_timeout,
                )
            )
            for name in ("a", "b")
        ]
        url = stack.enter_context(routed([d.base_url for d in daemons], logs / "router.log"))
        fleet = Fleet(
            Target(url, served_model(engine)),
            PromptBuilder(load_tokenizer(Path(engine["model"])), seed=args.seed),
            (slo.get("ttft_s"), slo.get("tpot_s")),
            [d.metrics_url for d in daemons],
            daemons,
        )
        capacity, probe = asyncio.run(probe_capacity(fleet, args))
        steps = [asyncio.run(step(fleet, args, capacity, share)) for share in args.shares]
    print("\n" + format_table(capacity, steps))
    result = {"argv": sys.argv, "capacity_rps": capacity, "probe": probe, "steps": [asdict(s) for s in steps]}
    (args.out / RESULT).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nresults: {args.out / RESULT}")
    return 0


async def probe_capacity(fleet: Fleet, args: argparse.Namespace) -> tuple[float, dict[str, Any]]:
    """The closed loop through the router, and the pair's capacity over its second half."""
    lengths = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
    closed = [RequestSpec(i, 0.0, **lengths) for i in range(args.probe_requests)]
    cfg = RunConfig(args.out / "probe", warmup=4, progress=False, concurrency=args.probe_concurrency)
    run = run_workload(fleet.target, closed, fleet.builder, cfg, Endpoints(None), label="probe")
    probe = asyncio.create_task(run)
    readings: list[list[Figures]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not probe.done():
            readings.append(await read_pages(session, fleet.metrics))
            await asyncio.sleep(1.0)
    summary = await probe
    capacity, _ = summarize_readings(readings[len(readings) // 2 :], "capacity_rps")
    if not capacity:
        raise RuntimeError(
            f"no autopilot_capacity_rps after the probe ({fleet.daemons[0].state_url} says why)"
        )
    served = summary["ok"] / summary["duration_s"]
    print(f"pair capacity: modelled {capacity:.2f} req/s, served by the probe {served:.2f} req/s", flush=True)
    summary["capacity_model_rps"] = capacity
    return (served if args.capacity == "served" else capacity), summary


async def step(fleet: Fleet, args: argparse.Namespace, capacity: float, share: float) -> Step:
    """``share`` x ``capacity`` offered for ``--step-seconds``; the saturation over its tail."""
    rate = share * capacity
    specs = poisson(
        rate,
        args.step_seconds,
        seed=args.seed,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
    )
    window = ((1 - args.tail) * args.step_seconds, args.step_seconds)
    before = gate_tries(fleet.daemons)
    summary, tail = await offer(fleet, specs, window, args.out / f"step-{share:g}")
    after = gate_tries(fleet.daemons)
    tries, retries = ((b - a) / args.step_seconds for a, b in zip(before, after, strict=True))
    sat_sum, sat = summarize_readings(tail, "saturation")
    cap_sum, _ = summarize_readings(tail, "capacity_rps")
    result = Step(
        share,
        rate,
        sat_sum,
        sat,
        cap_sum,
        tries,
        retries,
        sent=summary["requests"],
        ok=summary["ok"],
        good=summary["slo_met"],
        refused=summary["refused"],
        failed=summary["failed"],
        tail=tail,
    )
    print(format_table(capacity, [result]).splitlines()[-1], flush=True)
    return result


def format_table(capacity: float, steps: list[Step]) -> str:
    head = (
        f"| offered / C (C = {capacity:.2f} req/s) | offered req/s | sum of saturation | a | b | "
        "sum of capacity_rps | tries at the gates /s | of which retries /s | sent | ok | within SLO | "
        "refused 429 | failed |"
    )
    rows = [head, "|" + " ---: |" * 13]
    for s in steps:
        each = " | ".join(cell(v, ".2f") for v in s.saturation)
        rows.append(
            f"| {s.share:.2f} | {s.offered_rps:.2f} | {cell(s.saturation_sum, '.2f')} | {each} | "
            f"{cell(s.capacity_sum, '.2f')} | {s.tries_rps:.2f} | {s.retries_rps:.2f} | {s.sent} | {s.ok} | "
            f"{s.good} | {s.refused} | {s.failed} |"
        )
    return "\n".join(rows)

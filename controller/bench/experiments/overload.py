"""``bench overload``: admission under overload. Each target, started alone with the same ``[engine]``, gets
its unloaded TTFT measured and then the same open-loop overload mix (``mix``): 30% interactive streams at
priority 0, 70% batch answers at priority 5, Poisson arrivals at ``--overload`` times what the first daemon
sustains in a closed loop at its admission limit (or at ``--rate``).

Targets: ``daemon`` (the static policy, ``[admission] limit = --limit`` with an ``interactive`` class holding
half of it, deadline ``--interactive-deadline``, and a ``batch`` class, deadline ``--batch-deadline``), once
per ``--poll-sleep`` setting of ``[server] engine_poll_sleep_s`` when given; ``vllm-serve``: plain ``vllm
serve --scheduling-policy priority`` with the same engine. Goodput counts requests served within their
class's TTFT SLO (interactive: ``--slo-factor`` x the unloaded TTFT of vllm serve, else of the first
target, at least 0.25 s; batch: ``--batch-slo``); refused, failed and abandoned requests are misses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from controller.bench.experiments.mix import (
    BATCH,
    INTERACTIVE,
    Mix,
    capacity,
    run_mix,
    summarize,
    unloaded_ttft,
)
from controller.bench.servers import ServerSpec, launched, load_base_config, served_model
from controller.bench.targets import parse_assignments
from controller.results.tables import VLLM_SERVE, cell

DAEMON = "daemon"
RESULT = "overload.json"


def add_parser(cmds: Any) -> None:
    p = cmds.add_parser("overload", help="admission under overload: the daemon against vllm serve")
    p.add_argument("--out", type=Path, required=True, help="directory for overload.json and the logs")
    p.add_argument("--config", type=Path, default=Path("config.toml"), help="config to take [engine] from")
    p.add_argument("--engine", action="append", metavar="KEY=VALUE", help="override an [engine] setting")
    p.add_argument("--targets", default=f"{DAEMON},{VLLM_SERVE}", help="comma list of daemon, vllm-serve")
    p.add_argument("--poll-sleep", type=float, nargs="+", help="run the daemon once per engine_poll_sleep_s")
    p.add_argument("--limit", type=int, help="the daemon's admission limit (default: max_num_seqs)")
    p.add_argument("--overload", type=float, default=3.0, help="offered rate / the daemon's sustained rate")
    p.add_argument("--rate", type=float, default=0.0, help="offered requests/s (0: measure, x --overload)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of open-loop arrivals")
    p.add_argument("--timeout", type=float, default=60.0, help="a request unanswered this long is a miss")
    p.add_argument("--capacity-seconds", type=float, default=8.0, help="length of the closed-loop probe")
    p.add_argument(
        "--interactive-tokens", type=int, default=32, help="output tokens of an interactive stream"
    )
    p.add_argument("--batch-tokens", type=int, default=192, help="output tokens of a batch answer")
    p.add_argument("--interactive-deadline", type=float, default=2.5, help="interactive queue deadline (s)")
    p.add_argument("--batch-deadline", type=float, default=10.0, help="batch queue deadline (s)")
    p.add_argument("--slo-factor", type=float, default=25.0, help="interactive TTFT SLO / unloaded TTFT")
    p.add_argument("--batch-slo", type=float, default=20.0, help="batch TTFT SLO, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for health")


def servers(engine: dict[str, Any], args: argparse.Namespace) -> list[ServerSpec]:
    """The targets ``--targets`` names, in its order, with the same ``[engine]``."""
    limit = args.limit or int(engine["max_num_seqs"])
    classes = {
        "interactive": {
            "max_priority": 0,
            "max_queue": 64,
            "queue_deadline_s": args.interactive_deadline,
            "reserved_share": 0.5,
        },
        "batch": {"min_priority": 1, "max_queue": 128, "queue_deadline_s": args.batch_deadline},
    }
    admission = {"limit": limit, "max_queue": 256, "aging_s": 5.0, "classes": classes}
    control = {"tick_s": 1.0, "policy": "static", "params": {}}
    out: list[ServerSpec] = []
    for name in (t.strip() for t in args.targets.split(",") if t.strip()):
        if name == VLLM_SERVE:
            out.append(ServerSpec(VLLM_SERVE, "vllm-serve", {**engine, "scheduling_policy": "priority"}))
        elif name == DAEMON:
            for sleep in args.poll_sleep or [None]:
                server = {"shutdown_timeout_s": 10.0}
                server |= {} if sleep is None else {"engine_poll_sleep_s": sleep}
                label = DAEMON if sleep is None else f"{DAEMON}:poll_sleep={sleep:g}"
                out.append(ServerSpec(label, "daemon", engine, control, admission, server))
        else:
            raise ValueError(f"--targets {name!r}: use {DAEMON} or {VLLM_SERVE}")
    if not out:
        raise ValueError(f"--targets {args.targets}: names no server")
    return out


async def measure(
    base_url: str, model: str, mix: Mix, args: argparse.Namespace, limit: int
) -> dict[str, Any]:
    """Unloaded TTFT; the sustained rate when ``mix`` has none yet; then the overload."""
    result: dict[str, Any] = {"unloaded_ttft_ms": 1000 * await unloaded_ttft(base_url, model)}
    if mix.rate_per_s <= 0:
        sustained = await capacity(base_url, model, mix, limit, args.capacity_seconds)
        result["sustained_per_s"] = sustained
        mix = replace(mix, rate_per_s=args.overload * sustained)
    result["offered_per_s"] = mix.rate_per_s
    result["outcomes"] = await run_mix(base_url, model, mix)
    return result


def main(args: argparse.Namespace) -> int:
    base = load_base_config(args.config)
    base["engine"].update(parse_assignments(args.engine or [], "--engine"))
    engine = base["engine"]
    model, limit = served_model(engine), args.limit or int(engine["max_num_seqs"])
    mix = Mix(
        rate_per_s=args.rate,
        duration_s=args.duration,
        timeout_s=args.timeout,
        seed=args.seed,
        interactive_tokens=args.interactive_tokens,
        batch_tokens=args.batch_tokens,
    )
    results: dict[str, dict[str, Any]] = {}
    for spec in servers(engine, args):
        print(f"== {spec.name}", flush=True)
        with launched(spec, base, args.out / "logs", startup_timeout_s=args.startup_timeout) as server:
            results[spec.name] = asyncio.run(measure(server.base_url, model, mix, args, limit))
        results[spec.name]["startup_s"] = server.startup_s
        mix = replace(mix, rate_per_s=results[spec.name]["offered_per_s"])  # every target gets the same load
    ref = results.get(VLLM_SERVE) or next(iter(results.values()))
    slo = {INTERACTIVE: max(args.slo_factor * ref["unloaded_ttft_ms"] / 1000, 0.25), BATCH: args.batch_slo}
    summaries = {name: summarize(r.pop("outcomes"), slo, args.duration) for name, r in results.items()}
    print("\n" + headline(results, summaries, slo, mix, args) + "\n\n" + format_table(summaries))
    out = {
        "argv": sys.argv,
        "settings": {k: str(v) for k, v in vars(args).items() if k != "func"},
        "servers": results,
        "summary": summaries,
        "slo_s": slo,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / RESULT).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nresults: {args.out / RESULT}")
    return 0


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    head = (
        "| server | class | sent | served | 429 (with Retry-After) | 5xx | no answer | TTFT p50 ms | "
        "TTFT p99 ms | within SLO | goodput/s |"
    )
    rows = [head, "|" + " --- |" * 11]
    for name, s in summaries.items():
        for cls in (INTERACTIVE, BATCH):
            c = s[cls]
            share = cell(c["within_slo_share"], ".1%")
            rows.append(
                f"| {name} | {cls} | {c['sent']} | {c['served']} | {c['refused_429']} "
                f"({c['refused_with_retry_after']}) | {c['server_errors_5xx']} | {c['no_answer']} | "
                f"{cell(c['ttft_p50_ms'], '.0f')} | {cell(c['ttft_p99_ms'], '.0f')} | {share} | "
                f"{c['goodput_per_s']:.2f} |"
            )
        rows.append(f"| {name} | all | | | | | | | | | {s['goodput_per_s']:.2f} |")
    return "\n".join(rows)


def headline(
    results: dict[str, dict[str, Any]],
    summaries: dict[str, dict[str, Any]],
    slo: dict[str, float],
    mix: Mix,
    args: argparse.Namespace,
) -> str:
    first = next(iter(results))
    lines = [
        f"offered {mix.rate_per_s:.2f} req/s for {args.duration:.0f} s ({args.overload:g}x the sustained "
        f"{results[first].get('sustained_per_s', 0):.2f} req/s of {first}); unloaded TTFT: "
        + ", ".join(f"{n} {r['unloaded_ttft_ms']:.1f} ms" for n, r in results.items())
        + f"; SLO interactive {1000 * slo[INTERACTIVE]:.0f} ms, batch {slo[BATCH]:.0f} s"
    ]
    if VLLM_SERVE in summaries and first != VLLM_SERVE:
        d, v = summaries[first], summaries[VLLM_SERVE]
        p99 = (d[INTERACTIVE]["ttft_p99_ms"] or 0.0) / max(v[INTERACTIVE]["ttft_p99_ms"] or 0.0, 1e-9)
        lines.append(
            f"goodput {first} / vllm serve: {d['goodput_per_s'] / max(v['goodput_per_s'], 1e-9):.2f}x; "
            f"interactive p99 TTFT {first} / vllm serve: {p99:.3g}x"
        )
    return "\n".join(lines)

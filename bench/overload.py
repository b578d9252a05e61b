"""Benchmark: admission under overload, the daemon against plain ``vllm serve --scheduling-policy
priority`` with the same engine settings and the same offered load.

Run from the repository root, under the machine's engine lock:

    flock /tmp/engine.lock .venv/bin/python bench/overload.py

The daemon runs first (a temporary config: the default one's [engine] with ``--max-num-seqs``, an
admission limit of ``--limit``, an ``interactive`` class (priority <= 0, half the limit reserved,
``--interactive-deadline``) and a ``batch`` class (``--batch-deadline``)). On it the script measures
the unloaded TTFT (interactive requests one at a time) and what it sustains (closed loop, ``--limit``
requests in flight, the mix's request shapes): the offered rate is ``--overload`` times that. Then
each server, started alone, gets its unloaded TTFT measured and the same open-loop mix (Poisson
arrivals, 30% interactive streams of 32 output tokens at priority 0, 70% batch requests of 192
tokens at priority 5, not streamed) for ``--duration`` seconds; requests unanswered after
``--timeout`` seconds are abandoned. A batch request's "TTFT" is the time to its whole answer.

Figures per server and class: p50/p99 TTFT of the served requests, refusals (429, with Retry-After),
errors, and goodput: requests served within their class's TTFT SLO per second (interactive:
``--slo-factor`` x the baseline's unloaded TTFT; batch: ``--batch-slo``). Refused, failed and
abandoned requests are misses. Results go to ``--out`` as JSON, server logs next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.openloop import (  # noqa: E402  (needs ROOT on sys.path when run as a script)
    BATCH,
    INTERACTIVE,
    Mix,
    capacity,
    run_mix,
    summarize,
    unloaded_ttft,
)
from bench.serve_vs_daemon import (  # noqa: E402
    HOST,
    Server,
    engine_flags,
    ensure_model,
    load_base_config,
    port_free,
    running,
    served_model,
    to_toml,
)

DAEMON, VLLM_SERVE = "daemon", "vllm-serve"


def daemon_config(base: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "engine": base["engine"],
        "server": {
            "host": HOST,
            "port": args.daemon_port,
            "shutdown_timeout_s": 10.0,
            **({} if args.engine_poll_sleep is None else {"engine_poll_sleep_s": args.engine_poll_sleep}),
        },
        "admin": {"host": HOST, "port": args.admin_port},
        "admission": {
            "limit": args.limit,
            "max_queue": 256,
            "aging_s": 5.0,
            "classes": {
                "interactive": {
                    "max_priority": 0,
                    "max_queue": 64,
                    "queue_deadline_s": args.interactive_deadline,
                    "reserved_share": 0.5,
                },
                "batch": {"min_priority": 1, "max_queue": 128, "queue_deadline_s": args.batch_deadline},
            },
        },
        "control": {"tick_seconds": 1.0, "policy": "static"},
    }


def make_servers(args: argparse.Namespace, base: dict[str, Any], workdir: Path) -> dict[str, Server]:
    config_path = workdir / "daemon.toml"
    config_path.write_text(to_toml(daemon_config(base, args)))
    launcher = str(ROOT / "bench" / "vllm_serve_launcher.py")
    flags = engine_flags({**base["engine"], "scheduling_policy": "priority"})
    serve_args = ["serve", *flags, "--host", HOST, "--port", str(args.serve_port)]
    daemon_url, serve_url = f"http://{HOST}:{args.daemon_port}", f"http://{HOST}:{args.serve_port}"
    return {
        DAEMON: Server(
            DAEMON,
            [args.python, "-m", "controller", "serve", "--config", str(config_path)],
            daemon_url,
            (f"http://{HOST}:{args.admin_port}/healthz", f"{daemon_url}/health"),
        ),
        VLLM_SERVE: Server(
            VLLM_SERVE, [args.python, launcher, *serve_args], serve_url, (f"{serve_url}/health",)
        ),
    }


async def measure(server: Server, model: str, mix: Mix, args: argparse.Namespace) -> dict[str, Any]:
    """Unloaded TTFT; the sustained rate when ``mix`` has none yet; then the overload."""
    base_ttft = await unloaded_ttft(server.base_url, model)
    result: dict[str, Any] = {"unloaded_ttft_ms": 1000 * base_ttft}
    if mix.rate_per_s <= 0:
        sustained = await capacity(server.base_url, model, mix, args.limit, args.capacity_seconds)
        result["sustained_per_s"] = sustained
        mix = replace(mix, rate_per_s=args.overload * sustained)
    result["offered_per_s"] = mix.rate_per_s
    outcomes = await run_mix(server.base_url, model, mix)
    result["outcomes"] = outcomes
    return result


def run_server(server: Server, model: str, mix: Mix, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    print(f"== {server.name}", flush=True)
    with running(
        server, logs / f"overload-{server.name}.log", args.startup_timeout, args.stop_timeout
    ) as run:
        result = asyncio.run(measure(server, model, mix, args))
    result["startup_s"] = run.startup_s
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    head = (
        "| server | class | sent | served | 429 (with Retry-After) | 5xx | no answer | TTFT p50 ms | "
        "TTFT p99 ms | within SLO | goodput/s |"
    )
    rows = [head, "|" + " --- |" * 11]
    for name, s in summaries.items():
        for cls in (INTERACTIVE, BATCH):
            c = s[cls]
            rows.append(
                f"| {name} | {cls} | {c['sent']} | {c['served']} | {c['refused_429']} "
                f"({c['refused_with_retry_after']}) | {c['server_errors_5xx']} | {c['no_answer']} | "
                f"{_ms(c['ttft_p50_ms'])} | {_ms(c['ttft_p99_ms'])} | {c['within_slo_share']:.1%} | "
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
    d, v = summaries[DAEMON], summaries[VLLM_SERVE]
    base_d, base_v = results[DAEMON]["unloaded_ttft_ms"], results[VLLM_SERVE]["unloaded_ttft_ms"]
    p99 = (d[INTERACTIVE]["ttft_p99_ms"] or 0.0) / max(v[INTERACTIVE]["ttft_p99_ms"] or 0.0, 1e-9)
    return (
        f"offered {mix.rate_per_s:.2f} req/s for {args.duration:.0f} s ({args.overload:g}x the daemon's "
        f"sustained {results[DAEMON].get('sustained_per_s', 0):.2f} req/s); unloaded TTFT: daemon "
        f"{base_d:.1f} ms, vllm serve {base_v:.1f} ms; "
        f"SLO interactive {1000 * slo[INTERACTIVE]:.0f} ms, batch {slo[BATCH]:.0f} s\n"
        f"goodput daemon / vllm serve: {d['goodput_per_s'] / max(v['goodput_per_s'], 1e-9):.2f}x; "
        f"interactive p99 TTFT daemon / vllm serve: {p99:.3g}x"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--limit", type=int, default=16, help="the daemon's admission limit (default: max_num_seqs)"
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="engine max_num_seqs, both servers")
    p.add_argument("--overload", type=float, default=3.0, help="offered rate / the daemon's sustained rate")
    p.add_argument("--rate", type=float, default=0.0, help="offered requests/s (0: measure, x --overload)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of open-loop arrivals")
    p.add_argument("--timeout", type=float, default=60.0, help="a request unanswered this long is a miss")
    p.add_argument("--capacity-seconds", type=float, default=8.0)
    p.add_argument(
        "--interactive-deadline", type=float, default=2.5, help="the daemon's interactive deadline"
    )
    p.add_argument("--batch-deadline", type=float, default=10.0, help="the daemon's batch queue deadline")
    p.add_argument("--slo-factor", type=float, default=25.0, help="interactive TTFT SLO / unloaded TTFT")
    p.add_argument("--batch-slo", type=float, default=20.0, help="batch TTFT SLO, seconds")
    p.add_argument(
        "--engine-poll-sleep",
        type=float,
        default=None,
        help="the daemon's [server] engine_poll_sleep_s (default: the daemon's own; 0: vLLM's spin)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "overload.json")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs both servers")
    p.add_argument("--config", type=Path, default=ROOT / "config.toml", help="config to copy the engine from")
    p.add_argument("--daemon-port", type=int, default=8110)
    p.add_argument("--admin-port", type=int, default=9510)
    p.add_argument("--serve-port", type=int, default=8210)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--stop-timeout", type=float, default=60.0)
    return p.parse_args(argv)


def _interrupt_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through ``running``, which stops its server


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    busy = [p for p in (args.daemon_port, args.admin_port, args.serve_port) if not port_free(p)]
    if busy:
        print(f"ports already in use: {busy}; pick others with --daemon-port/--admin-port/--serve-port")
        return 2
    base = load_base_config(args.config)
    base["engine"] = {**base["engine"], "max_num_seqs": args.max_num_seqs}
    ensure_model(args, base["engine"])
    model = served_model(base["engine"])
    mix = Mix(rate_per_s=args.rate, duration_s=args.duration, timeout_s=args.timeout, seed=args.seed)
    results: dict[str, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
            servers = make_servers(args, base, Path(tmp))
            results[DAEMON] = run_server(servers[DAEMON], model, mix, args, args.out.parent / "logs")
            mix = replace(mix, rate_per_s=results[DAEMON]["offered_per_s"])
            results[VLLM_SERVE] = run_server(servers[VLLM_SERVE], model, mix, args, args.out.parent / "logs")
    except KeyboardInterrupt:
        print("interrupted; the running server was stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    slo = {
        INTERACTIVE: max(args.slo_factor * results[VLLM_SERVE]["unloaded_ttft_ms"] / 1000, 0.25),
        BATCH: args.batch_slo,
    }
    summaries = {name: summarize(r.pop("outcomes"), slo, args.duration) for name, r in results.items()}
    print("\n" + headline(results, summaries, slo, mix, args) + "\n\n" + format_table(summaries))
    out = {"argv": sys.argv, "settings": {k: str(v) for k, v in vars(args).items()}, "servers": results}
    out["summary"], out["slo_s"] = summaries, slo
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

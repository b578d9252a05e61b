"""``bench soak``: a long steady load on one server we start, ending in a pass/fail verdict with reasons.

Watched: the server exiting (and whether it looks like an OOM kill), engine restarts (our daemon's
``autopilot_engine_restarts_total``), failed requests, throughput decay (output tokens/s of the last window
against the first), TTFT growth, and resident-memory growth (a least-squares line through the RSS samples
after the first window, its rise over the run relative to its start). The verdict is a pure function of the
run directory's figures (:func:`verdict`), so it is tested on made-up runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from controller.bench.runner import add_slo_args
from controller.bench.servers import ServerSpec, log_tail
from controller.bench.targets import add_server_args, parse_assignments, prepare, run_dir, run_one
from controller.load.options import add_workload_args
from controller.results.records import SeriesPoint, percentile, read_series

RESULT = "soak.json"
OOM_MARKERS = ("out of memory", "outofmemoryerror", "oom-kill", "oom_kill", "killed process", "memoryerror")


@dataclass(frozen=True)
class SoakVerdictLimits:
    """What a soak tolerates before its verdict fails."""

    window_s: float = 60.0
    """Length of the first and last windows compared."""
    max_decay: float = 0.2
    """Largest allowed drop of output throughput, last window vs first (0.2 = 20 %)."""
    max_ttft_growth: float = 3.0
    """Largest allowed ratio of median TTFT, last window vs first."""
    max_rss_growth: float = 0.1
    """Largest allowed rise of the fitted RSS line over the run, relative to its start (0.1 = 10 %)."""
    max_failed: float = 0.01
    """Largest allowed share of failed requests."""


def add_parser(cmds: Any) -> None:
    p = cmds.add_parser("soak", help="long stress on one server: OOM, restarts, decay, RSS growth -> verdict")
    add_server_args(p)
    p.add_argument("--server", choices=("daemon", "vllm-serve"), default="daemon")
    p.add_argument("--policy", help="the daemon's policy (default: the config's)")
    p.add_argument("--policy-param", action="append", metavar="KEY=VALUE", help="a parameter of --policy")
    p.add_argument("--window", type=float, default=60.0, help="seconds compared at the start and the end")
    p.add_argument("--max-decay", type=float, default=0.2, help="allowed throughput drop (default 0.2)")
    p.add_argument("--max-ttft-growth", type=float, default=3.0, help="allowed TTFT p50 ratio (default 3)")
    p.add_argument("--max-rss-growth", type=float, default=0.1, help="allowed RSS rise (default 0.1)")
    p.add_argument("--max-failed", type=float, default=0.01, help="allowed failed share (default 0.01)")
    add_workload_args(p)
    add_slo_args(p)


def _window(series: Sequence[SeriesPoint], lo: float, hi: float) -> list[SeriesPoint]:
    return [p for p in series if lo < p.t_s <= hi]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def line_rise(points: Sequence[tuple[float, float]]) -> float | None:
    """Rise of the least-squares line through ``points`` from the first to the last x, relative to its
    value at the first x; None with fewer than three points or no spread in x."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    slope = sum((t - mt) * (v - mv) for t, v in points) / var
    start = mv + slope * (points[0][0] - mt)
    end = mv + slope * (points[-1][0] - mt)
    return (end - start) / start if start > 0 else None


def rss_growth(series: Sequence[SeriesPoint], skip_s: float) -> float | None:
    """Rise of the least-squares RSS line from the first to the last sample after ``skip_s``, relative."""
    return line_rise(
        [(p.t_s, float(p.rss_bytes)) for p in series if p.rss_bytes is not None and p.t_s > skip_s]
    )


def verdict(
    summary: dict[str, Any], series: Sequence[SeriesPoint], limits: SoakVerdictLimits, log_text: str = ""
) -> tuple[bool, list[str], dict[str, Any]]:
    """(passed, reasons for failing, the figures checked)."""
    reasons: list[str] = []
    end = float(summary["duration_s"])
    first = _window(series, 0.0, limits.window_s)
    last = _window(series, max(limits.window_s, end - limits.window_s), end)
    tok_first = _mean([p.output_tok_s for p in first if p.output_tok_s is not None])
    tok_last = _mean([p.output_tok_s for p in last if p.output_tok_s is not None])
    ttft_first = percentile([p.ttft_p50_s for p in first if p.ttft_p50_s is not None], 50)
    ttft_last = percentile([p.ttft_p50_s for p in last if p.ttft_p50_s is not None], 50)
    growth = rss_growth(series, limits.window_s)
    failed_share = summary["failed"] / summary["requests"] if summary["requests"] else 0.0
    figures = {
        "throughput_first_tok_s": tok_first,
        "throughput_last_tok_s": tok_last,
        "ttft_p50_first_s": ttft_first,
        "ttft_p50_last_s": ttft_last,
        "rss_growth": growth,
        "failed_share": failed_share,
        "engine_restarts": summary.get("engine_restarts"),
        "exit_code": summary.get("exit_code"),
        "server_alive_at_end": summary.get("server_alive_at_end"),
    }
    if summary.get("server_alive_at_end") is False:
        oom = any(m in log_text.lower() for m in OOM_MARKERS) or summary.get("exit_code") in (-9, 137)
        reasons.append(
            f"server exited during the run (exit code {summary.get('exit_code')})"
            + ("; looks like an OOM kill" if oom else "")
        )
    if summary.get("engine_restarts"):
        reasons.append(f"{summary['engine_restarts']:.0f} engine restart(s) during the run")
    if failed_share > limits.max_failed:
        reasons.append(f"{failed_share:.1%} of requests failed (limit {limits.max_failed:.1%})")
    if tok_first and tok_last is not None and tok_last < (1 - limits.max_decay) * tok_first:
        reasons.append(
            f"throughput decayed from {tok_first:.0f} to {tok_last:.0f} tok/s (limit -{limits.max_decay:.0%})"
        )
    if ttft_first and ttft_last is not None and ttft_last > limits.max_ttft_growth * ttft_first:
        reasons.append(
            f"median TTFT grew from {ttft_first:.3f} to {ttft_last:.3f} s (limit x{limits.max_ttft_growth:g})"
        )
    if growth is not None and growth > limits.max_rss_growth:
        reasons.append(f"resident memory grew {growth:.1%} over the run (limit {limits.max_rss_growth:.0%})")
    if summary["requests"] and summary["ok"] == 0:
        reasons.append("no request completed")
    return not reasons, reasons, figures


def main(args: argparse.Namespace) -> int:
    if args.duration is None:
        raise ValueError("bench soak needs --duration SECONDS (how long to stress)")
    if args.trace is not None:
        args.duration = (
            args.duration * args.time_scale
        )  # the trace window that lasts --duration when replayed
    bench = prepare(args)
    control: dict[str, Any] = {}
    if args.policy:
        control = {
            "policy": args.policy,
            "params": parse_assignments(args.policy_param or [], "--policy-param"),
        }
    name = f"soak-{args.server}" + (f"-{args.policy}" if args.policy else "")
    spec = ServerSpec(name, args.server, bench.engine, control, dict(bench.base.get("admission") or {}))
    target = run_dir(args.out, name)
    logs = args.out / "logs"
    summary = run_one(bench, spec, target, logs)
    limits = SoakVerdictLimits(
        args.window, args.max_decay, args.max_ttft_growth, args.max_rss_growth, args.max_failed
    )
    log_text = log_tail(logs / f"{name}.log", 400)
    passed, reasons, figures = verdict(summary, read_series(target / "timeseries.jsonl"), limits, log_text)
    result = {"passed": passed, "reasons": reasons, "figures": figures, "limits": asdict(limits)}
    (args.out / RESULT).write_text(json.dumps(result, indent=2) + "\n")
    print(f"soak {'PASSED' if passed else 'FAILED'}" + "".join(f"\n  - {r}" for r in reasons))
    print(json.dumps(figures, indent=2))
    return 0 if passed else 1

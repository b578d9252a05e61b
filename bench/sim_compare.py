"""Policy comparison on the twin: static presets against each policy, on both Azure traces.

    .venv/bin/python bench/sim_compare.py --profile h200-8b --out /tmp/sim-compare --docs docs/sim

For each trace (its own time scale) and each configuration it runs the whole trace through the twin
(``controller/sim``: the real gate, policy, normalize stage and control loop on a virtual clock), writes
each run's ``records.jsonl`` / ``timeseries.jsonl`` / ``summary.json`` under ``--out/<trace>/<config>/``
(``bench report`` reads them), and writes to ``--docs`` a JSON of the summaries, a markdown table and
two plots per trace: goodput and p99 TTFT per configuration, and the knobs, KV usage and gate queue over
time for each configuration. Policies run with their default parameters, as an operator would first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import structlog  # noqa: E402

from controller.bench.records import write_jsonl  # noqa: E402
from controller.bench.workload import read_azure_trace, trace_window  # noqa: E402
from controller.control.normalize import Normalizer  # noqa: E402
from controller.sim.profile import load_profile  # noqa: E402
from controller.sim.run import ControlSettings, SimResult, Simulation  # noqa: E402
from policies.base import build_policy  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("static-default", "static", {}),  # vLLM as configured: the cap at max_num_seqs, no gate limit below it
    ("static-interactive", "static", {"preset": "interactive"}),
    ("static-throughput", "static", {"preset": "throughput"}),
    ("static-mixed", "static", {"preset": "mixed"}),
    ("static-small", "static", {"preset": "small"}),
    ("hysteresis", "hysteresis", {}),
    ("pid", "pid", {}),
    ("gradient", "gradient", {}),
    ("aimd", "aimd", {}),
]


KEYS = (
    "requests", "refused", "goodput_rps", "slo_attainment", "throughput_tok_s", "ttft_p50", "ttft_p99",
    "tpot_p99", "engine_preemptions", "limit_changes", "queue_depth_max", "sim_wall_s",
)  # fmt: skip
HEADER = (
    "| config | goodput req/s | SLO met | tok/s | TTFT p50 / p99 s | TPOT p99 ms | preemptions "
    "| limit changes | max gate queue |"
)


def table_row(r: dict[str, Any]) -> str:
    return (
        f"| {r['config']} | {r['goodput_rps']:.2f} | {r['slo_attainment']:.1%} "
        f"| {r['throughput_tok_s']:.0f} "
        f"| {r['ttft_p50']:.3f} / {r['ttft_p99']:.2f} | {r['tpot_p99'] * 1e3:.0f} "
        f"| {r['engine_preemptions']} "
        f"| {r['limit_changes']} | {r['queue_depth_max']} |"
    )


def run_one(profile_name: str, policy: str, params: dict[str, Any], specs: Any) -> SimResult:
    profile = load_profile(profile_name)
    seqs = profile.engine.max_num_seqs
    limit = seqs  # [admission] limit: the engine's ceiling, as config.toml sets it
    pol = build_policy(policy, params, max_num_seqs=seqs, initial_limit=limit)
    sim = Simulation(profile, pol, Normalizer(limit_max=4096), ControlSettings(admission_limit=limit))
    return asyncio.run(sim.run(specs))


def plot_bars(trace: str, rows: list[dict[str, Any]], path: Path, title: str) -> None:
    names = [r["config"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax1.bar(names, [r["goodput_rps"] for r in rows], color="tab:green")
    ax1.set_ylabel("goodput (req/s within SLO)")
    ax2.bar(names, [r["ttft_p99"] or 0 for r in rows], color="tab:red")
    ax2.set_ylabel("p99 TTFT (s)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_series(results: dict[str, SimResult], path: Path, title: str) -> None:
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.9 * len(results)), sharex=True)
    for ax, (name, res) in zip(axes, results.items(), strict=True):
        t = [p.t_s for p in res.series]
        ax.plot(t, [p.batch_cap for p in res.series], label="batch cap", color="tab:blue")
        ax.plot(t, [p.running for p in res.series], label="running", color="tab:cyan", lw=0.6)
        ax.plot(t, [p.queue_depth for p in res.series], label="gate queue", color="tab:orange", lw=0.6)
        ax.set_yscale("symlog")
        ax.set_ylabel(name, fontsize=8)
        kv = ax.twinx()
        kv.plot(t, [p.kv_usage for p in res.series], color="tab:red", lw=0.6, label="KV usage")
        kv.set_ylim(0, 1)
        kv.tick_params(labelsize=7)
    axes[0].legend(loc="upper left", fontsize=7, ncol=3)
    axes[-1].set_xlabel("simulated seconds (KV usage in red, right axis)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="h200-8b")
    p.add_argument("--conv-time-scale", type=float, default=4.0)
    p.add_argument("--code-time-scale", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=None, help="trace seconds (default: the whole hour)")
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=Path("/tmp/sim-compare"))
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "sim")
    args = p.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    args.docs.mkdir(parents=True, exist_ok=True)
    table: dict[str, list[dict[str, Any]]] = {}
    for trace, scale in (("conv", args.conv_time_scale), ("code", args.code_time_scale)):
        specs = trace_window(read_azure_trace(TRACES / f"azure_llm_2023_{trace}.csv"),
                             duration_s=args.duration, time_scale=scale)  # fmt: skip
        results: dict[str, SimResult] = {}
        rows = []
        for name, policy, params in CONFIGS:
            res = run_one(args.profile, policy, params, specs)
            results[name] = res
            res.extra.update(kind="sim", policy=policy, policy_params=params, trace=trace, time_scale=scale)
            summary = res.summary(args.slo_ttft, args.slo_tpot)
            summary["target"] = f"twin:{args.profile}:{name}"
            run_dir = args.out / trace / name
            run_dir.mkdir(parents=True, exist_ok=True)
            write_jsonl(run_dir / "records.jsonl", res.records)
            write_jsonl(run_dir / "timeseries.jsonl", res.series)
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            rows.append({"config": name, **{k: summary[k] for k in KEYS}})
            print(trace, json.dumps(rows[-1]), flush=True)
        table[trace] = rows
        title = (
            f"{args.profile}, Azure {trace} trace at {scale:g}x, "
            f"SLO TTFT {args.slo_ttft} s / TPOT {args.slo_tpot} s"
        )
        plot_bars(trace, rows, args.docs / f"sim-{trace}-goodput.png", title)
        plot_series(results, args.docs / f"sim-{trace}-series.png", title)
    meta = {
        "profile": args.profile,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "time_scale": {"conv": args.conv_time_scale, "code": args.code_time_scale},
        "duration_s": args.duration,
    }
    (args.docs / "sim-compare.json").write_text(json.dumps({"meta": meta, "runs": table}, indent=2) + "\n")
    for trace, rows in table.items():
        print(f"\n{trace}:\n{HEADER}\n" + "|---" * 9 + "|")
        for r in rows:
            print(table_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

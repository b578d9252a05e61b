"""``vllm-autopilot simulate --compare``: the static presets against each policy on one trace window.

Each configuration runs the same requests through the twin (the real gate, policy, normalize stage and
control loop on a virtual clock) with its default parameters, as an operator would first try it. It
writes each run's directory (``bench report`` reads them) under ``--out/<config>/``, and into ``--out``
``compare.json`` (the summaries), ``compare.md`` (the table) and two plots: goodput and p99 TTFT per
configuration, and the knobs, KV usage and gate queue over time for each configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controller.config.load import AdmissionConfig, ControlConfig
from controller.load.workload import RequestSpec
from controller.profiles.load import Profile
from controller.results.tables import SIM_COLUMNS, render_table
from controller.sim.run import SimResult
from controller.sim.twin import build_simulation, write_result
from policies.slo_targets import SloTargets

CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("static-default", "static", {}),  # vLLM as configured: the cap at max_num_seqs, no gate limit below it
    ("static-interactive", "static", {"preset": "interactive"}),
    ("static-throughput", "static", {"preset": "throughput"}),
    ("static-mixed", "static", {"preset": "mixed"}),
    ("static-small", "static", {"preset": "small"}),
    ("hysteresis", "hysteresis", {}),
    ("pid", "pid", {}),
    ("slo", "slo", {}),
]
KEYS = (
    "requests",
    "refused",
    "goodput_rps",
    "slo_attainment",
    "throughput_tok_s",
    "ttft_p50",
    "ttft_p99",
    "tpot_p99",
    "engine_preemptions",
    "limit_changes",
    "queue_depth_max",
    "sim_wall_s",
)
"""A configuration's row of ``compare.json`` and ``grid.json`` (and of their tables): these keys of its
summary, after its name in ``config``."""


def run_compare(
    args: argparse.Namespace,
    profile: Profile,
    control: ControlConfig,
    admission: AdmissionConfig,
    specs: Sequence[RequestSpec],
    slo: SloTargets | None = None,
) -> int:
    """Every configuration of :data:`CONFIGS` over ``specs``: its policy and parameters replace
    ``control``'s; the rest of ``control`` and ``admission`` (``--config``'s or the defaults) apply."""
    results: dict[str, SimResult] = {}
    rows = []
    for name, policy, params in CONFIGS:
        run = dataclasses.replace(control, policy=policy, params=params)
        sim = build_simulation(
            profile,
            run,
            admission,
            seed=args.seed,
            jitter=args.jitter,
            use_variance=not args.no_variance,
            slo=slo,
        )
        res = results[name] = asyncio.run(sim.run(specs))
        res.extra.update(
            kind="sim", policy=policy, policy_params=params, trace=str(args.trace), time_scale=args.time_scale
        )
        summary = res.summary(args.slo_ttft, args.slo_tpot)
        summary["target"] = f"twin:{profile.name}:{name}"
        write_result(args.out / name, res, summary)
        rows.append({"config": name, **{k: summary[k] for k in KEYS}})
        print(json.dumps(rows[-1]), flush=True)
    meta = {
        "profile": profile.name,
        "trace": str(args.trace),
        "load": args.workload_desc,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "start_s": args.start,
        "duration_s": args.duration,
        "time_scale": args.time_scale,
        "token_scale": args.token_scale,
    }
    (args.out / "compare.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2) + "\n")
    text = render_table(SIM_COLUMNS, rows)
    (args.out / "compare.md").write_text(text + "\n")
    title = f"{profile.name}, {args.workload_desc}, SLO TTFT {args.slo_ttft} s / TPOT {args.slo_tpot} s"
    plot_bars(rows, args.out / "goodput.png", title)
    plot_series(results, args.out / "series.png", title)
    print(f"\n{text}")
    return 0


def plot_bars(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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

"""``vllm-autopilot simulate``: argument parsing and the run.

``simulate`` replays a trace window through the twin under one policy and writes what ``bench run``
writes (``records.jsonl``, ``timeseries.jsonl``, ``summary.json``), plus ``decisions.jsonl`` (every
knob change with its reason) and, through ``bench report``'s renderer, ``report/`` (plots and
``report.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tomllib
from pathlib import Path
from typing import Any

from controller.profiles.load import ProfileError


def add_simulate_parser(sub: Any) -> None:
    from controller.load.options import add_alternate_args, add_shared_prefix_args
    from controller.load.sessions import SharedPrefix

    p = sub.add_parser(
        "simulate",
        help="replay a trace through the virtual-time engine twin under a policy",
        description="Replay a trace window through the twin (controller/sim) with the real gate, policy, "
        "normalize stage and control loop on a virtual clock; write records.jsonl, timeseries.jsonl, "
        "summary.json and decisions.jsonl into --out.",
    )
    p.add_argument(
        "--trace",
        type=Path,
        help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens); or --workload",
    )
    p.add_argument(
        "--workload",
        choices=("shared-prefix",),
        help="instead of --trace: shared-prefix, chat sessions with shared system prompts and re-sent "
        "history at --rate for --duration (controller/load/sessions.py)",
    )
    p.add_argument("--rate", type=float, help="requests per second of --workload")
    p.add_argument(
        "--output-tokens",
        type=int,
        default=SharedPrefix.output_tokens,
        help=f"--workload: mean answer length (default {SharedPrefix.output_tokens})",
    )
    add_shared_prefix_args(p)
    p.add_argument("--start", type=float, default=0.0, help="window start, seconds of trace time")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="window length, seconds of trace time; with --workload, seconds of sessions",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="replay K times faster")
    p.add_argument("--token-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    p.add_argument(
        "--profile",
        required=True,
        help="a shipped profile name (cpu-tiny, cpu-smollm2, h200-8b) or a .toml path",
    )
    p.add_argument(
        "--policy", default=None, help="policy name or module:Class (default: --config's, else slo)"
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help='a policy parameter (TOML value: 0.8, "mean", true); repeatable',
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a config.toml: its [engine] limits, [admission], [control] apply",
    )
    p.add_argument(
        "--slo-ttft",
        type=float,
        required=True,
        help="TTFT SLO, seconds: goodput's, and [slo] if --config has none",
    )
    p.add_argument(
        "--slo-tpot",
        type=float,
        required=True,
        help="TPOT SLO, seconds: goodput's, and [slo] if --config has none",
    )
    add_alternate_args(p)
    p.add_argument(
        "--grid",
        nargs="+",
        metavar="AXIS=V1,V2",
        help="run --policy, vLLM's defaults and every static point of limit=.. budget=.. "
        "deadline=.. (all three axes); write grid.json and grid.md, with ratios",
    )
    p.add_argument("--grid-runs", action="store_true", help="with --grid: also write each run's directory")
    p.add_argument("--jobs", type=int, default=1, help="with --grid: runs at once (processes)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the front-end and step-time draws")
    p.add_argument(
        "--jitter", type=float, default=0.0, help="extra Gaussian step-time noise, e.g. 0.05 = 5 %% (0: none)"
    )
    p.add_argument(
        "--no-variance",
        action="store_true",
        help="ignore the profile's [variance]: constant frontend_s, mean steps",
    )
    p.add_argument("--no-report", action="store_true", help="skip the plots and report.md in DIR/report")
    p.add_argument(
        "--compare",
        action="store_true",
        help="run the static presets and every policy with its defaults instead of one "
        "--policy; write DIR/<config>/, compare.json, compare.md and plots",
    )
    p.set_defaults(func=run_simulate)


def parse_params(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; VALUE is read as a TOML value, else taken as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param {item!r}: write KEY=VALUE, e.g. --param setpoint=0.8")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw
    return out


def run_simulate(args: argparse.Namespace) -> int:
    from controller.config.load import ConfigError
    from controller.load.workload import WorkloadError
    from controller.profiles.load import load_profile
    from controller.results.tables import format_sim_summary
    from controller.sim.twin import build_simulation, with_config, write_result
    from policies.base import PolicyError

    try:
        profile, control, admission, slo = with_config(
            load_profile(args.profile),
            args.config,
            args.policy,
            parse_params(args.param),
            (args.slo_ttft, args.slo_tpot),
        )
        specs = _specs(args)
        if args.grid:
            from controller.sim.grid import run_grid

            _quiet_logs()
            return run_grid(args, profile, control, admission, specs, slo)
        if args.compare:
            from controller.sim.compare import run_compare

            _quiet_logs()
            return run_compare(args, profile, control, admission, specs, slo)
        sim = build_simulation(
            profile,
            control,
            admission,
            seed=args.seed,
            jitter=args.jitter,
            use_variance=not args.no_variance,
            slo=slo,
        )
    except ConfigError as exc:
        print(f"{args.config}: invalid config: {'; '.join(exc.errors)}", file=sys.stderr)
        return 1
    except (ProfileError, PolicyError, WorkloadError, ValueError) as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 1
    _quiet_logs()
    policy = sim.loop.policy
    result = asyncio.run(sim.run(specs))
    result.extra.update(
        kind="sim",
        policy=policy.name,
        policy_params=policy.params(),
        trace=str(args.trace),
        load=args.workload_desc,
        window={
            "start_s": args.start,
            "duration_s": args.duration,
            "time_scale": args.time_scale,
            "token_scale": args.token_scale,
        },
        seed=args.seed,
        jitter=args.jitter,
    )
    summary = result.summary(args.slo_ttft, args.slo_tpot)
    write_result(args.out, result, summary)
    print(format_sim_summary(summary))
    if not args.no_report:
        from controller.results.report import render

        title = f"Twin ({profile.name}): {policy.name} on {args.workload_desc}"
        print(f"report: {render(args.out / 'report', [args.out], title=title)}")
    return 0


def _specs(args: argparse.Namespace) -> list[Any]:
    """The window of ``--trace`` (with ``--alternate``, its windows in turn with the other traces'), or
    ``--workload shared-prefix``; sets ``args.workload_desc`` for reports."""
    from controller.load.options import shared_prefix_specs, trace_specs
    from controller.load.workload import WorkloadError

    if (args.trace is None) == (args.workload is None):
        raise WorkloadError(
            "give one workload: --trace PATH or --workload shared-prefix --rate R --duration S"
        )
    if args.workload is not None:
        specs = shared_prefix_specs(args)
        args.workload_desc = (
            f"shared-prefix at {args.rate:g} req/s ({args.system_prompts} system prompts of "
            f"{args.system_tokens} tokens, {args.turns} turns)"
        )
        return specs
    specs, args.workload_desc = trace_specs(args)
    return specs


def _quiet_logs() -> None:
    """The control loop logs each knob change; a simulation makes thousands, keep stdout for results."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

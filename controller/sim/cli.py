"""``vllm-autopilot simulate`` and ``vllm-autopilot bench calibrate``: argument parsing and the runs.

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

from controller.sim.profile import ProfileError


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


def add_calibrate_parser(bench_sub: Any) -> None:
    from controller.sim.measure import CalibrationPlan

    plan = CalibrationPlan()
    p = bench_sub.add_parser(
        "calibrate",
        help="fit the twin's cost model from a vLLM server and write a profile",
        description="Drive prefill-heavy and decode-heavy loads against URL (or our daemon started with "
        "--config) and fit step_s = a + "
        "b*prefill_tokens + c*decode_seqs + d*kv_tokens_read by least squares (controller/sim/calibrate.py).",
    )
    p.add_argument("--url", default=None, help="base URL of a running OpenAI API, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="instead of --url: start our daemon with this config.toml (free ports, the bench's "
        "launcher), fit against it, stop it",
    )
    p.add_argument("--out", type=Path, required=True, help="profile file to write (.toml)")
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default URL/metrics)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the server's max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's token budget")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV capacity when /metrics lacks it")
    p.add_argument("--max-concurrency", type=int, default=64, help="largest decode batch to measure")
    p.add_argument("--repeats", type=int, default=5, help="measurements of each point (the median is fitted)")
    p.add_argument(
        "--prefill-prompts",
        type=prompt_list,
        default=plan.prefill_prompts,
        help="prompt lengths of the prefill points, comma-separated (default 32,...,1536); the "
        "fit is linear in prefill tokens, and on a CPU long prompts cost more a token "
        "(attention), so measure the lengths the traffic has",
    )
    p.add_argument(
        "--frontend-probes",
        type=int,
        default=200,
        help="light-load requests timing the front end's spread (0: no [variance])",
    )
    p.add_argument(
        "--load-in-flight",
        type=in_flight_list,
        default=plan.load_in_flight,
        help="in-flight targets of the open-loop phases that time the front end under load "
        "('' for none; default 2,6,12,24)",
    )
    p.add_argument(
        "--load-phase-s",
        type=float,
        default=plan.load_phase_s,
        help="seconds per load phase, at least (default 30)",
    )
    p.add_argument(
        "--load-requests",
        type=int,
        default=plan.load_requests,
        help="requests per load phase, at least (default 300)",
    )
    p.add_argument("--hardware", default="", help="recorded in the profile")
    p.add_argument("--model", default="", help="recorded in the profile")
    p.set_defaults(func=run_calibrate)


def add_validate_parser(bench_sub: Any) -> None:
    """``bench validate``: the twin against the real engine (``controller/sim/validate.py``)."""
    from controller.sim.validate import add_parser

    add_parser(bench_sub)


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
    from controller.sim.profile import load_profile
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
    print(format_summary(summary))
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


def format_summary(s: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    return (
        f"{s.get('policy', '?')}: {s['requests']} requests ({s['refused']} refused, {s['failed']} failed), "
        f"goodput {s['goodput_rps']:.2f} req/s, throughput {s['throughput_tok_s']:.0f} tok/s, "
        f"TTFT p50/p99 {ms(s['ttft_p50'])}/{ms(s['ttft_p99'])}, TPOT p99 {ms(s['tpot_p99'])}, "
        f"preemptions {s['engine_preemptions']}, limit changes {s['limit_changes']}, "
        f"{s['duration_s']:.0f} s simulated in {s['sim_wall_s']:.1f} s"
    )


def _quiet_logs() -> None:
    """The control loop logs each knob change; a simulation makes thousands, keep stdout for results."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def run_calibrate(args: argparse.Namespace) -> int:
    """Fit against ``--url``, or against our daemon started with ``--config``'s tables."""
    from controller.sim.calibrate import calibrate, describe_fit
    from controller.sim.measure import CalibrationPlan, our_daemon

    if (args.url is None) == (args.config is None):
        print(
            "bench calibrate: give --url URL (a running server) or --config PATH (start our daemon)",
            file=sys.stderr,
        )
        return 2
    overrides = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "scheduling_policy": args.scheduling_policy,
        "kv_cache_tokens": args.kv_cache_tokens,
    }
    plan = CalibrationPlan(
        concurrency=tuple(n for n in CalibrationPlan.concurrency if n <= args.max_concurrency),
        prefill_prompts=args.prefill_prompts,
        repeats=args.repeats,
        frontend_probes=args.frontend_probes,
        load_in_flight=args.load_in_flight,
        load_requests=args.load_requests,
        load_phase_s=args.load_phase_s,
    )
    name, described = args.name or args.out.stem, (args.hardware, args.model)
    try:
        if args.config is None:
            profile = calibrate(args.url, args.metrics_url, args.out, name, plan, overrides, described)
        else:
            with our_daemon(args.config, args.out.parent / f"{args.out.stem}-logs") as server:
                url, metrics = server.base_url, server.metrics_url
                profile = calibrate(url, metrics, args.out, name, plan, overrides, described)
    except (OSError, ProfileError, RuntimeError) as exc:
        print(f"bench calibrate: {args.url or args.config}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(describe_fit(profile, args.out)))
    return 0


def prompt_list(text: str) -> tuple[int, ...]:
    """``--prefill-prompts``: comma-separated prompt lengths >= 1, at least two (the fit's slope)."""
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: write prompt lengths like 16,64,256") from exc
    if len(values) < 2 or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least two prompt lengths, each >= 1")
    return values


def in_flight_list(text: str) -> tuple[int, ...]:
    """``--load-in-flight``: comma-separated counts >= 1, or empty for none."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        msg = f"{text!r}: write in-flight counts like 2,6,12,24 (or '' for none)"
        raise argparse.ArgumentTypeError(msg) from exc
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: in-flight counts must be >= 1")
    return values

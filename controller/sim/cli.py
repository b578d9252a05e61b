"""``vllm-autopilot simulate`` and ``vllm-autopilot bench calibrate``: argument parsing and the runs.

``simulate`` replays a trace window through the twin under one policy and writes what ``bench run``
writes (``records.jsonl``, ``timeseries.jsonl``, ``summary.json``), plus ``decisions.jsonl`` (every
knob change with its reason) and, through ``bench report``'s renderer, ``report/`` (plots and
``report.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

from controller.sim.profile import ProfileError


def add_simulate_parser(sub: Any) -> None:
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
        required=True,
        help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)",
    )
    p.add_argument("--start", type=float, default=0.0, help="window start, seconds of trace time")
    p.add_argument("--duration", type=float, default=None, help="window length, seconds of trace time")
    p.add_argument("--time-scale", type=float, default=1.0, help="replay K times faster")
    p.add_argument("--token-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    p.add_argument(
        "--profile", required=True, help="a shipped profile name (cpu-tiny, h200-8b) or a .toml path"
    )
    p.add_argument(
        "--policy", default=None, help="policy name or module:Class (default: --config's, else static)"
    )
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy parameter (TOML value: 0.8, \"mean\", true); repeatable")  # fmt: skip
    p.add_argument("--config", type=Path, default=None,
                   help="a config.toml: its [engine] limits, [admission], [control] apply")  # fmt: skip
    p.add_argument("--slo-ttft", type=float, required=True, help="TTFT SLO in seconds (goodput)")
    p.add_argument("--slo-tpot", type=float, required=True, help="TPOT SLO in seconds (goodput)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the front-end and step-time draws")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="extra Gaussian step-time noise, e.g. 0.05 = 5 %% (0: none)")  # fmt: skip
    p.add_argument("--no-variance", action="store_true",
                   help="ignore the profile's [variance]: constant frontend_s, mean steps")  # fmt: skip
    p.add_argument("--no-report", action="store_true", help="skip the plots and report.md in DIR/report")


def add_calibrate_parser(bench_sub: Any) -> None:
    from controller.sim.calibrate import CalibrationPlan

    plan = CalibrationPlan()
    p = bench_sub.add_parser(
        "calibrate",
        help="fit the twin's cost model from a running vLLM server and write a profile",
        description="Drive prefill-heavy and decode-heavy loads against URL and fit step_s = a + "
        "b*prefill_tokens + c*decode_seqs + d*kv_tokens_read by least squares (controller/sim/calibrate.py).",
    )
    p.add_argument("--url", required=True, help="base URL of the OpenAI API, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", type=Path, required=True, help="profile file to write (.toml)")
    p.add_argument("--name", default=None, help="profile name (default: the file's stem)")
    p.add_argument("--metrics-url", default=None, help="Prometheus endpoint (default URL/metrics)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the server's max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's token budget")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV capacity when /metrics lacks it")
    p.add_argument("--max-concurrency", type=int, default=64, help="largest decode batch to measure")
    p.add_argument("--repeats", type=int, default=5, help="measurements of each point (the median is fitted)")
    p.add_argument("--frontend-probes", type=int, default=200,
                   help="light-load requests timing the front end's spread (0: no [variance])")  # fmt: skip
    p.add_argument("--load-in-flight", type=in_flight_list, default=plan.load_in_flight,
                   help="in-flight targets of the open-loop phases that time the front end under load "
                        "('' for none; default 2,6,12,24)")  # fmt: skip
    p.add_argument("--load-phase-s", type=float, default=plan.load_phase_s,
                   help="seconds per load phase, at least (default 30)")  # fmt: skip
    p.add_argument("--load-requests", type=int, default=plan.load_requests,
                   help="requests per load phase, at least (default 300)")  # fmt: skip
    p.add_argument("--hardware", default="", help="recorded in the profile")
    p.add_argument("--model", default="", help="recorded in the profile")
    p.set_defaults(func=run_calibrate)


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


def _simulation_parts(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(profile, policy, normalizer, control settings) from the arguments and the optional config."""
    from controller.config.load import AdmissionConfig, ControlConfig
    from controller.control.normalize import Normalizer
    from controller.sim.profile import load_profile
    from controller.sim.run import ControlSettings
    from policies.base import build_policy

    profile = load_profile(args.profile)
    control, admission = ControlConfig(), AdmissionConfig(limit=profile.engine.max_num_seqs)
    if args.config is not None:
        from controller.config.load import load_config

        config = load_config(args.config)
        limits = profile.engine.replace(config.engine, f"{args.config} [engine]")
        profile = dataclasses.replace(profile, engine=limits)
        control, admission = config.control, config.admission
    params = dict(control.params) if args.policy is None else {}
    params.update(parse_params(args.param))
    control = dataclasses.replace(control, policy=args.policy or control.policy, params=params)
    seqs = profile.engine.max_num_seqs
    policy = build_policy(control.policy, params, max_num_seqs=seqs, initial_limit=admission.limit)
    normalizer = Normalizer(  # as Daemon's make_normalizer builds it from [control]
        limit_max=control.limit_max,
        tolerance=control.tolerance,
        max_step_up=control.max_step_up,
        max_step_down=control.max_step_down,
        stabilization_s=control.stabilization_s,
    )
    settings = ControlSettings(
        tick_s=control.tick_seconds,
        window_s=control.window_seconds,
        admission_limit=admission.limit,
        max_queue=admission.max_queue,
        aging_s=admission.aging_s,
        classes=admission.classes,
    )
    return profile, policy, normalizer, settings


def run_simulate(args: argparse.Namespace) -> int:
    from controller.bench.records import write_jsonl
    from controller.bench.workload import WorkloadError, read_azure_trace, trace_window
    from controller.config.load import ConfigError
    from controller.sim.run import Simulation
    from policies.base import PolicyError

    try:
        profile, policy, normalizer, settings = _simulation_parts(args)
        specs = trace_window(
            read_azure_trace(args.trace),
            start_s=args.start,
            duration_s=args.duration,
            time_scale=args.time_scale,
            token_scale=args.token_scale,
        )
        sim = Simulation(
            profile,
            policy,
            normalizer,
            settings,
            seed=args.seed,
            jitter=args.jitter,
            use_variance=not args.no_variance,
        )
    except ConfigError as exc:
        print(f"{args.config}: invalid config: {'; '.join(exc.errors)}", file=sys.stderr)
        return 1
    except (ProfileError, PolicyError, WorkloadError, ValueError) as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 1
    _quiet_logs()
    result = asyncio.run(sim.run(specs))
    result.extra.update(
        kind="sim",
        policy=policy.name,
        policy_params=policy.params(),
        trace=str(args.trace),
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
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "records.jsonl", result.records)
    write_jsonl(args.out / "timeseries.jsonl", result.series)
    with (args.out / "decisions.jsonl").open("w") as fh:
        for change in result.changes:
            fh.write(json.dumps(dataclasses.asdict(change)) + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary))
    if not args.no_report:
        from controller.bench.report import render

        title = f"Twin ({profile.name}): {policy.name} on {args.trace.name}"
        print(f"report: {render(args.out / 'report', [args.out], title=title)}")
    return 0


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
    from controller.sim.calibrate import CalibrationPlan, build_profile, engine_limits, measure
    from controller.sim.profile import dump_profile

    overrides = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "scheduling_policy": args.scheduling_policy,
        "kv_cache_tokens": args.kv_cache_tokens,
    }
    try:
        limits, vocab = asyncio.run(engine_limits(args.url, args.metrics_url, overrides))
    except (OSError, ProfileError) as exc:
        print(f"bench calibrate: {args.url}: {exc}", file=sys.stderr)
        return 1
    plan = CalibrationPlan(
        concurrency=tuple(n for n in CalibrationPlan.concurrency if n <= args.max_concurrency),
        repeats=args.repeats,
        frontend_probes=args.frontend_probes,
        load_in_flight=args.load_in_flight,
        load_requests=args.load_requests,
        load_phase_s=args.load_phase_s,
    )
    measured = asyncio.run(measure(args.url, plan, limits, vocab, seed=0))
    profile = build_profile(args.name or args.out.stem, args.url, limits, measured, args.hardware, args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump_profile(profile))
    c = profile.cost
    print(
        f"wrote {args.out}: a={c.a_s * 1e3:.3f} ms, b={c.b_s_per_prefill_token * 1e6:.3f} us/token, "
        f"c={c.c_s_per_decode_seq * 1e6:.3f} us/seq, d={c.d_s_per_kv_token * 1e9:.3f} ns/kv-token, "
        f"R^2={profile.fit['r2']} over {len(measured.samples)} samples"
    )
    v = profile.variance
    if v.frontend:
        f = v.frontend
        print(f"front end over {f.samples} probes: p50 {f.sample(0.5) * 1e3:.2f} ms, "
              f"p99 {f.sample(0.99) * 1e3:.2f} ms, max {f.values[-1] * 1e3:.2f} ms")  # fmt: skip
    if v.step:
        print(f"step / mean step over {v.step.samples} gaps: p1 {v.step.sample(0.01):.2f}, "
              f"p50 {v.step.sample(0.5):.2f}, p99 {v.step.sample(0.99):.2f}")  # fmt: skip
    if v.frontend_loaded:
        for level, t in zip(v.frontend_loaded.levels, v.frontend_loaded.tables, strict=True):
            print(f"front end with >= {level} in flight over {t.samples} requests: "
                  f"p50 {t.sample(0.5) * 1e3:.2f} ms, p99 {t.sample(0.99) * 1e3:.2f} ms")  # fmt: skip
    return 0


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

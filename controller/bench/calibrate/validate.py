"""``vllm-autopilot bench validate``: one trace window through the real engine and through the twin.

For each time scale it replays the window of an Azure trace against our daemon (started with
``--config``'s tables by the bench's launcher; open loop, streaming ``/v1/completions`` with prompts of
exactly the trace's token counts, as token ids, through the bench's client), then simulates the same
requests with the profile (static policy, the daemon's admission limit and queue), and prints throughput
and p50/p99 TTFT of both with the ratio twin / real: the twin with the profile's measured front-end and
step-time spread (``[variance]``, seed 0; its p99 over seeds 0-4 too) and the mean model (constant
``frontend_s``, mean steps). ``--calibrate`` first refits the profile against the same config (its own
daemon start) and validates the refit. ``--real-from`` previous ``validation.json`` files reruns only
the twin against their real figures (no engine, no lock).

The real figures are the median of the real runs: ``--repeats`` replays of each scale on the one
engine, or every run the ``--real-from`` files hold. One replay of a short window is not enough: the
same window, config and engine build gave TTFT p50 30 % apart on two runs hours apart on a shared CPU
(docs/benchmarks.md, section 8), so the table also prints each run's figures and their spread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import time
import tomllib
from pathlib import Path
from typing import Any

from controller.bench.calibrate.measure import CalibrationPlan, our_daemon
from controller.bench.calibrate.run import calibrate, describe_fit
from controller.config.load import AdmissionConfig
from controller.load.client import Target, model_info, run_open_loop
from controller.load.workload import RequestSpec, clamp_lengths, read_azure_trace, trace_window
from controller.profiles.load import Profile, load_profile
from controller.results.records import RequestRecord, summarize, write_jsonl

RATIO_KEYS = ("throughput_tok_s", "ttft_p50", "ttft_p99", "tpot_p50")
FIGURES = ("requests", "ok", "throughput_tok_s", "ttft_p50", "ttft_p99", "tpot_p50", "duration_s")
SEEDS = 5
"""The twin with measured spread runs with seeds 0..SEEDS-1: the spread of its own p99."""
WARM_UP = ((1, 16), (4, 128), (16, 256), (32, 512), (8, 1024), (2, 2000), (64, 64))
"""(requests at once, prompt tokens): every prompt-length bucket and batch size once, unrecorded: the
CPU backend prepares kernels for new shapes on first use, and the twin models a warm engine."""
MAX_CONNECTIONS = 256


def add_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "validate",
        help="the twin against the real engine: one trace window through both, figures side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", type=Path, required=True, help="Azure LLM trace CSV")
    p.add_argument("--start", type=float, default=0.0, help="window start, seconds of trace time")
    p.add_argument("--duration", type=float, default=480.0, help="window length, seconds of trace time")
    p.add_argument("--time-scale", type=float, nargs="+", default=[4.0], help="one run per scale")
    p.add_argument("--token-scale", type=float, default=0.25, help="multiply prompt and output lengths")
    p.add_argument("--profile", default="cpu-tiny", help="a shipped profile name or a .toml path")
    p.add_argument("--config", type=Path, default=Path("config.toml"), help="the daemon's config")
    p.add_argument(
        "--out", type=Path, required=True, help="gets validation.json, real-x<scale>/records.jsonl, logs"
    )
    p.add_argument(
        "--calibrate", action="store_true", help="refit --profile against --config first (OUT/<name>.toml)"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="real replays of each scale; the real figures are their median"
    )
    p.add_argument(
        "--real-from",
        type=Path,
        nargs="+",
        default=None,
        help="previous validation.json files: their real runs pooled, no engine",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise SystemExit(f"bench validate: --repeats {args.repeats}: give 1 or more real replays a scale")
    rows = read_azure_trace(args.trace)
    previous = pooled_runs(args.real_from or [])
    profile = load_profile(args.profile)
    admission = daemon_admission(args.config)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.calibrate and not args.real_from:
        profile = refit(profile, args.config, args.out)
    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        url = None
        if not args.real_from:
            url = stack.enter_context(our_daemon(args.config, args.out / "logs")).base_url
        for ts in args.time_scale:
            window = trace_window(
                rows,
                start_s=args.start,
                duration_s=args.duration,
                time_scale=ts,
                token_scale=args.token_scale,
            )
            specs = clamp_lengths(window, 2048)
            if url is None:
                runs = previous[ts]
            else:
                keep = args.out / f"real-x{ts:g}"
                dirs = [keep / f"run{k}" for k in range(args.repeats)] if args.repeats > 1 else [keep]
                # the engine's first replay (first scale, first repeat) warms it up
                runs = [replay_real(url, specs, d, warm=not out and k == 0) for k, d in enumerate(dirs)]
            real = median_figures(runs)
            out.append(
                {
                    "time_scale": ts,
                    "real": real,
                    "real_runs": runs,
                    **twin_rows(specs, real, profile, admission),
                }
            )
            print(json.dumps(out[-1]), flush=True)
    print_table(out)
    (args.out / "validation.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


def pooled_runs(paths: list[Path]) -> dict[float, list[dict[str, Any]]]:
    """Every real run of each time scale in ``paths`` (a file's ``real_runs``, or its ``real`` alone
    where it predates them), in the order given."""
    runs: dict[float, list[dict[str, Any]]] = {}
    for path in paths:
        for row in json.loads(path.read_text()):
            runs.setdefault(row["time_scale"], []).extend(row.get("real_runs") or [row["real"]])
    return runs


def median_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over ``runs`` (one run: that run's figures)."""
    return {
        k: statistics.median(vals) if (vals := [r[k] for r in runs if r.get(k) is not None]) else None
        for k in FIGURES
    }


def daemon_admission(config: Path) -> AdmissionConfig:
    """The gate the daemon runs: ``[admission]``'s limit and queue (the twin keeps the default classes)."""
    table = tomllib.loads(config.read_text()).get("admission", {}) if config.is_file() else {}
    return AdmissionConfig(limit=table.get("limit", 64), max_queue=table.get("max_queue", 1024))


def refit(profile: Profile, config: Path, out: Path) -> Profile:
    """``profile`` fitted again against our daemon with ``config``'s engine, as ``bench calibrate
    --config`` does, keeping its name, hardware and model strings."""
    path = out / f"{profile.name}.toml"
    engine = tomllib.loads(config.read_text()).get("engine", {})
    keys = ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy")
    overrides = {k: engine.get(k) for k in keys}
    with our_daemon(config, out / "calibrate-logs") as server:
        refitted = calibrate(
            server.base_url,
            server.metrics_url,
            path,
            profile.name,
            CalibrationPlan(),
            overrides,
            (profile.hardware, profile.model),
        )
    print("\n".join(describe_fit(refitted, path)), flush=True)
    return refitted


def simulate(
    specs: list[RequestSpec],
    profile: Profile,
    admission: AdmissionConfig,
    seed: int = 0,
    variance: bool = True,
) -> dict[str, Any]:
    from controller.sim.twin import build_simulation  # here: the twin's engine client loads vLLM

    sim = build_simulation(profile, admission=admission, seed=seed, use_variance=variance)
    return figures(asyncio.run(sim.run(specs)).summary(None, None))


def twin_rows(
    specs: list[RequestSpec], real: dict[str, Any], profile: Profile, admission: AdmissionConfig
) -> dict[str, Any]:
    """The twin with the profile's measured spread (seed 0), its p99 TTFT over seeds 0-4, and the
    mean model (no [variance]), each against the real figures."""
    twin = simulate(specs, profile, admission)
    mean = simulate(specs, profile, admission, variance=False)
    seeds = [simulate(specs, profile, admission, seed=k)["ttft_p99"] for k in range(1, SEEDS)]
    return {
        "twin": twin,
        "twin_over_real": ratios(twin, real),
        "twin_p99_over_seeds": [twin["ttft_p99"], *seeds],
        "twin_mean_model": mean,
        "twin_mean_model_over_real": ratios(mean, real),
    }


def ratios(twin: dict[str, Any], real: dict[str, Any]) -> dict[str, float | None]:
    return {k: (twin[k] / real[k] if real.get(k) and twin.get(k) is not None else None) for k in RATIO_KEYS}


def figures(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s.get(k) for k in FIGURES}


def token_ids(spec: RequestSpec) -> tuple[list[int], int]:
    """The prompt as token ids, exactly ``spec.prompt_tokens`` of them (seeded by the request's index)."""
    rng = random.Random(spec.index)
    return [rng.randrange(10, 1000) for _ in range(spec.prompt_tokens)], spec.prompt_tokens


async def replay(url: str, specs: list[RequestSpec], warm: bool) -> tuple[list[RequestRecord], float]:
    """Warm the engine up (its first replay: about 5 min of prompts on SmolLM2 on a 2-core CPU, which
    a repeat need not pay again), then send ``specs`` open loop; (records, seconds from start to the
    last end)."""
    target = Target(url, str((await model_info(url))["id"]))
    for n, prompt in WARM_UP if warm else ():
        warm_up = [RequestSpec(10_000 + k, 0.0, prompt, 16) for k in range(n)]
        await run_open_loop(
            target,
            warm_up,
            token_ids,
            run_start=time.monotonic(),
            timeout_s=900,
            max_connections=MAX_CONNECTIONS,
        )
    start = time.monotonic() + 0.5
    records = await run_open_loop(
        target, specs, token_ids, run_start=start, timeout_s=900, max_connections=MAX_CONNECTIONS
    )
    return records, time.monotonic() - start


def replay_real(url: str, specs: list[RequestSpec], keep: Path, warm: bool) -> dict[str, Any]:
    records, duration = asyncio.run(replay(url, specs, warm))
    keep.mkdir(parents=True, exist_ok=True)
    write_jsonl(keep / "records.jsonl", records)
    end = max(duration, max((r.arrival_s + (r.e2e_s or 0)) for r in records))
    return figures(summarize(records, end, None, None))


def print_table(out: list[dict[str, Any]]) -> None:
    print("\n| time scale | twin | requests | throughput tok/s real / twin ", end="")
    print("| TTFT p50 ms real / twin | TTFT p99 ms real / twin | TPOT p50 ms real / twin |")
    print("|---" * 7 + "|")
    scales = (("throughput_tok_s", 1.0), ("ttft_p50", 1e3), ("ttft_p99", 1e3), ("tpot_p50", 1e3))
    for row in out:
        for label, twin_key in (("measured spread", "twin"), ("mean model", "twin_mean_model")):
            cells = [f"{row['time_scale']:g}", label, str(row["real"]["requests"])]
            for key, scale in scales:
                real, twin, ratio = row["real"][key], row[twin_key][key], row[twin_key + "_over_real"][key]
                cells.append(f"{real * scale:.1f} / {twin * scale:.1f} ({ratio:.2f}x)")
            print("| " + " | ".join(cells) + " |")
    for row in out:
        p99 = [round(v * 1e3, 1) for v in row["twin_p99_over_seeds"]]
        print(f"time scale {row['time_scale']:g}: twin p99 TTFT over seeds 0-{SEEDS - 1}: {p99} ms")
        runs = row["real_runs"]
        if len(runs) > 1:
            for key, scale in scales:
                vals = [r[key] * scale for r in runs]
                spread = max(vals) / min(vals) - 1 if min(vals) > 0 else math.inf
                print(
                    f"time scale {row['time_scale']:g}: real {key} over {len(runs)} runs (median is 'real'): "
                    f"{', '.join(f'{v:.1f}' for v in vals)}; max / min - 1 = {spread:.0%}"
                )

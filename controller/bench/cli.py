"""``vllm-autopilot bench``: parsing and dispatch of run, sweep, compare, frontend, soak, chaos, overload,
fleet, report, calibrate and validate (the last two name their own ``main``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp

from controller.bench.runner import add_slo_args, run_config
from controller.load.options import add_workload_args, build_specs
from controller.load.prompts import PromptBuilder, TokenizerError, load_tokenizer, tokenizer_path
from controller.load.workload import WorkloadError
from controller.results.tables import format_summary

DEFAULT_CONFIG = Path("config.toml")


def add_bench_commands(cmds: Any) -> None:
    """Register run, sweep, compare, frontend, soak, chaos, overload, fleet, report, calibrate and validate as
    ``bench`` commands."""
    run = cmds.add_parser("run", help="one workload against a running OpenAI-compatible server")
    run.add_argument("--url", required=True, help="data plane, e.g. http://127.0.0.1:8000")
    run.add_argument("--out", type=Path, required=True, help="run directory to write")
    run.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    run.add_argument("--tokenizer", type=Path, help="local model dir (default: the root /v1/models reports)")
    run.add_argument("--admin-url", help="our daemon's control plane: scrape its /metrics and /state")
    run.add_argument("--metrics-url", help="Prometheus page with vllm:* metrics (default URL/metrics)")
    run.add_argument("--label", help="name of this run in tables and plots (default: the out dir's name)")
    add_workload_args(run)
    add_slo_args(run)

    from controller.bench.calibrate import run as calibrate
    from controller.bench.calibrate import validate
    from controller.bench.chaos import run as chaos
    from controller.bench.experiments import compare, fleet, frontend, overload, soak, sweep
    from controller.results import report

    chaos.add_parser(cmds)
    fleet.add_parser(cmds)
    compare.add_parser(cmds)
    frontend.add_parser(cmds)
    sweep.add_parser(cmds)
    soak.add_parser(cmds)
    overload.add_parser(cmds)
    report.add_parser(cmds)
    calibrate.add_parser(cmds)
    validate.add_parser(cmds)


def bench_main(args: argparse.Namespace) -> int:
    """Run the ``bench`` subcommand that ``add_bench_commands`` registered."""
    from controller.bench.chaos import run as chaos
    from controller.bench.experiments import compare, fleet, frontend, overload, soak, sweep
    from controller.results import report

    handlers = {
        "run": _run,
        "chaos": chaos.main,
        "compare": compare.main,
        "sweep": sweep.main,
        "soak": soak.main,
        "overload": overload.main,
        "report": report.main,
        "frontend": frontend.main,
        "fleet": fleet.main,
    }
    try:
        return handlers[args.bench_command](args)
    except (WorkloadError, TokenizerError, FileNotFoundError, ValueError) as exc:
        print(f"bench {args.bench_command}: {exc}", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:  # server unreachable or failed to start
        print(f"bench {args.bench_command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    return asyncio.run(_run_async(args))


async def _run_async(args: argparse.Namespace) -> int:
    from controller.bench.runner import Endpoints, run_workload
    from controller.load.client import Target, model_info

    info = await model_info(args.url)
    model = args.model or str(info["id"])
    tokenizer = load_tokenizer(tokenizer_path(args.tokenizer, info.get("root")))
    max_len = int(info.get("max_model_len") or 2048)
    specs = build_specs(args, tokenizer, max_len)
    if args.admin_url:
        admin = args.admin_url.rstrip("/")
        endpoints = Endpoints(args.metrics_url or f"{admin}/metrics", f"{admin}/state")
    else:
        endpoints = Endpoints(args.metrics_url or f"{args.url.rstrip('/')}/metrics")
    summary = await run_workload(
        Target(args.url, model),
        specs,
        PromptBuilder(tokenizer, seed=args.seed),
        run_config(args, args.out),
        endpoints,
        label=args.label or args.out.name,
        extra={"argv": sys.argv},
    )
    print(format_summary(summary))
    print(f"run written to {args.out}")
    return 0 if summary["ok"] > 0 else 1

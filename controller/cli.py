"""``vllm-autopilot``: serve, check-config, make-tiny-model, simulate, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from controller.config.load import DEFAULT_CONFIG, ConfigError, describe, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-autopilot", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the daemon in the foreground (systemd runs this)")
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    check = sub.add_parser("check-config", help="validate a config file and print the effective config")
    check.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    tiny = sub.add_parser("make-tiny-model", help="build the local CPU test model into DIR")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--if-missing", action="store_true", help="do nothing when DIR already holds it")
    from controller.bench.cli import add_bench_commands
    from controller.sim.cli import add_calibrate_parser, add_simulate_parser

    add_simulate_parser(sub)
    bench = sub.add_parser("bench", help="benchmark and tune: run, sweep, compare, soak, report, calibrate")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_commands(bench_sub)  # run, sweep, compare, soak, report
    add_calibrate_parser(bench_sub)  # each bench tool adds its own parser to bench_sub
    return p


def _load_or_exit(path: Path) -> object:
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"{path}: invalid config ({len(exc.errors)} error(s)):", file=sys.stderr)
        for err in exc.errors:
            print(f"  - {err}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "make-tiny-model":
        from controller.models.tiny import ensure_tiny_model, make_tiny_model

        out = ensure_tiny_model(args.dir) if args.if_missing else make_tiny_model(args.dir)
        print(f"tiny model ready in {out}")
        return 0
    if args.command == "simulate":
        from controller.sim.cli import run_simulate

        return run_simulate(args)
    if args.command == "bench" and args.bench_command == "calibrate":
        from controller.sim.cli import run_calibrate

        return run_calibrate(args)
    if args.command == "bench":
        from controller.bench.cli import bench_main

        return bench_main(args)
    if args.command == "serve":
        from controller.lifecycle.logs import configure_logging

        configure_logging()  # before anything imports vLLM (load_config does): vLLM logs through it
    config = _load_or_exit(args.config)
    if args.command == "check-config":
        print(json.dumps(describe(config), indent=2, default=str))  # type: ignore[arg-type]
        return 0
    from controller.lifecycle.daemon import serve
    from policies.base import PolicyError

    try:
        return asyncio.run(serve(config))  # type: ignore[arg-type]
    except PolicyError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 1

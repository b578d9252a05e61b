"""``vllm-autopilot``: serve, check-config, make-model, gpu-check, simulate, bench.

Each subcommand's parser names its handler with ``set_defaults(func=...)``; ``main`` only calls it,
except ``serve``, whose options ``main`` hands to vLLM's own serve parser (config/cli_layer.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import structlog

from controller.bench.cli import add_bench_commands, bench_main
from controller.bench.gpucheck import add_gpu_check_parser
from controller.config.cli_layer import serve_config
from controller.config.load import DEFAULT_CONFIG, Config, ConfigError, describe, load_config
from controller.engine.runtime.heap import DAEMON_ARENAS, cap_malloc_arenas
from controller.lifecycle.logs import configure_logging
from controller.models.cli import add_model_parser
from controller.sim.cli import add_simulate_parser
from policies.base import PolicyError


def _load_or_exit(where: object, load: Callable[[], Config]) -> Config:
    try:
        return load()
    except ConfigError as exc:
        print(f"{where}: invalid config ({len(exc.errors)} error(s)):", file=sys.stderr)
        for err in exc.errors:
            print(f"  - {err}", file=sys.stderr)
        sys.exit(1)


def _serve(argv: list[str]) -> int:
    """``serve [MODEL] [any vllm serve option] [--config FILE.toml]`` (config/cli_layer.py)."""
    configure_logging()  # before anything imports vLLM (the parser does): vLLM logs through it
    # before torch and the tokenizer start threads: each thread's arena is made at its first malloc
    structlog.get_logger(__name__).info("malloc_arenas", reason=cap_malloc_arenas(), arenas=DAEMON_ARENAS)
    config = _load_or_exit("vllm-autopilot serve", lambda: serve_config(argv))
    # Lazy: the daemon imports vLLM (~20 s), which no other subcommand needs.
    import uvloop

    from controller.lifecycle.daemon import ListenError, serve

    try:
        # uvloop, as `vllm serve` runs its server: on asyncio's own loop the front end spent about 1 ms
        # more CPU a request (py-spy, docs/results/frontend.md)
        return uvloop.run(serve(config))
    except (PolicyError, ListenError) as exc:
        print(f"{config.path}: {exc}", file=sys.stderr)
        return 1


def _check_config(args: argparse.Namespace) -> int:
    config = _load_or_exit(args.config, lambda: load_config(args.config))
    print(json.dumps(describe(config), indent=2, default=str))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-autopilot", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    # Listed here for the top-level --help; main() hands its arguments to vLLM's serve parser.
    sub.add_parser(
        "serve",
        help="run the daemon in the foreground: [MODEL] [any vllm serve option] [--config FILE.toml] "
        "(systemd runs this)",
        add_help=False,
    )
    check = sub.add_parser("check-config", help="validate a config file and print the effective config")
    check.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    check.set_defaults(func=_check_config)
    add_model_parser(sub)
    add_gpu_check_parser(sub)
    add_simulate_parser(sub)
    bench = sub.add_parser("bench", help="benchmark and tune: run, sweep, compare, soak, report, calibrate")
    bench.set_defaults(func=bench_main)  # calibrate and validate set their own
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_commands(bench_sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # vLLM's parser, not argparse's subparser, reads serve's options
        return _serve(argv[1:])
    args = _parser().parse_args(argv)
    return int(args.func(args))

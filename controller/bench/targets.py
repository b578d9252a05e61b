"""Building the servers of a sweep or a comparison: one base config, one workload, many server specs.

Also the one loop that starts each server in turn, runs the workload against it and writes its run directory
(``OUT/<target>/``), used by ``sweep``, ``compare`` and ``soak``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.bench.memory import MemoryProbe
from controller.bench.runner import Endpoints, run_config, run_workload
from controller.bench.servers import (
    Launched,
    ServerSpec,
    launched,
    load_base_config,
    reconfigure,
    served_model,
)
from controller.load.client import Target
from controller.load.options import build_specs
from controller.load.prompts import PromptBuilder, Tokenizer, load_tokenizer
from controller.load.workload import RequestSpec
from controller.results.records import SUMMARY, read_summary
from controller.results.tables import format_summary

# Settings a plain `vllm serve` baseline leaves at vLLM's defaults (the knobs a sweep or a policy tunes).
TUNED_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_num_active_seqs")


def parse_value(text: str) -> Any:
    """A command-line value as TOML would read it: int, float, bool, else the string."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text


def parse_assignments(items: Sequence[str], what: str) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}``; errors name the option."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what} {item!r}: write KEY=VALUE, e.g. {what} max_num_seqs=32")
        out[key.strip()] = parse_value(value)
    return out


@dataclass
class Bench:
    """What every server of a sweep/comparison shares: base config, workload, prompts, run settings."""

    base: dict[str, Any]
    specs: list[RequestSpec]
    builder: PromptBuilder
    args: argparse.Namespace

    @property
    def engine(self) -> dict[str, Any]:
        engine: dict[str, Any] = self.base["engine"]
        return engine


def base_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--config`` with the ``--engine`` and ``--daemon`` overrides laid over it."""
    base = load_base_config(args.config)
    engine = parse_assignments(args.engine or [], "--engine")
    if "model" in engine and Path(str(engine["model"])).exists():  # a local dir, named from where we run
        engine["model"] = str(Path(str(engine["model"])).resolve())
    base["engine"].update(engine)
    for key, value in parse_assignments(args.daemon or [], "--daemon").items():
        table, dot, name = key.partition(".")
        if not dot or table == "engine":
            raise ValueError(f"--daemon {key}: write TABLE.KEY=VALUE, e.g. --daemon control.tick_s=0.5")
        base.setdefault(table, {})[name] = value
    return base


def prepare(args: argparse.Namespace) -> Bench:
    """Load ``--config``, apply ``--engine`` overrides, build the workload with the model's tokenizer."""
    base = base_config(args)
    steer_to_slo(base, args)
    tokenizer: Tokenizer = load_tokenizer(Path(args.tokenizer or base["engine"]["model"]))
    max_len = int(base["engine"].get("max_model_len") or 2048)
    specs = build_specs(args, tokenizer, max_len)
    return Bench(base, specs, PromptBuilder(tokenizer, seed=args.seed), args)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The daemon config a bench command starts its servers from, and how long a start may take."""
    p.add_argument(
        "--config",
        type=Path,
        default=Path("config.toml"),
        help="daemon config whose [engine] every server uses (default config.toml)",
    )
    p.add_argument(
        "--engine",
        action="append",
        metavar="KEY=VALUE",
        help="override an [engine] setting for every server (repeatable)",
    )
    p.add_argument(
        "--daemon",
        action="append",
        metavar="TABLE.KEY=VALUE",
        help="override a setting of the daemon's other tables (repeatable), "
        "e.g. server.engine_poll_sleep_s=0.0002 or control.tick_s=0.5",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for a server's health"
    )


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: the [engine] model dir)")
    p.add_argument("--out", type=Path, required=True, help="directory; each server's run goes to OUT/<name>/")
    p.add_argument("--resume", action="store_true", help="skip servers whose run directory is complete")


def run_dir(out: Path, name: str) -> Path:
    return out / "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)


def run_servers(bench: Bench, servers: Sequence[ServerSpec], out: Path) -> list[dict[str, Any]]:
    """Start each server in turn, run the workload on it, stop it; returns each run's summary in order."""
    summaries: list[dict[str, Any]] = []
    for spec in servers:
        target_dir = run_dir(out, spec.name)
        if bench.args.resume and (target_dir / SUMMARY).is_file():
            print(f"{spec.name}: kept from an earlier invocation ({target_dir})", flush=True)
            summaries.append(read_summary(target_dir))
            continue
        if target_dir.exists():
            shutil.rmtree(target_dir)
        summaries.append(run_one(bench, spec, target_dir, out / "logs"))
    return summaries


def run_one(bench: Bench, spec: ServerSpec, target_dir: Path, logs: Path) -> dict[str, Any]:
    """One server's lifetime: start, run the workload, stop; its exit is recorded in its summary."""
    print(f"{spec.name}: starting {spec.kind} (log {logs})", flush=True)
    with launched(spec, bench.base, logs, startup_timeout_s=bench.args.startup_timeout) as server:
        print(f"{spec.name}: healthy after {server.startup_s:.1f} s; running the workload", flush=True)
        summary = run_on(bench, server, target_dir)
    return finish(summary, server, target_dir)


def run_live(bench: Bench, servers: Sequence[ServerSpec], out: Path) -> list[dict[str, Any]]:
    """Every spec on one daemon, each after the last by reload (their [engine] tables are the same):
    one engine build for the whole sweep, and the knobs move as the loop moves them in production."""
    summaries: list[dict[str, Any]] = []
    first = servers[0]
    print(f"{first.name}: starting {first.kind} (log {out / 'logs'})", flush=True)
    with launched(first, bench.base, out / "logs", startup_timeout_s=bench.args.startup_timeout) as server:
        print(f"{first.name}: healthy after {server.startup_s:.1f} s", flush=True)
        for spec in servers:
            target_dir = run_dir(out, spec.name)
            if target_dir.exists():
                shutil.rmtree(target_dir)
            if spec is not first:
                reconfigure(server, spec, bench.base)
            print(f"{spec.name}: in force; running the workload", flush=True)
            summaries.append(run_on(bench, server, target_dir))
    return [finish(s, server, run_dir(out, str(s["target"]))) for s in summaries]


def run_on(bench: Bench, server: Launched, target_dir: Path) -> dict[str, Any]:
    """The workload against a running server, as ``server.spec`` configures it."""
    spec = server.spec
    cfg = run_config(bench.args, target_dir)
    extra = {
        "server": spec.kind,
        "engine": spec.engine,
        "control": spec.control,
        "admission": spec.admission,
        "startup_s": server.startup_s,
        **spec.tags,
    }
    summary = asyncio.run(
        run_workload(
            Target(server.base_url, served_model(spec.engine)),
            bench.specs,
            bench.builder,
            cfg,
            Endpoints(server.metrics_url, server.state_url),
            label=spec.name,
            probe=MemoryProbe(server.pid),
            extra=extra,
        )
    )
    summary["server_alive_at_end"] = server.alive()
    return summary


def finish(summary: dict[str, Any], server: Launched, target_dir: Path) -> dict[str, Any]:
    """The server's exit into the run's summary, written and printed."""
    summary["exit_code"], summary["killed"] = server.exit_code, server.killed
    (target_dir / SUMMARY).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    print(format_summary(summary), flush=True)
    return summary


def fail(message: str) -> int:
    print(message, file=sys.stderr)
    return 2


def steer_to_slo(base: dict[str, Any], args: argparse.Namespace) -> None:
    """``--slo-ttft`` / ``--slo-tpot`` (both given) become the daemon's ``[slo]`` when ``--config`` has
    none: the SLO goodput counts is the one the loop steers to."""
    ttft, tpot = getattr(args, "slo_ttft", None), getattr(args, "slo_tpot", None)
    if "slo" not in base and ttft is not None and tpot is not None:
        base["slo"] = {"ttft_s": ttft, "tpot_s": tpot}
